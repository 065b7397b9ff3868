//! Scenario 1: steady contention, the baseline.

use super::*;

// ---------------------------------------------------------------------------------------
// 1. Steady contention, baseline
// ---------------------------------------------------------------------------------------

/// Four app instances × four workers on three hot keys, all nodes healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s01_baseline_contention() {
    let _serial = SERIAL.lock().await;
    let servers = RedisServer::start_many(3);
    let ttl = Duration::from_secs(2);
    let options = LockOptions::default().ttl(ttl);
    let lockers = lockers(4, &urls(&servers), &options);
    let history = History::new("s01_baseline_contention");
    let load = Load::new(&["hot:a", "hot:b", "hot:c"], ttl);

    let workers = Workers::spawn(&load, &lockers, 4, &history);
    progress(&history, n(2000), bound(60), "steady contention").await;
    workers.stop().await;

    assert_nothing_held(&servers, &lockers, ttl).await;
    let summary = report(finish(&history, &lockers));
    print_samples(&load);
    assert!(summary.cycles >= n(2000));
    assert_eq!(
        summary.lost_leases, 0,
        "no lease may be lost on healthy nodes"
    );
    assert_eq!(summary.rejected_stale_writes, 0);
}
