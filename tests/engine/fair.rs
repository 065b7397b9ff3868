//! The cross-process wait queue (issue 16): waiters of several lockers (processes with
//! their own connections) are served in arrival order, a release wakes only the next
//! waiter, a waiter that gives up leaves the queue on every node, and the turn of a
//! waiter whose process stopped is skipped after a bounded time.
//!
//! Every server is spawned by `support` on a free 127.0.0.1 port. Nothing sleeps to
//! synchronise: each waiter's place in the queue is awaited on the servers.
use crate::support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::proxy::Proxy;
use support::{eventually, RedisServer};
use tokio::task::JoinHandle;
use tower_redlock::{LockError, LockOptions, MemoryNode, Redlock};

/// Bound of every wait on the servers and of every acquire.
const LIMIT: Duration = Duration::from_secs(10);

fn options() -> LockOptions {
    LockOptions::default().node_timeout(Duration::from_secs(1))
}

fn locker(urls: &[String]) -> Redlock {
    Redlock::from_urls(urls, options()).unwrap()
}

fn urls(servers: &[RedisServer]) -> Vec<String> {
    servers.iter().map(RedisServer::url).collect()
}

fn queue_key(resource: &str) -> String {
    format!("redlock:{{{resource}}}:queue")
}

/// Waiters in line on `server`: those in its queue, and the one the key is reserved
/// for, if any (a waiter whose failed attempt took the free key there keeps it
/// reserved, `~id:ticket`, instead of a place in the queue).
fn queued(server: &RedisServer, resource: &str) -> i64 {
    let in_queue = match server.cmd(&["ZCARD", &queue_key(resource)]) {
        support::RespValue::Integer(n) => n,
        other => panic!("ZCARD answered {other:?}"),
    };
    let reserved = server
        .get(&format!("redlock:{{{resource}}}"))
        .is_some_and(|value| value.starts_with('~'));
    in_queue + i64::from(reserved)
}

/// Waits until every server has `n` waiters in line for `resource`.
async fn until_queued(servers: &[RedisServer], resource: &str, n: i64) {
    let what = format!("{n} waiter(s) in line for {resource} on every node");
    eventually(&what, LIMIT, || {
        servers.iter().all(|s| queued(s, resource) == n)
    })
    .await;
}

/// Waiters subscribed to their own wake-up channel of `resource` on `server`.
fn waiters_listening(server: &RedisServer, resource: &str) -> usize {
    let pattern = format!("redlock:{{{resource}}}:released:*");
    match server.cmd(&["PUBSUB", "CHANNELS", &pattern]) {
        support::RespValue::Array(channels) => channels.len(),
        other => panic!("PUBSUB CHANNELS answered {other:?}"),
    }
}

/// A waiter in its own locker: acquires, records its number, releases.
fn waiter(
    locker: Redlock,
    resource: &'static str,
    number: usize,
    served: Arc<Mutex<Vec<usize>>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let lease = locker.acquire(resource, LIMIT).await.unwrap();
        served.lock().unwrap().push(number);
        lease.release().await;
    })
}

/// `crash`: the holder never releases; its key expires (deleted here, as if), and the
/// free lock must still go to the queue's head, not to a newcomer.
async fn served_in_arrival_order(nodes: usize, crash: bool) {
    const WAITERS: usize = 5;
    let resource = "fair-order";
    let servers = RedisServer::start_many(nodes);
    let urls = urls(&servers);
    let holder = locker(&urls);
    let lease = holder.try_acquire(resource).await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for number in 0..WAITERS {
        tasks.push(waiter(locker(&urls), resource, number, served.clone()));
        // Arrival is what the queue holds: the next waiter comes once this one is in.
        until_queued(&servers, resource, number as i64 + 1).await;
    }
    if crash {
        std::mem::forget(lease);
        for server in &servers {
            server.cmd(&["DEL", &format!("redlock:{{{resource}}}")]);
        }
        // No barging: the free lock goes to the head, the newcomer is refused.
        let newcomer = locker(&urls).try_acquire(resource).await;
        assert!(
            matches!(newcomer, Err(LockError::Held { .. })),
            "{newcomer:?}"
        );
    } else {
        lease.release().await;
    }
    for task in tasks {
        tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    }
    assert_eq!(*served.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    // Nothing left behind (a winner's leave of the nodes it reached before its
    // predecessor's release runs in the background).
    until_queued(&servers, resource, 0).await;
    eventually("no lock key left", LIMIT, || {
        servers
            .iter()
            .all(|s| !s.exists(&format!("redlock:{{{resource}}}")))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_several_processes_are_served_in_arrival_order_on_one_node() {
    served_in_arrival_order(1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_several_processes_are_served_in_arrival_order_on_three_nodes() {
    served_in_arrival_order(3, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_holder_crashed_the_queue_still_goes_first() {
    served_in_arrival_order(3, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_holder_crashed_the_queue_still_goes_first_on_one_node() {
    // The newcomer's pipelined SET NX takes the free key; the queue seen in the same
    // pipeline sends it to the acquire script, which hands the key to the head.
    served_in_arrival_order(1, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_only_the_next_waiter() {
    let resource = "fair-wake-one";
    let servers = RedisServer::start_many(1);
    let urls = urls(&servers);
    let holder = locker(&urls);
    let lease = holder.try_acquire(resource).await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));
    let lockers: Vec<Redlock> = (0..4).map(|_| locker(&urls)).collect();
    let mut tasks = Vec::new();
    for (number, locker) in lockers.iter().enumerate() {
        tasks.push(waiter(locker.clone(), resource, number, served.clone()));
        until_queued(&servers, resource, number as i64 + 1).await;
    }
    servers[0].reset_stats();
    lease.release().await;
    for task in tasks {
        tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    }
    // Four hand-offs, one wake-up each: no waiter retried in vain.
    let wakeups: u64 = lockers.iter().map(|l| l.metrics().wakeups).sum();
    // One wake-up per hand-off, and none at the last release (nobody queued or
    // listening).
    assert_eq!(servers[0].command_calls("publish"), 4);
    // A waiter whose fallback retry found the key handed to it first was not woken.
    assert!(wakeups <= 4, "{wakeups} wake-ups for 4 hand-offs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_leaves_the_queue_on_every_node() {
    let resource = "fair-leave";
    let servers = RedisServer::start_many(3);
    let urls = urls(&servers);
    let holder = locker(&urls);
    let lease = holder.try_acquire(resource).await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));

    // Cancelled: its task is aborted while it waits.
    let cancelled = waiter(locker(&urls), resource, 0, served.clone());
    until_queued(&servers, resource, 1).await;
    let next = waiter(locker(&urls), resource, 1, served.clone());
    until_queued(&servers, resource, 2).await;
    cancelled.abort();
    until_queued(&servers, resource, 1).await;

    // Timed out: its acquire returns, and it is gone too.
    let impatient = locker(&urls);
    let timed_out = tokio::spawn(async move {
        impatient
            .acquire(resource, Duration::from_millis(300))
            .await
            .map(|_| ())
    });
    let outcome = tokio::time::timeout(LIMIT, timed_out)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(outcome, Err(LockError::WaitTimeout { .. })),
        "{outcome:?}"
    );
    until_queued(&servers, resource, 1).await;

    lease.release().await;
    tokio::time::timeout(LIMIT, next).await.unwrap().unwrap();
    assert_eq!(*served.lock().unwrap(), vec![1]);
    until_queued(&servers, resource, 0).await;
}

/// The first waiter's process stops (`kill`: its connections are reset and no new one
/// gets through; else frozen: the connections stay open, nothing flows); the second
/// waiter is served all the same.
async fn a_stopped_waiters_turn_is_skipped(kill: bool) {
    let resource = if kill { "fair-killed" } else { "fair-frozen" };
    let server = RedisServer::start();
    let servers = std::slice::from_ref(&server);
    let url = server.url();
    let holder = locker(std::slice::from_ref(&url));
    let lease = holder.try_acquire(resource).await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));

    let proxy = Proxy::start(server.addr());
    let stopped = waiter(locker(&[proxy.url()]), resource, 0, served.clone());
    until_queued(servers, resource, 1).await;
    let next_locker = locker(std::slice::from_ref(&url));
    let next = waiter(next_locker.clone(), resource, 1, served.clone());
    until_queued(servers, resource, 2).await;
    proxy.blackhole();
    if kill {
        proxy.reset_connections();
        // The server must have seen the killed waiter's subscription go before the
        // release looks for a listener (else it reserves the key for a dead waiter and
        // the next one gets it only after the reservation runs out).
        eventually("the killed waiter no longer listens", LIMIT, || {
            waiters_listening(&server, resource) == 1
        })
        .await;
    }

    lease.release().await;
    // Skipped at once when nobody listens any more; after the reservation
    // (`HANDOFF_TTL`, 1 s) when the process is frozen.
    tokio::time::timeout(LIMIT, next).await.unwrap().unwrap();
    assert_eq!(*served.lock().unwrap(), vec![1]);
    if kill {
        // Handed the key by the release itself, not found by a later retry.
        assert_eq!(next_locker.metrics().wakeups, 1);
    }
    stopped.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_waiters_turn_is_skipped() {
    a_stopped_waiters_turn_is_skipped(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_waiters_turn_is_skipped_after_its_reservation() {
    a_stopped_waiters_turn_is_skipped(false).await;
}

/// The same order over in-process nodes: `MemoryNode` keeps the same queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_nodes_serve_waiters_in_arrival_order_too() {
    const WAITERS: usize = 4;
    let resource = "fair-memory";
    let nodes = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    let locker = || Redlock::new(nodes.clone(), options()).unwrap();
    let holder = locker();
    let lease = holder.try_acquire(resource).await.unwrap();
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for number in 0..WAITERS {
        let waiting = locker();
        tasks.push(waiter(waiting.clone(), resource, number, served.clone()));
        // In line once refused twice: the first attempt, then the one that joined
        // (after subscribing).
        eventually("the waiter joined", LIMIT, || {
            waiting.metrics().contended >= 2
        })
        .await;
    }
    lease.release().await;
    for task in tasks {
        tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    }
    assert_eq!(*served.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    let key = format!("redlock:{{{resource}}}");
    assert!(nodes.iter().all(|n| n.get(&key).is_none()), "no lock left");
}

/// A drain ends the callers already waiting, at once, and takes its waiters out of the
/// nodes' queues: one waits in the draining locker's own queue (behind its lease), one
/// of another locker (another instance) in the nodes' queue, which its drain ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_ends_the_waiting_callers_and_their_places_in_the_queues() {
    let resource = "fair-drain";
    let servers = RedisServer::start_many(3);
    let urls = urls(&servers);
    let draining = locker(&urls);
    let lease = draining.try_acquire(resource).await.unwrap();
    let local = {
        let locker = draining.clone();
        tokio::spawn(async move { locker.acquire(resource, LIMIT).await.map(drop) })
    };
    eventually("the local caller waits", LIMIT, || {
        draining.metrics().waits == 1
    })
    .await;
    let other = locker(&urls);
    let queued_elsewhere = {
        let locker = other.clone();
        tokio::spawn(async move { locker.acquire(resource, LIMIT).await.map(drop) })
    };
    until_queued(&servers, resource, 1).await;
    let served = Arc::new(Mutex::new(Vec::new()));
    let third = waiter(locker(&urls), resource, 3, served.clone());
    until_queued(&servers, resource, 2).await;

    // The drain waits for the lease; the waiter behind it ends now.
    let drain = {
        let locker = draining.clone();
        tokio::spawn(async move { locker.drain(LIMIT).await })
    };
    let outcome = tokio::time::timeout(LIMIT, local).await.unwrap().unwrap();
    assert!(
        matches!(outcome, Err(LockError::Draining { .. })),
        "{outcome:?}"
    );

    assert_eq!(other.drain(LIMIT).await.released_at_deadline, 0);
    let outcome = tokio::time::timeout(LIMIT, queued_elsewhere)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(outcome, Err(LockError::Draining { .. })),
        "{outcome:?}"
    );
    // Its place is gone from every node: only the third waiter is in line.
    until_queued(&servers, resource, 1).await;

    lease.release().await;
    tokio::time::timeout(LIMIT, third).await.unwrap().unwrap();
    assert_eq!(*served.lock().unwrap(), vec![3]);
    let drained = tokio::time::timeout(LIMIT, drain).await.unwrap().unwrap();
    assert_eq!(drained.released_at_deadline, 0);
    assert_eq!(draining.local_resources(), 0);
}
