//! Shared and counted holders (`node::SharedModes`) on a Redis Cluster and on a
//! Sentinel-managed master, at the node level: the scripts run whole on the master of
//! the resource's slot (every key carries the hash tag), a permit's release wakes its
//! listeners (`SPUBLISH` on a cluster), and the exclusive acquire of a cluster, which
//! takes the acquire script's fast path, finds the readers' sorted set held.
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use support::cluster::{RedisCluster, SentinelGroup};
use support::node_calls::{keys, owners};
use tower_redlock::node::{
    AcquireReply, AcquireRequest, Owner, ResourceKeys, SharedMode, SharedRequest,
};
use tower_redlock::{node::Node, node_from_url};

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

async fn shared(
    node: &Arc<dyn Node>,
    keys: &ResourceKeys,
    owner: &Owner,
    mode: SharedMode,
) -> bool {
    let request = SharedRequest {
        keys,
        owner,
        mode,
        ttl: TTL,
        fence_ttl: Duration::from_secs(3600),
        fencing: true,
        fence_floor: 1,
    };
    let modes = node.shared_modes().expect("shared holders");
    matches!(
        modes.acquire_shared(&request).await.unwrap(),
        AcquireReply::Acquired { .. }
    )
}

async fn readers_writers_and_permits(node: Arc<dyn Node>) {
    let keys = keys("redlock:{modes}".to_owned());
    let owner = owners().await;
    let modes = node.shared_modes().expect("shared holders");
    let two = SharedMode::counted(2).unwrap();
    assert!(shared(&node, &keys, &owner.for_node(1), two).await);
    assert!(shared(&node, &keys, &owner.for_node(2), two).await);
    assert!(!shared(&node, &keys, &owner.for_node(3), two).await);

    // The exclusive acquire (a cluster's takes the script's fast path) is refused.
    let writer = owner.for_node(4);
    let request = AcquireRequest {
        keys: &keys,
        owner: &writer,
        ttl: TTL,
        fence_ttl: Duration::from_secs(3600),
        fencing: true,
        fence_floor: 1,
        seed_only_when_missing: false,
        waiter: None,
    };
    let refused = node.acquire(&request).await.unwrap();
    assert!(matches!(refused, AcquireReply::Held { .. }), "{refused:?}");
    assert!(!node.extend(&keys, &owner.for_node(1), TTL).await.unwrap());
    assert!(!node.release(&keys, &owner.for_node(1)).await.unwrap());

    // A permit's release wakes the listeners of the resource's channel.
    let mut released = node.subscribe(&keys).await.unwrap();
    node.wait_queue()
        .unwrap()
        .listen_for_release(&keys, TTL)
        .await
        .unwrap();
    released.mark_seen();
    assert!(modes
        .release_shared(&keys, &owner.for_node(1))
        .await
        .unwrap());
    tokio::time::timeout(PATIENCE, released.changed())
        .await
        .expect("a permit's release wakes its listeners");
    assert!(shared(&node, &keys, &owner.for_node(3), two).await);
    assert!(modes
        .extend_shared(&keys, &owner.for_node(3), TTL)
        .await
        .unwrap());

    assert!(modes
        .release_shared(&keys, &owner.for_node(2))
        .await
        .unwrap());
    assert!(modes
        .release_shared(&keys, &owner.for_node(3))
        .await
        .unwrap());
    let granted = node.acquire(&request).await.unwrap();
    assert!(
        matches!(granted, AcquireReply::Acquired { .. }),
        "{granted:?}"
    );
}
