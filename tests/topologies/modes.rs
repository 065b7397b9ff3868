//! Shared and counted holders (`LockMode`'s node contract) on a Redis Cluster and on a
//! Sentinel-managed master, at the node level: the scripts run whole on the master of
//! the resource's slot (every key carries the hash tag), a permit's release wakes its
//! listeners (`SPUBLISH` on a cluster), and the exclusive acquire of a cluster, which
//! takes the acquire script's fast path, finds the readers' sorted set held.
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use support::cluster::{RedisCluster, SentinelGroup};
use support::node_calls::{acquire, granted, hold};
use support::node_calls::{keys, owners};
use tower_redlock::node::{Owner, Release, ResourceKeys, Vote};
use tower_redlock::{node::Node, node_from_url, LockMode};

const TTL: Duration = Duration::from_secs(10);
/// A hang guard for awaited events, not a timing assertion.
const PATIENCE: Duration = Duration::from_secs(10);

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_holders_on_a_cluster() {
    let cluster = blocking(|| RedisCluster::start(3, 0)).await;
    let node = node_from_url(&cluster.url()).unwrap();
    readers_writers_and_permits(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_holders_on_a_sentinel_master() {
    let group = Arc::new(blocking(SentinelGroup::start).await);
    let node = node_from_url(&group.url()).unwrap();
    readers_writers_and_permits(node).await;
}

async fn shared(node: &Arc<dyn Node>, keys: &ResourceKeys, owner: &Owner, mode: LockMode) -> bool {
    let keys = std::slice::from_ref(keys);
    granted(&node.acquire(&acquire(keys, owner, mode)).await.unwrap())
}

/// A holder's release in `mode`.
async fn release(node: &Arc<dyn Node>, keys: &ResourceKeys, owner: &Owner, mode: LockMode) -> bool {
    let keys = std::slice::from_ref(keys);
    node.release(&hold(keys, owner, mode), Release::Wake)
        .await
        .unwrap()
}

/// A holder's extend in `mode`, a batch of one.
async fn extend(node: &Arc<dyn Node>, keys: &ResourceKeys, owner: &Owner, mode: LockMode) -> bool {
    let keys = std::slice::from_ref(keys);
    let answers = node.extend(&[hold(keys, owner, mode)], TTL).await.unwrap();
    matches!(answers[..], [Ok(true)])
}

async fn readers_writers_and_permits(node: Arc<dyn Node>) {
    let keys = keys("redlock:{modes}".to_owned());
    let owner = owners().await;
    let two = LockMode::counted(2).unwrap();
    assert!(shared(&node, &keys, &owner.for_node(1), two).await);
    assert!(shared(&node, &keys, &owner.for_node(2), two).await);
    assert!(!shared(&node, &keys, &owner.for_node(3), two).await);

    // The exclusive acquire (a cluster's takes the script's fast path) is refused.
    let writer = owner.for_node(4);
    let request = acquire(std::slice::from_ref(&keys), &writer, LockMode::Exclusive);
    let refused = node.acquire(&request).await.unwrap();
    assert!(matches!(refused, Vote::Held { .. }), "{refused:?}");
    let exclusive = LockMode::Exclusive;
    assert!(!extend(&node, &keys, &owner.for_node(1), exclusive).await);
    assert!(!release(&node, &keys, &owner.for_node(1), exclusive).await);

    // A permit's release wakes the listeners of the resource's channel.
    let mut released = node.subscribe(&keys).await.unwrap();
    node.listen_for_release(&keys, TTL).await.unwrap();
    released.mark_seen();
    assert!(release(&node, &keys, &owner.for_node(1), two).await);
    tokio::time::timeout(PATIENCE, released.changed())
        .await
        .expect("a permit's release wakes its listeners");
    assert!(shared(&node, &keys, &owner.for_node(3), two).await);
    assert!(extend(&node, &keys, &owner.for_node(3), two).await);

    assert!(release(&node, &keys, &owner.for_node(2), two).await);
    assert!(release(&node, &keys, &owner.for_node(3), two).await);
    let granted = node.acquire(&request).await.unwrap();
    assert!(matches!(granted, Vote::Granted { .. }), "{granted:?}");
}
