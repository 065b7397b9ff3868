//! Scenario 5: a slow network, a partitioned node, connection resets and cut replies.

use super::*;

// ---------------------------------------------------------------------------------------
// 5. Slow network (0–30 ms jitter) and a partitioned node, then healing
// ---------------------------------------------------------------------------------------

/// Every node sits behind a proxy adding 0–30 ms of jitter per chunk and direction.
/// Then one node at a time is partitioned (blackholed); after each heal another node is
/// partitioned, so the quorum needs the healed one: progress proves the locker works
/// with it again. Variant: a partition that also resets the connections (the locker
/// must reconnect through a blackhole, then heal). Finally each locker's lease must be
/// written on all three nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s05_latency_jitter_and_partition() {
    let _serial = SERIAL.lock().await;
    let servers = RedisServer::start_many(3);
    let proxies: Vec<Proxy> = servers.iter().map(|s| Proxy::start(s.addr())).collect();
    for proxy in &proxies {
        proxy.set_latency(Latency::Jitter(ms(30)));
    }
    let ttl = Duration::from_secs(2);
    // Requests and replies take up to 30 ms each way: the per-node timeout must allow it.
    let options = LockOptions::default().ttl(ttl).node_timeout(ms(100));
    let lockers = lockers(4, &proxy_urls(&proxies), &options);
    let history = History::new("s05_latency_jitter_and_partition");
    let resources: Vec<String> = (0..48).map(|i| format!("slow:{i}")).collect();
    let resources: Vec<&str> = resources.iter().map(String::as_str).collect();
    let load = Load::new(&resources, ttl);

    let workers = Workers::spawn(&load, &lockers, 10, &history);
    let step = n(200);
    progress(&history, step, bound(30), "jitter 0-30 ms").await;

    proxies[2].blackhole();
    progress(&history, step, bound(30), "node 2 partitioned").await;
    proxies[2].heal();
    proxies[0].blackhole();
    progress(
        &history,
        step,
        bound(30),
        "node 2 healed, node 0 partitioned (quorum needs node 2)",
    )
    .await;
    proxies[0].heal();

    // A partition that killed the connections: the locker reconnects into the blackhole.
    let accepted_before = proxies[1].connections_accepted();
    proxies[1].blackhole();
    proxies[1].reset_connections();
    progress(
        &history,
        step,
        bound(30),
        "node 1 partitioned, its connections reset",
    )
    .await;
    proxies[1].heal();
    proxies[2].blackhole();
    progress(
        &history,
        step,
        bound(30),
        "node 1 healed, node 2 partitioned (quorum needs node 1)",
    )
    .await;
    proxies[2].heal();
    let reconnects = proxies[1].connections_accepted() - accepted_before;
    workers.stop().await;

    // Every locker holds a lease on all three nodes again.
    for (i, locker) in lockers.iter().enumerate() {
        let resource = format!("final:{i}");
        let lease = acquire_patiently(locker, &resource, bound(10)).await;
        let key = key_of(&resource);
        let owner = lease.owner().to_owned();
        let start = Instant::now();
        while !servers.iter().all(|s| held_by(s.get(&key), &owner)) {
            let holders: Vec<bool> = servers
                .iter()
                .map(|s| held_by(s.get(&key), &owner))
                .collect();
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "locker {i}: lease not written on every node after healing (per node: {holders:?})"
            );
            tokio::time::sleep(support::POLL_INTERVAL).await;
        }
        assert_eq!(lease.release().await, ReleaseOutcome::Released);
    }

    assert_nothing_held(&servers, &lockers, ttl).await;
    let summary = report(finish(&history, &lockers).note("node1_reconnections", reconnects));
    print_samples(&load);
    assert!(summary.cycles >= 5 * step);
    assert_eq!(summary.lost_leases, 0);
}

/// Connections reset (RST) and replies cut in the middle while app instances contend:
/// an acquire whose reply was cut may have landed, so the engine must clean it up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s05b_connection_resets_and_cut_replies() {
    let _serial = SERIAL.lock().await;
    let servers = RedisServer::start_many(3);
    let proxies: Vec<Proxy> = servers.iter().map(|s| Proxy::start(s.addr())).collect();
    let ttl = ms(1000);
    let options = LockOptions::default().ttl(ttl);
    let lockers = lockers(3, &proxy_urls(&proxies), &options);
    let history = History::new("s05b_connection_resets_and_cut_replies");
    let load = Load::new(&HOT8, ttl);

    let workers = Workers::spawn(&load, &lockers, 4, &history);
    progress(&history, 200, bound(30), "before the faults").await;
    let rounds = n(8);
    let mut cuts = [0u64; 3];
    for round in 0..rounds {
        let i = usize::try_from(round % 3).unwrap_or(0);
        proxies[i].cut_next_reply();
        cuts[i] += 1;
        if tokio::time::timeout(bound(10), proxies[i].cuts_reached(cuts[i]))
            .await
            .is_err()
        {
            panic!("round {round}: no reply of node {i} was cut");
        }
        progress(
            &history,
            50,
            bound(30),
            &format!("round {round}: reply of node {i} cut"),
        )
        .await;
        proxies[(i + 1) % 3].reset_connections();
        progress(
            &history,
            50,
            bound(30),
            &format!("round {round}: node {} reset", (i + 1) % 3),
        )
        .await;
    }
    workers.stop().await;

    // Cleanup of every attempt whose reply was lost happens well before the ttl.
    assert_nothing_held(&servers, &lockers, ttl).await;
    let summary = report(
        finish(&history, &lockers)
            .note("cuts", cuts.iter().sum::<u64>())
            .note("resets", rounds),
    );
    print_samples(&load);
    assert!(summary.cycles >= 200 + 100 * rounds);
}
