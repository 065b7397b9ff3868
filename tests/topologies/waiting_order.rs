//! Commands given to a node while it waits for what it needs before it can send (a
//! `SentinelNode`'s master lookup, a `ClusterNode`'s connection) reach the server in the
//! order they were given, as on a `RedisNode` whose connection is being made
//! (`engine::command_batches`). Otherwise a waiter's leave could overtake the straggler
//! attempt that queued it, and the entry would stay behind in the wait queue.
//!
//! Deterministic without sleeps: the sentinel, or every server of the cluster, is
//! paused (SIGSTOP) before the node is made, so the wait cannot end until every caller
//! has given its command.
use crate::support;

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use support::cluster::{RedisCluster, SentinelGroup};
use support::node_calls::{self, owners};
use support::RedisServer;
use tower_redlock::node::{Acquire, NodeFuture, Owner, ResourceKeys, Vote};
use tower_redlock::{node::Node, ClusterNode, LockMode, SentinelNode};

/// Only a hang runs into it.
const HANG: Duration = Duration::from_secs(20);

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

fn keys(name: &str) -> ResourceKeys {
    node_calls::keys(format!("waiting-order:{{{name}}}"))
}

fn acquire(node: &dyn Node, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<Vote> {
    node.acquire(&Acquire {
        keys: std::slice::from_ref(keys),
        owner,
        mode: LockMode::Exclusive,
        ttl: Duration::from_secs(60),
        fence_ttl: Duration::from_secs(600),
        fencing: false,
        fence_floor: 0,
        seed_only_when_missing: false,
        waiter: None,
    })
}

async fn poll_once<T>(call: &mut NodeFuture<T>) -> Poll<Result<T, tower_redlock::NodeError>> {
    poll_fn(|cx| Poll::Ready(Pin::new(&mut *call).poll(cx))).await
}

/// The call's reply; the hang guard is checked before the call is polled again.
async fn finish(call: NodeFuture<Vote>) -> bool {
    tokio::select! {
        biased;
        () = tokio::time::sleep(HANG) => panic!("a call never finished"),
        reply = call => matches!(reply.expect("the master answered"), Vote::Granted { .. }),
    }
}

/// A Sentinel group whose sentinel is paused, a node made meanwhile (so its first lookup
/// of the master waits), the keys of resource `name`, and an owner value to take on
/// several node indices.
async fn before_the_first_lookup(name: &str) -> (SentinelGroup, SentinelNode, ResourceKeys, Owner) {
    let group = blocking(SentinelGroup::start).await;
    let keys = keys(name);
    let owner = owners().await;
    group.sentinel.pause();
    let node =
        SentinelNode::open([format!("redis://{}", group.sentinel.addr())], &group.name).unwrap();
    (group, node, keys, owner)
}

/// Sixteen callers in turn acquire one key while the node's first lookup of its master
/// is held up: the first to come must be the one granted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_waiting_for_the_master_lookup_are_sent_in_the_order_they_came() {
    let (group, node, keys, owner) = before_the_first_lookup("first-come").await;
    let mut calls = Vec::new();
    for i in 0..16 {
        let mut call = acquire(&node, &keys, &owner.for_node(i));
        assert!(poll_once(&mut call).await.is_pending());
        // In a task of its own from now on, as each request's call would be.
        calls.push(tokio::spawn(finish(call)));
    }
    group.sentinel.resume();
    let mut granted = Vec::new();
    for call in calls {
        granted.push(call.await.unwrap());
    }
    let master = group.server(group.master_port());
    assert_eq!(
        master.get(&keys.lock),
        Some(owner.for_node(0).as_str().to_owned()),
        "granted, in the order they came: {granted:?}"
    );
    assert_eq!(granted.iter().filter(|g| **g).count(), 1);
}

/// A caller dropped while it waits for the lookup gives up its place: the callers
/// after it are not held up, and its command is never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_dropped_while_waiting_for_the_master_lookup_is_never_sent() {
    let (group, node, keys, owner) = before_the_first_lookup("taken-back").await;
    let mut dropped = acquire(&node, &keys, &owner.for_node(0));
    assert!(poll_once(&mut dropped).await.is_pending());
    let mut next = acquire(&node, &keys, &owner.for_node(1));
    assert!(poll_once(&mut next).await.is_pending());
    drop(dropped);
    group.sentinel.resume();
    assert!(finish(next).await);
    let master = group.server(group.master_port());
    assert_eq!(
        master.get(&keys.lock),
        Some(owner.for_node(1).as_str().to_owned())
    );
}

/// A cluster whose every server is paused, a node made meanwhile (so its first
/// connection waits), the keys of resource `name`, and an owner value.
async fn before_the_first_cluster_connection(
    name: &str,
) -> (RedisCluster, ClusterNode, ResourceKeys, Owner) {
    let mut cluster = blocking(|| RedisCluster::start(3, 0)).await;
    let keys = keys(name);
    let owner = owners().await;
    let seeds: Vec<String> = cluster
        .nodes
        .iter()
        .map(|server| format!("redis://{}", server.addr()))
        .collect();
    for server in &mut cluster.nodes {
        server.pause();
    }
    let node = ClusterNode::open(seeds).unwrap();
    (cluster, node, keys, owner)
}

/// The master of the key's slot, as the cluster sees it.
fn master_of<'a>(cluster: &'a RedisCluster, key: &str) -> &'a RedisServer {
    let seen_by = cluster.nodes[0].port();
    cluster.node(cluster.master_of_slot(cluster.slot(key), seen_by))
}

/// As with a Sentinel lookup: sixteen callers in turn acquire one key while the
/// cluster node makes its first connection; the first to come must be granted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_waiting_for_the_cluster_connection_are_sent_in_the_order_they_came() {
    let (mut cluster, node, keys, owner) = before_the_first_cluster_connection("first-come").await;
    let mut calls = Vec::new();
    for i in 0..16 {
        let mut call = acquire(&node, &keys, &owner.for_node(i));
        assert!(poll_once(&mut call).await.is_pending());
        calls.push(tokio::spawn(finish(call)));
    }
    for server in &mut cluster.nodes {
        server.resume();
    }
    let mut granted = Vec::new();
    for call in calls {
        granted.push(call.await.unwrap());
    }
    assert_eq!(
        master_of(&cluster, &keys.lock).get(&keys.lock),
        Some(owner.for_node(0).as_str().to_owned()),
        "granted, in the order they came: {granted:?}"
    );
    assert_eq!(granted.iter().filter(|g| **g).count(), 1);
}
