//! Scenarios 10–12: nodes that come back with older state (RDB, AOF, Sentinel).

use super::*;

// ---------------------------------------------------------------------------------------
// 10–12. Persistence: nodes that come back with older state
// ---------------------------------------------------------------------------------------

/// Resources that go quiet while the operator restores the nodes (s10).
fn quiet_resources() -> Vec<String> {
    (0..32).map(|i| format!("quiet:{i}")).collect()
}

/// The greatest token handed out so far per resource, from the history.
fn issued(history: &History) -> std::collections::HashMap<String, u64> {
    let mut max = std::collections::HashMap::new();
    for s in history.sections() {
        let entry = max.entry(s.resource).or_insert(0);
        *entry = s.token.max(*entry);
    }
    max
}

/// Three nodes with RDB persistence restored from stale snapshots, one at a time, while
/// four app instances contend. The snapshots are taken one node after the other with
/// work in between (`SAVE`, the moments Redis's `save` schedule would pick); later the
/// nodes are restored from them in turn, a rolling restore from backups: node k is
/// killed, stays down for one ttl (Redlock's delayed restart), comes back from its
/// snapshot, and the work goes on before the next node. Besides eight hot resources,
/// 32 "quiet" resources are used until the snapshots are taken and again after the
/// restores, not during them: their counters are then behind the tokens already handed
/// out on *every* node (checked), which the quorum maximum cannot hide.
///
/// Asserted: fencing and exclusion. Exclusion holds because only one node is down or
/// stale-restarted at a time and each restart waits a ttl: a restored node lacks only
/// keys of leases that expired meanwhile or were renewed on the two other nodes.
///
/// `BROKEN=1`: counters seeded only when missing; the restored counters are trusted,
/// tokens of the quiet resources repeat and the checker fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s10_rdb_nodes_restored_from_stale_snapshots() {
    let _serial = SERIAL.lock().await;
    // No save schedule: the snapshots are taken with SAVE at chosen moments (an
    // automatic BGSAVE running at the same time would refuse that SAVE).
    let mut servers = RedisServer::start_many(3);
    let ttl = ms(400);
    let options = fence_rule(LockOptions::default().ttl(ttl));
    let lockers = lockers(4, &urls(&servers), &options);
    let history = History::new("s10_rdb_nodes_restored_from_stale_snapshots");
    let hot = Load::new(&HOT8, ttl);
    let quiet_names = quiet_resources();
    let quiet_refs: Vec<&str> = quiet_names.iter().map(String::as_str).collect();
    let quiet = Load::new(&quiet_refs, ttl);

    let hot_workers = Workers::spawn(&hot, &lockers, 3, &history);
    let quiet_workers = Workers::spawn(&quiet, &lockers, 1, &history);
    progress(&history, n(150), bound(30), "before the snapshots").await;
    let mut snapshots = Vec::new();
    for (k, server) in servers.iter().enumerate() {
        snapshots.push(blocking(|| server.snapshot()));
        progress(&history, n(150), bound(30), &format!("after snapshot {k}")).await;
    }
    quiet_workers.stop().await;

    for k in 0..servers.len() {
        blocking(|| servers[k].kill());
        // The fault's duration, not a synchronisation: the delayed restart.
        tokio::time::sleep(ttl).await;
        blocking(|| servers[k].restart_from(&snapshots[k]));
        progress(&history, n(100), bound(30), &format!("node {k} restored")).await;
    }
    // Quiet resources whose counter is behind the greatest token handed out on at
    // least two nodes: a majority that only the clock floor keeps from repeating.
    let issued = issued(&history);
    let stale_majority = blocking(|| {
        quiet_names
            .iter()
            .filter(|r| {
                let last = issued.get(*r).copied().unwrap_or(0);
                servers
                    .iter()
                    .filter(|s| counter(s, r).is_some_and(|c| c < last))
                    .count()
                    >= 2
            })
            .count()
    });
    assert!(
        stale_majority > 0,
        "the restores should leave quiet counters behind on a majority"
    );

    let quiet_workers = Workers::spawn(&quiet, &lockers, 1, &history);
    progress(&history, n(300), bound(30), "quiet resources back in use").await;
    quiet_workers.stop().await;
    hot_workers.stop().await;

    let servers_now: Vec<&RedisServer> = servers.iter().collect();
    assert_nothing_held_after_restore(&servers_now, &lockers, ttl * 2).await;
    let summary = report(
        finish(&history, &lockers)
            .note("stale_restores", servers.len())
            .note(
                "quiet_behind_on_majority",
                format!("{stale_majority}/{}", quiet_names.len()),
            ),
    );
    print_samples(&hot);
    print_samples(&quiet);
    assert!(summary.cycles >= n(1200));
}

/// One node with AOF `everysec`, killed (SIGKILL) and restarted after two node timeouts, having lost the
/// tail of its log, four times while four app instances contend on eight resources.
/// A SIGKILL of the process alone loses nothing (the log is in the kernel already);
/// what `everysec` may lose is what a machine crash takes with it: the writes since the
/// last fsync. It is modelled by restarting from a copy of the AOF taken a few hundred
/// critical sections earlier (`snapshot`, then `restart_from`).
///
/// One node rather than three: with three, one node's lost tail is hidden by the quorum
/// (every later majority includes a node whose counter is current, and the write-back
/// raises the stale one), so it would pass under either fence rule; with one node its
/// own counter is all there is (s10 covers a stale majority of three).
///
/// Asserted: fencing only. The lost tail also holds lock keys, and the restart is not
/// delayed, so a lease granted in the tail may still run when another is granted:
/// exclusion is not promised here (overlaps are counted, `overlaps_accepted`), but the
/// later holder's token must be greater.
///
/// `BROKEN=1`: counters seeded only when missing; the counter comes back behind, tokens
/// repeat and the checker fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s11_aof_everysec_node_loses_its_tail() {
    let _serial = SERIAL.lock().await;
    let mut servers = vec![RedisServer::builder().aof(AppendFsync::EverySec).start()];
    let ttl = ms(500);
    let options = fence_rule(LockOptions::default().ttl(ttl));
    let lockers = lockers(4, &urls(&servers), &options);
    let history = History::new("s11_aof_everysec_node_loses_its_tail").without_exclusion();
    let load = Load::new(&HOT8, ttl);

    let workers = Workers::spawn(&load, &lockers, 3, &history);
    progress(&history, n(100), bound(30), "before the first crash").await;
    let rounds = n(4);
    for round in 0..rounds {
        let synced = blocking(|| servers[0].snapshot());
        progress(
            &history,
            200,
            bound(30),
            &format!("round {round}: the tail"),
        )
        .await;
        // The crash: down for longer than a round can take (two node timeouts), so no
        // round whose fence floor was read before the crash is still being re-sent when
        // the node answers again — the fencing docs' assumption for a node that lost
        // acknowledged writes. A restart faster than that could answer such a round
        // with its floor, equal to a token the lost tail held (seen in a CI run).
        blocking(|| servers[0].kill());
        tokio::time::sleep(ms(100)).await; // the default node timeout is 50 ms
        blocking(|| servers[0].restart_from(&synced));
        progress(
            &history,
            50,
            bound(30),
            &format!("round {round}: tail lost"),
        )
        .await;
    }
    workers.stop().await;

    let servers_now: Vec<&RedisServer> = servers.iter().collect();
    assert_nothing_held_after_restore(&servers_now, &lockers, ttl * 2).await;
    let summary = report(finish(&history, &lockers).note("crashes", rounds));
    print_samples(&load);
    assert!(summary.cycles >= n(100) + rounds * 250);
}

/// A Sentinel failover that promotes a replica which missed the latest writes. One
/// Sentinel-managed master as the only lock node, four app instances contend on eight
/// hot resources. The replica is frozen (SIGSTOP) and its link cut by the master
/// (`CLIENT KILL TYPE replica`), the work goes on without it, then the master is
/// SIGKILLed and the replica resumed: the sentinel promotes it with fence counters
/// behind the tokens already handed out (checked), and the lockers follow it.
///
/// Asserted: fencing (tokens keep increasing across the failover) and exclusion — the
/// failover cannot complete before `down-after-milliseconds` (1 s) has passed, longer
/// than the ttl (500 ms), so every lease whose key the promoted replica lacks has
/// expired by then (the "delayed restart" of Redlock, here given by Sentinel itself).
///
/// `BROKEN=1`: counters seeded only when missing; the promoted replica's counters are
/// present but behind, tokens repeat and the checker fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s12_sentinel_failover_to_a_lagging_replica() {
    let _serial = SERIAL.lock().await;
    let mut group = blocking(SentinelGroup::start);
    let old = group.master_port();
    let master = group
        .servers
        .iter()
        .position(|s| s.port() == old)
        .expect("the master is one of the servers");
    let replica = 1 - master;
    let replica_port = group.servers[replica].port();
    let ttl = ms(500);
    let options = fence_rule(LockOptions::default().ttl(ttl));
    let lockers = lockers(4, &[group.url()], &options);
    let history = History::new("s12_sentinel_failover_to_a_lagging_replica");
    let load = Load::new(&HOT8, ttl);

    let workers = Workers::spawn(&load, &lockers, 3, &history);
    progress(&history, n(300), bound(30), "replicated").await;

    // The replica falls behind for good: frozen, and its link closed by the master, so
    // it gets nothing written from now on (not even from kernel buffers).
    blocking(|| group.servers[replica].pause());
    let cut = group.servers[master].cmd(&["CLIENT", "KILL", "TYPE", "replica"]);
    assert_eq!(cut.as_int(), Some(1), "CLIENT KILL TYPE replica: {cut:?}");
    progress(&history, n(400), bound(30), "replica cut off").await;

    let on_master: Vec<Option<u64>> = HOT8
        .iter()
        .map(|r| counter(&group.servers[master], r))
        .collect();
    blocking(|| {
        group.servers[master].kill();
        group.servers[replica].resume();
    });
    let failover = Instant::now();
    // Read before the promotion: only the dead master could have raised them since.
    let on_replica: Vec<Option<u64>> = blocking(|| {
        HOT8.iter()
            .map(|r| counter(&group.servers[replica], r))
            .collect()
    });
    let behind = on_master
        .iter()
        .zip(&on_replica)
        .filter(|(m, r)| r < m)
        .count();
    assert!(
        behind > 0,
        "the replica should have missed increments: master {on_master:?}, replica {on_replica:?}"
    );

    // Down-after 1 s, then the sentinel promotes the only replica.
    blocking(|| {
        support::eventually_blocking("the lagging replica to be promoted", bound(30), || {
            group.master_port() == replica_port && group.role(replica_port) == "master"
        })
    });
    let promoted_in = failover.elapsed();
    progress(&history, n(400), bound(30), "after the failover").await;
    workers.stop().await;

    assert_nothing_held_after_restore(&[&group.servers[replica]], &lockers, ttl * 2).await;
    let summary = report(
        finish(&history, &lockers)
            .note(
                "counters_behind_on_promoted",
                format!("{behind}/{}", HOT8.len()),
            )
            .note("failover_s", format!("{:.2}", promoted_in.as_secs_f64())),
    );
    print_samples(&load);
    assert!(summary.cycles >= n(1100));
}
