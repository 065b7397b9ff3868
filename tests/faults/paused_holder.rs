//! Scenario 6: a holder paused past its ttl (Kleppmann's scenario), made safe by
//! fencing.

use super::*;

// ---------------------------------------------------------------------------------------
// 6. A holder paused past its ttl: Kleppmann's scenario, made safe by fencing
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct KleppmannStats {
    rounds: AtomicU64,
    a_lost: AtomicU64,
    a_write_rejected: AtomicU64,
    b_token_higher: AtomicU64,
    a_release_not_held: AtomicU64,
    a_release_released: AtomicU64,
    c_refused: AtomicU64,
    c_acquired: AtomicU64,
    b_key_intact: AtomicU64,
}

/// One round on `resource`: A takes the lease and "pauses" (awaits its loss); B takes
/// the resource over and writes; A wakes up and writes late; A releases; C tries while
/// B still holds. `heal`/`partition` model how A's renewals are blocked (or not).
#[allow(clippy::too_many_arguments)]
async fn kleppmann_round(
    a_locker: &Redlock,
    b_locker: &Redlock,
    c_locker: &Redlock,
    resource: &str,
    history: &History,
    stats: &KleppmannStats,
    servers: &[RedisServer],
    partition: impl FnOnce(),
    heal: impl FnOnce(),
) {
    let a = acquire_patiently(a_locker, resource, bound(10)).await;
    let a_token = a.fencing_token();
    let mut a_section = history.begin(resource, a_token.get(), "A (paused)");
    partition();
    // A's task stops here, past its ttl: nothing renews the lease; it resumes when the
    // lease is gone (the event, not a guessed sleep).
    let cause = tokio::time::timeout(bound(10), a.lost())
        .await
        .unwrap_or_else(|_| panic!("A's lease on `{resource}` was never reported lost"));
    if !a.is_held() && matches!(cause, LostCause::Expired | LostCause::RenewalFailed) {
        stats.a_lost.fetch_add(1, Ordering::Relaxed);
    }

    // B takes the resource over once A's keys expired on the nodes.
    let b = acquire_patiently(b_locker, resource, bound(10)).await;
    let b_token = b.fencing_token();
    if b_token > a_token {
        stats.b_token_higher.fetch_add(1, Ordering::Relaxed);
    }
    let mut b_section = history.begin(resource, b_token.get(), "B");
    b_section.write();

    // A wakes up and writes with its old token: the storage must refuse it.
    if !a_section.write() {
        stats.a_write_rejected.fetch_add(1, Ordering::Relaxed);
    }
    a_section.end(a.lost_cause().is_some());
    heal();
    match a.release().await {
        ReleaseOutcome::NotHeld => {
            stats.a_release_not_held.fetch_add(1, Ordering::Relaxed);
        }
        ReleaseOutcome::Released => {
            stats.a_release_released.fetch_add(1, Ordering::Relaxed);
        }
        // Nodes that did not answer in time (a loaded machine): says nothing.
        _ => {}
    }
    let key = key_of(resource);
    let b_owner = b.owner().to_owned();
    let intact = blocking(|| {
        servers
            .iter()
            .filter(|s| held_by(s.get(&key), &b_owner))
            .count()
    });
    if intact >= 2 {
        stats.b_key_intact.fetch_add(1, Ordering::Relaxed);
    }

    // C must find the resource held by B; if A's release freed it, C's section
    // overlaps B's and the checker reports it.
    match answered(|| c_locker.try_acquire(resource)).await {
        Ok(c) => {
            stats.c_acquired.fetch_add(1, Ordering::Relaxed);
            let mut c_section = history.begin(resource, c.fencing_token().get(), "C");
            c_section.write();
            c_section.end(c.lost_cause().is_some());
            c.release().await;
        }
        Err(e) if e.is_contention() => {
            stats.c_refused.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => panic!("C on `{resource}`: {e}"),
    }
    b_section.end(b.lost_cause().is_some());
    b.release().await;
    stats.rounds.fetch_add(1, Ordering::Relaxed);
}

/// Kleppmann's scenario. A holder is paused past its ttl — first with the watchdog off
/// (several resources at once), then with the watchdog on but all its connections
/// blackholed so that no renewal gets through. In every round: A's lease is reported
/// lost, B gets a higher token and writes, A's late write is rejected by the storage,
/// A's late release does not free B's lock (owner check), and C cannot get in.
///
/// `BROKEN=1` gives A nodes that release by plain `DEL`: A's late release then deletes
/// B's key, C gets in while B is inside, and the checker fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s06_paused_holder_is_fenced() {
    let _serial = SERIAL.lock().await;
    let servers = RedisServer::start_many(3);
    let ttl = ms(300);
    let options = LockOptions::default().ttl(ttl);
    let direct = urls(&servers);
    let b_locker = Redlock::connect(&direct, options.clone()).await.expect("B");
    let c_locker = Redlock::connect(&direct, options.clone()).await.expect("C");
    let history = History::new("s06_paused_holder_is_fenced");
    let stats = KleppmannStats::default();

    // Part 1: the watchdog is off; A's task simply outlives its ttl. Eight resources in
    // parallel per round.
    let a_unwatched = paused_holder_locker(&direct, &options.clone().watchdog(false)).await;
    let rounds = n(4);
    for round in 0..rounds {
        let resources: Vec<String> = (0..8).map(|i| format!("kleppmann:{i}")).collect();
        let rounds_now = resources.iter().map(|resource| {
            kleppmann_round(
                &a_unwatched,
                &b_locker,
                &c_locker,
                resource,
                &history,
                &stats,
                &servers,
                || {},
                || {},
            )
        });
        if tokio::time::timeout(bound(30), futures_all(rounds_now))
            .await
            .is_err()
        {
            panic!("round {round} (watchdog off) did not finish");
        }
    }

    // Part 2: the watchdog is on, but every connection of A is blackholed: renewals
    // cannot get through, the lease is lost at its deadline, then the network heals.
    let proxies: Vec<Proxy> = servers.iter().map(|s| Proxy::start(s.addr())).collect();
    let a_partitioned = paused_holder_locker(&proxy_urls(&proxies), &options).await;
    let partitioned = n(3);
    for round in 0..partitioned {
        let resource = format!("partitioned:{round}");
        let fut = kleppmann_round(
            &a_partitioned,
            &b_locker,
            &c_locker,
            &resource,
            &history,
            &stats,
            &servers,
            || proxies.iter().for_each(Proxy::blackhole),
            || proxies.iter().for_each(Proxy::heal),
        );
        if tokio::time::timeout(bound(30), fut).await.is_err() {
            panic!("partitioned round {round} did not finish");
        }
    }

    // The checker first: with BROKEN=1 it is the one that must fail.
    let all = [a_unwatched, a_partitioned, b_locker, c_locker];
    let summary = finish(&history, &all);
    let total = rounds * 8 + partitioned;
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let summary = summary
        .note("kleppmann_rounds", get(&stats.rounds))
        .note("a_lost", get(&stats.a_lost))
        .note("b_token_higher", get(&stats.b_token_higher))
        .note("a_late_write_rejected", get(&stats.a_write_rejected))
        .note("a_release_not_held", get(&stats.a_release_not_held))
        .note("b_key_intact", get(&stats.b_key_intact))
        .note("c_refused", get(&stats.c_refused));
    let summary = report(summary);
    assert_eq!(get(&stats.rounds), total);
    assert_eq!(get(&stats.a_lost), total, "A's lease must be reported lost");
    assert_eq!(
        get(&stats.b_token_higher),
        total,
        "B must get a higher token"
    );
    assert_eq!(
        summary.rejected_stale_writes, total,
        "A's late write must be rejected"
    );
    assert_eq!(
        get(&stats.a_release_released),
        0,
        "A's late release must not release B's lock"
    );
    assert_eq!(get(&stats.b_key_intact), total);
    assert_eq!(
        get(&stats.c_refused),
        total,
        "C must not get in while B holds"
    );
    assert_eq!(get(&stats.c_acquired), 0);
    assert_nothing_held(&servers, &all, ttl * 2).await;
}

/// Runs the futures concurrently on this task and waits for all.
async fn futures_all<F: std::future::Future<Output = ()>>(futures: impl Iterator<Item = F>) {
    let all: futures_util::stream::FuturesUnordered<F> = futures.collect();
    use futures_util::StreamExt;
    all.collect::<Vec<()>>().await;
}
