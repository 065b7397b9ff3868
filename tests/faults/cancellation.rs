//! Scenario 8: holders aborted and acquires cancelled mid-way leave nothing behind.

use super::*;

// ---------------------------------------------------------------------------------------
// 8. A holder aborted mid-critical-section releases promptly
// ---------------------------------------------------------------------------------------

/// A holder task is aborted inside its critical section (its future, holding the
/// `Lease`, is dropped). The lock key must be gone on every node well before the ttl
/// (30 s): the bound of the poll is 10 s, and the node timeout is generous, so that a
/// background release is not cut short by a loaded machine. Alternates between three
/// app instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s08_aborted_holder_releases_promptly() {
    let _serial = SERIAL.lock().await;
    let servers = RedisServer::start_many(3);
    let ttl = Duration::from_secs(30);
    let options = support::patient().ttl(ttl);
    let lockers = lockers(3, &urls(&servers), &options);
    let history = History::new("s08_aborted_holder_releases_promptly");
    let limit = Duration::from_secs(10);
    assert!(limit < ttl / 2);

    let cycles = n(300);
    let mut slowest = Duration::ZERO;
    for i in 0..cycles {
        let locker = lockers[usize::try_from(i % 3).unwrap_or(0)].clone();
        let resource = format!("abort:{}", i % 4);
        let key = key_of(&resource);
        let (inside_tx, inside_rx) = oneshot::channel();
        let task_history = history.clone();
        let holder = tokio::spawn(async move {
            let lease = acquire_patiently(&locker, &resource, bound(10)).await;
            let mut section = task_history.begin(
                resource,
                lease.fencing_token().get(),
                format!("aborted holder {i}"),
            );
            section.write();
            let _ = inside_tx.send(lease.owner().to_owned());
            // Inside the critical section until aborted; lease and section drop then.
            std::future::pending::<()>().await;
            drop((lease, section));
        });
        let owner = match tokio::time::timeout(bound(10), inside_rx).await {
            Ok(Ok(owner)) => owner,
            _ => panic!("holder {i} never entered its critical section"),
        };
        // The observer looks at the right key: the holder's key is there before the abort.
        let holding = servers
            .iter()
            .filter(|s| held_by(s.get(&key), &owner))
            .count();
        assert!(
            holding >= 2,
            "cycle {i}: the holder's key is on {holding} nodes only"
        );
        let aborted_at = Instant::now();
        holder.abort();
        let joined = holder.await;
        assert!(
            joined.is_err_and(|e| e.is_cancelled()),
            "holder {i} was not cancelled"
        );
        loop {
            let left: Vec<u16> = servers
                .iter()
                .filter(|s| held_by(s.get(&key), &owner))
                .map(RedisServer::port)
                .collect();
            if left.is_empty() {
                break;
            }
            assert!(
                aborted_at.elapsed() < limit,
                "cycle {i}: the aborted holder's key is still on nodes {left:?} after {limit:?} (ttl {ttl:?})"
            );
            tokio::time::sleep(support::POLL_INTERVAL).await;
        }
        slowest = slowest.max(aborted_at.elapsed());
    }

    assert_nothing_held(&servers, &lockers, limit).await;
    let summary = report(
        finish(&history, &lockers)
            .note("aborts", cycles)
            .note("slowest_release_ms", slowest.as_millis()),
    );
    assert_eq!(summary.cycles, cycles);
}

/// Acquire futures dropped at random points (a caller that gives up, a client that
/// goes away while waiting) must leave nothing behind: no key on any node — checked
/// well before the 30 s ttl — and no local queue entry. The node timeout is generous: a
/// background release that timed out on a loaded machine would leave its key to expire,
/// which is what this scenario would then report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s08b_cancelled_acquires_leave_nothing() {
    let _serial = SERIAL.lock().await;
    let servers = RedisServer::start_many(3);
    let ttl = Duration::from_secs(30);
    let options = support::patient().ttl(ttl);
    let lockers = lockers(3, &urls(&servers), &options);
    let history = History::new("s08b_cancelled_acquires_leave_nothing");
    let attempts = Arc::new(AtomicU64::new(0));
    let cancelled = Arc::new(AtomicU64::new(0));
    let target = n(1500);

    let mut tasks = Vec::new();
    for (l, locker) in lockers.iter().enumerate() {
        for w in 0..4 {
            let locker = locker.clone();
            let history = history.clone();
            let attempts = attempts.clone();
            let cancelled = cancelled.clone();
            tasks.push(tokio::spawn(async move {
                while attempts.fetch_add(1, Ordering::Relaxed) < target {
                    let resource = format!("cancel:{}", rand::random_range(0..3u32));
                    let patience = Duration::from_micros(rand::random_range(0..3000));
                    let attempt = locker.acquire(resource.as_str(), Duration::from_secs(1));
                    match tokio::time::timeout(patience, attempt).await {
                        Ok(Ok(lease)) => {
                            let mut section = history.begin(
                                resource,
                                lease.fencing_token().get(),
                                format!("locker {l} worker {w}"),
                            );
                            section.write();
                            section.end(lease.lost_cause().is_some());
                            lease.release().await;
                        }
                        Ok(Err(e)) if e.is_contention() => history.contended(),
                        // Tolerated and counted, as in every scenario.
                        Ok(Err(LockError::Unavailable { .. })) => history.unavailable(),
                        Ok(Err(e)) => {
                            history.other_error();
                            eprintln!("[faults]   s08b: {e}");
                        }
                        Err(_) => {
                            cancelled.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
    }
    join_all(tasks).await;

    // Anything left would stay for the whole ttl (30 s); the bound is 10 s.
    assert_nothing_held(&servers, &lockers, Duration::from_secs(10)).await;
    let summary = report(
        finish(&history, &lockers)
            .note("attempts", target)
            .note("cancelled", cancelled.load(Ordering::Relaxed)),
    );
    assert!(
        cancelled.load(Ordering::Relaxed) > 0,
        "no attempt was cancelled"
    );
    assert!(summary.cycles > 0, "no attempt succeeded");
}
