//! Scenarios 2–4: nodes killed and restarted empty, a majority down, a node paused
//! longer than the ttl.

use super::*;

// ---------------------------------------------------------------------------------------
// 2. One node killed and restarted empty, repeatedly
// ---------------------------------------------------------------------------------------

/// Node 0 is SIGKILLed and restarted without persistence (empty: its locks and fence
/// counters are gone) again and again while four app instances contend. Only one node
/// ever loses its keys, so every holder keeps a majority; the re-created fence counter
/// starts from the server clock, above every earlier token. Long holders (leases that
/// need renewals) run alongside and must never lose their lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s02_node_killed_and_restarted_empty() {
    let _serial = SERIAL.lock().await;
    let mut servers = RedisServer::start_many(3);
    let ttl = ms(1000);
    let options = LockOptions::default().ttl(ttl);
    let lockers = lockers(4, &urls(&servers), &options);
    let history = History::new("s02_node_killed_and_restarted_empty");
    let load = Load::new(&HOT8, ttl);

    let workers = Workers::spawn(&load, &lockers, 4, &history);
    let (stop_long, _) = watch::channel(false);
    let long = spawn_long_holders(&lockers[..2], ttl * 3 / 2, &history, &stop_long);
    let step = 150;
    progress(&history, step, bound(30), "before the first kill").await;
    let rounds = n(4);
    for round in 0..rounds {
        blocking(|| servers[0].kill());
        progress(
            &history,
            step,
            bound(30),
            &format!("round {round}: node 0 down"),
        )
        .await;
        blocking(|| servers[0].restart());
        progress(
            &history,
            step,
            bound(30),
            &format!("round {round}: node 0 back, empty"),
        )
        .await;
    }
    stop_long.send_replace(true);
    workers.stop().await;
    join_all(long).await;

    assert_nothing_held(&servers, &lockers, ttl * 2).await;
    let summary = report(finish(&history, &lockers).note("restarts", rounds));
    print_samples(&load);
    assert!(summary.cycles >= step * (1 + 2 * rounds));
    assert_eq!(
        summary.lost_leases, 0,
        "a minority failure must not cost a holder its lease"
    );
}

// ---------------------------------------------------------------------------------------
// 3. A majority down: no critical section at all, then recovery
// ---------------------------------------------------------------------------------------

/// Two of three nodes are killed while the app instances contend. From then on every
/// attempt must fail with `LockError::Unavailable` and no critical section may start.
/// Then both nodes come back (empty) and the *same* lockers must work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s03_majority_down_then_recovery() {
    let _serial = SERIAL.lock().await;
    let mut servers = RedisServer::start_many(3);
    let ttl = ms(1000);
    let options = LockOptions::default().ttl(ttl);
    let lockers = lockers(4, &urls(&servers), &options);
    let history = History::new("s03_majority_down_then_recovery");
    let load = Load::new(&["hot:a", "hot:b", "hot:c"], ttl);

    let workers = Workers::spawn(&load, &lockers, 3, &history);
    progress(&history, n(500), bound(30), "before the outage").await;

    blocking(|| {
        servers[1].kill();
        servers[2].kill();
    });
    load.outage.store(true, Ordering::SeqCst);
    let cycles_at_outage = history.cycles();
    let unavailable_before = history.unavailable_count();
    let wanted = n(300);
    support::eventually(
        "enough attempts answered during the outage",
        bound(30),
        || history.unavailable_count() >= unavailable_before + wanted,
    )
    .await;
    // Sections that were already running when the nodes died may finish; none may start.
    let during_outage = history.unavailable_count() - unavailable_before;
    load.outage.store(false, Ordering::SeqCst);
    let finished_in_outage = history.cycles() - cycles_at_outage;

    blocking(|| {
        servers[1].restart();
        servers[2].restart();
    });
    // The lockers were not rebuilt: they must reconnect by themselves.
    let recovery_started = Instant::now();
    progress(&history, n(500), bound(30), "after the majority came back").await;
    let recovered_in = recovery_started.elapsed();
    workers.stop().await;

    assert_nothing_held(&servers, &lockers, ttl * 2).await;
    let summary = report(
        finish(&history, &lockers)
            .note("unavailable_during_outage", during_outage)
            .note("sections_finishing_in_outage", finished_in_outage)
            .note(
                "recovery_500_cycles_s",
                format!("{:.2}", recovered_in.as_secs_f64()),
            ),
    );
    print_samples(&load);
    assert!(summary.unavailable >= wanted);
    assert!(
        finished_in_outage <= 12,
        "only sections already running at the kill may finish during the outage"
    );
}

// ---------------------------------------------------------------------------------------
// 4. A node paused (SIGSTOP) longer than the ttl
// ---------------------------------------------------------------------------------------

/// Node 1 is frozen with SIGSTOP for more than twice the ttl — its port still accepts
/// connections, nothing answers — then resumed, twice. The commands queued meanwhile
/// (acquires and their releases) run late when it resumes. Long holders renew through
/// the pause and must not lose their lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s04_node_paused_longer_than_ttl() {
    let _serial = SERIAL.lock().await;
    let mut servers = RedisServer::start_many(3);
    let ttl = ms(500);
    let options = LockOptions::default().ttl(ttl);
    let lockers = lockers(4, &urls(&servers), &options);
    let history = History::new("s04_node_paused_longer_than_ttl");
    let load = Load::new(&HOT8, ttl);

    let workers = Workers::spawn(&load, &lockers, 4, &history);
    let (stop_long, _) = watch::channel(false);
    let long = spawn_long_holders(&lockers[..2], ttl * 2, &history, &stop_long);
    let step = 250;
    progress(&history, step, bound(30), "before the pause").await;
    let rounds = n(2);
    for round in 0..rounds {
        blocking(|| servers[1].pause());
        let paused_at = Instant::now();
        progress(
            &history,
            step / 2,
            bound(30),
            &format!("round {round}: node 1 paused"),
        )
        .await;
        // The fault lasts longer than the ttl: every key node 1 holds expires meanwhile.
        tokio::time::sleep_until(paused_at + ttl * 2).await;
        blocking(|| servers[1].resume());
        progress(
            &history,
            step,
            bound(30),
            &format!("round {round}: node 1 resumed"),
        )
        .await;
    }
    stop_long.send_replace(true);
    workers.stop().await;
    join_all(long).await;

    assert_nothing_held(&servers, &lockers, ttl * 2).await;
    let summary = report(finish(&history, &lockers).note("pauses", rounds));
    print_samples(&load);
    assert!(summary.cycles >= step + (step + step / 2) * rounds);
    assert_eq!(
        summary.lost_leases, 0,
        "a paused minority must not cost a holder its lease"
    );
}
