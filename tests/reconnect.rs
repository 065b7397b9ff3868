//! Node reliability against real `redis-server` processes (issue 19, items 1 and 2):
//! the first request after nodes restart succeeds, and a node going down (and coming
//! back) is logged once per change and readable from the locker.
//!
//! Every server is spawned by `support` on a free 127.0.0.1 port. No test sleeps to
//! synchronise: a restart returns once the server accepts connections, and every
//! check follows an operation whose answers were all awaited.
mod support;

use std::time::Duration;

use support::RedisServer;
use tower_redlock::{LockOptions, Redlock, ReleaseOutcome};

/// Per-node timeout: generous, so a machine busy compiling cannot turn a slow answer
/// into a failed vote. Dead nodes refuse at once; no timeout is expected to fire.
const PATIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the nodes stay down in [`first_acquire_after_nodes_come_back`].
const IDLE_WHILE_DOWN: Duration = Duration::from_millis(500);

fn locker(servers: &[RedisServer]) -> Redlock {
    Redlock::connect(
        servers.iter().map(RedisServer::url),
        LockOptions::default().node_timeout(PATIENT_TIMEOUT),
    )
    .unwrap()
}

fn lock_key(resource: &str) -> String {
    format!("redlock:{{{resource}}}")
}

/// One acquisition that every node answers: the release round waits for each node, so
/// afterwards every node's connection has been used.
async fn use_every_node(locker: &Redlock, servers: &[RedisServer], resource: &str) {
    let lease = locker.try_acquire(resource).await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    for server in servers.iter().filter(|s| s.is_running()) {
        assert!(!server.exists(&lock_key(resource)));
    }
}

/// Restarts `restarted` of the servers of an idle locker whose connections are open,
/// then checks that the very first acquisition succeeds and reached every node.
async fn first_acquire_after_restart(nodes: usize, restarted: usize) {
    let mut servers = RedisServer::start_many(nodes);
    let locker = locker(&servers);
    // Every connection open, then idle.
    use_every_node(&locker, &servers, "warm").await;

    for server in servers.iter_mut().take(restarted) {
        // Returns once the new process accepts connections: the event awaited.
        server.restart();
    }

    let lease = locker
        .try_acquire("first")
        .await
        .expect("the first acquisition after the restart");
    // The restarted nodes voted too (not only the untouched ones): their broken
    // connections were re-established and the command sent again.
    // The nodes that granted it hold the key (their answers arrived).
    let key = lock_key("first");
    let owner = lease.owner().to_owned();
    let holders = servers
        .iter()
        .filter(|s| s.get(&key).as_deref() == Some(owner.as_str()))
        .count();
    assert!(holders >= locker.quorum(), "{holders} nodes hold the key");
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_acquire_after_two_of_three_nodes_restart_succeeds() {
    first_acquire_after_restart(3, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_acquire_after_the_only_node_restarts_succeeds() {
    first_acquire_after_restart(1, 1).await;
}

/// Kills `killed` of the servers, lets an acquisition fail on them (their connections
/// now hold a failed connection attempt), starts them again, and checks that the very
/// first acquisition afterwards succeeds on them: a refusal cached while the server was
/// down is not taken for its answer once it is back.
async fn first_acquire_after_nodes_come_back(nodes: usize, killed: usize) {
    let mut servers = RedisServer::start_many(nodes);
    let locker = locker(&servers);
    use_every_node(&locker, &servers, "warm").await;

    for server in servers.iter_mut().take(killed) {
        server.kill();
    }
    let attempt = locker.try_acquire("while-down").await;
    if killed >= locker.quorum() {
        assert!(attempt.is_err(), "no quorum while down: {attempt:?}");
    } else {
        attempt.unwrap().release().await;
    }
    // The nodes stay down a while, as in production, where they are down for minutes:
    // long enough for the connections' own reconnection attempts (a few, tens of
    // milliseconds apart) to have given up. Part of the scenario, not a synchronisation:
    // no event is awaited, and a shorter wait would only make the test easier.
    tokio::time::sleep(IDLE_WHILE_DOWN).await;
    for server in servers.iter_mut().take(killed) {
        server.restart();
    }

    let lease = locker
        .try_acquire("first")
        .await
        .expect("the first acquisition after the nodes came back");
    let key = lock_key("first");
    let owner = lease.owner().to_owned();
    let holders = servers
        .iter()
        .filter(|s| s.get(&key).as_deref() == Some(owner.as_str()))
        .count();
    assert!(holders >= locker.quorum(), "{holders} nodes hold the key");
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_acquire_after_two_of_three_nodes_come_back_succeeds() {
    first_acquire_after_nodes_come_back(3, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_acquire_after_the_only_node_comes_back_succeeds() {
    first_acquire_after_nodes_come_back(1, 1).await;
}
