//! One lease over a set of resources (issue 17): all or nothing on every node, one
//! token per member, lost and released as a whole, no deadlock between overlapping
//! sets whatever order they are named in. On `MemoryNode`s here, on real
//! `redis-server`s in `redis.rs`.
//!
//! No test sleeps to synchronise: outcomes are awaited, and nodes are polled with a bound.
use crate::support;

use std::time::Duration;

use support::eventually;
use support::node_calls::Forwarding;
use tower_redlock::{
    LockError, LockOptions, LostCause, MemoryNode, Redlock, ReleaseOutcome, Resource,
    MAX_RESOURCES_PER_LEASE,
};

mod redis;

/// Bound of the polls: half the default ttl, so that a key that vanishes within it was
/// deleted, not expired.
const LIMIT: Duration = Duration::from_secs(5);

fn lock_key(resource: &str) -> String {
    format!("redlock:{{{resource}}}")
}

fn names(resources: &[Resource]) -> Vec<&str> {
    resources.iter().map(Resource::as_str).collect()
}

fn memory_locker(nodes: &[MemoryNode], options: LockOptions) -> Redlock {
    Redlock::new(nodes.iter().cloned(), options).unwrap()
}

#[tokio::test]
async fn a_set_is_taken_whole_or_not_at_all_on_memory_nodes() {
    let nodes = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    let locker = memory_locker(&nodes, LockOptions::default());
    let other = memory_locker(&nodes, LockOptions::default());
    let b = other.try_acquire("b").await.unwrap();

    match locker.try_acquire_all(["c", "b", "a"]).await {
        Err(LockError::Held {
            resource,
            holder_ttl,
        }) => {
            assert_eq!(resource.as_str(), "b");
            assert!(holder_ttl.is_some());
        }
        other => panic!("expected b held, got {other:?}"),
    }
    // Nothing of the set stayed on any node: `a` and `c` are free.
    for node in &nodes {
        assert_eq!(node.get(&lock_key("a")), None);
        assert_eq!(node.get(&lock_key("c")), None);
    }
    assert_eq!(locker.local_resources(), 0);

    b.release().await;
    let lease = locker.try_acquire_all(["c", "b", "a"]).await.unwrap();
    assert_eq!(names(lease.resources()), ["a", "b", "c"]);
    assert_eq!(lease.resource().as_str(), "a");
    assert_eq!(lease.fencing_tokens().len(), 3);
    for (resource, token) in lease.fencing_tokens() {
        assert_eq!(lease.fencing_token_of(resource), Some(token));
        // On every node: a `MemoryNode` acts when called, in one step for the set.
        for (i, node) in nodes.iter().enumerate() {
            assert_eq!(
                node.get(&lock_key(resource.as_str())).as_deref(),
                Some(lease.owner_on(i).as_str())
            );
        }
    }
    assert_eq!(lease.fencing_token_of(&Resource::new("d")), None);
    assert_eq!(
        lease.fencing_token_of(&Resource::new("b")),
        lease.fencing_tokens().nth(1).map(|(_, t)| t)
    );
    // Every member is held, alone or in another set.
    assert!(other.try_acquire("c").await.unwrap_err().is_contention());
    match other.try_acquire_all(["x", "c"]).await {
        Err(LockError::Held { resource, .. }) => assert_eq!(resource.as_str(), "c"),
        other => panic!("expected c held, got {other:?}"),
    }
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    for node in &nodes {
        assert!(node.is_empty() || node.get(&lock_key("a")).is_none());
        for member in ["a", "b", "c", "x"] {
            assert_eq!(node.get(&lock_key(member)), None, "{member} left behind");
        }
    }
    assert_eq!(locker.local_resources(), 0);
}

#[tokio::test]
async fn tokens_grow_per_member() {
    let nodes = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    let locker = memory_locker(&nodes, LockOptions::default());
    let single = locker.try_acquire("a").await.unwrap();
    let a0 = single.fencing_token();
    single.release().await;
    let set = locker.try_acquire_all(["a", "b"]).await.unwrap();
    let a1 = set.fencing_token_of(&"a".into()).unwrap();
    let b1 = set.fencing_token_of(&"b".into()).unwrap();
    assert!(a1 > a0);
    set.release().await;
    let again = locker.try_acquire_all(["b", "a"]).await.unwrap();
    assert!(again.fencing_token_of(&"a".into()).unwrap() > a1);
    assert!(again.fencing_token_of(&"b".into()).unwrap() > b1);
    again.release().await;
    let single = locker.try_acquire("b").await.unwrap();
    assert!(single.fencing_token() > b1);
}

#[tokio::test]
async fn duplicates_are_one_resource_and_a_set_of_one_is_a_single_lease() {
    let nodes = [MemoryNode::new()];
    let locker = memory_locker(&nodes, LockOptions::default());
    let lease = locker.try_acquire_all(["a", "a", "a"]).await.unwrap();
    assert_eq!(names(lease.resources()), ["a"]);
    assert_eq!(lease.fencing_tokens().len(), 1);
    assert_eq!(
        lease.fencing_token_of(&"a".into()),
        Some(lease.fencing_token())
    );
    // The same lock key as `try_acquire("a")` takes.
    assert!(locker.try_acquire("a").await.unwrap_err().is_contention());
    lease.release().await;
    let pair = locker
        .acquire_all(["b", "a", "b"], Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(names(pair.resources()), ["a", "b"]);
}

#[tokio::test]
async fn empty_and_oversized_sets_are_refused_without_asking_a_node() {
    let nodes = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    let locker = memory_locker(&nodes, LockOptions::default());
    // Nodes that are down would answer `Unavailable`: a refusal that asks them cannot
    // read `ResourceCount`.
    for node in &nodes {
        node.set_available(false);
    }
    let too_many: Vec<String> = (0..=MAX_RESOURCES_PER_LEASE)
        .map(|i| format!("r{i}"))
        .collect();
    for result in [
        locker.try_acquire_all(Vec::<Resource>::new()).await,
        locker
            .try_acquire_all(&too_many.iter().map(Resource::new).collect::<Vec<_>>())
            .await,
        locker
            .acquire_all(Vec::<&str>::new(), Duration::from_secs(1))
            .await,
        locker
            .acquire_all(too_many.clone(), Duration::from_secs(1))
            .await,
    ] {
        match result {
            Err(LockError::ResourceCount { count, limit, .. }) => {
                assert!(count == 0 || count == MAX_RESOURCES_PER_LEASE + 1);
                assert_eq!(limit, MAX_RESOURCES_PER_LEASE);
            }
            other => panic!("expected ResourceCount, got {other:?}"),
        }
    }
    assert!(locker.node_states().iter().all(|s| s.last_error.is_none()));
    assert_eq!(locker.local_resources(), 0);
    // The most a lease takes is accepted.
    for node in &nodes {
        node.set_available(true);
    }
    let lease = locker
        .try_acquire_all(&too_many[..MAX_RESOURCES_PER_LEASE])
        .await
        .unwrap();
    assert_eq!(lease.resources().len(), MAX_RESOURCES_PER_LEASE);
}

/// The canonical set, read back through the public calls: sorted, duplicates removed,
/// and sized after deduplication.
#[tokio::test]
async fn a_set_is_sorted_deduplicated_and_sized_after_deduplication() {
    let locker = memory_locker(&[MemoryNode::new()], LockOptions::default());
    let lease = locker
        .try_acquire_all(["b", "a", "b", "c", "a"])
        .await
        .unwrap();
    assert_eq!(names(lease.resources()), ["a", "b", "c"]);
    lease.release().await;

    match locker.try_acquire_all(Vec::<Resource>::new()).await {
        Err(LockError::ResourceCount {
            count: 0, resource, ..
        }) => assert_eq!(resource.as_str(), ""),
        other => panic!("expected ResourceCount, got {other:?}"),
    }
    let many = (0..=MAX_RESOURCES_PER_LEASE).map(|i| format!("r{i:02}"));
    match locker.try_acquire_all(many).await {
        Err(LockError::ResourceCount { count, limit, .. }) => {
            assert_eq!(count, MAX_RESOURCES_PER_LEASE + 1);
            assert_eq!(limit, MAX_RESOURCES_PER_LEASE);
        }
        other => panic!("expected ResourceCount, got {other:?}"),
    }
    let duplicates = (0..=MAX_RESOURCES_PER_LEASE).map(|_| "same");
    let lease = locker.try_acquire_all(duplicates).await.unwrap();
    assert_eq!(lease.resources().len(), 1);
}

#[tokio::test]
async fn a_waiting_set_wakes_when_any_member_is_released() {
    let nodes = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    // Another process: its release reaches the waiter through the nodes only.
    let holder = memory_locker(&nodes, LockOptions::default());
    // A fallback retry far beyond the test: only the release can wake the waiter.
    let waiter_locker = memory_locker(
        &nodes,
        LockOptions::default().retry_policy(|_, _| Duration::from_secs(600)),
    );
    let b = holder.try_acquire("b").await.unwrap();
    let waiter = {
        let locker = waiter_locker.clone();
        tokio::spawn(async move {
            locker
                .acquire_all(["a", "b"], Duration::from_secs(10))
                .await
        })
    };
    // Two attempts found `b` held: the first, and the one right after subscribing.
    // From then on the waiter waits for a release.
    eventually("the waiter waits", LIMIT, || {
        waiter_locker.metrics().contended >= 2
    })
    .await;
    b.release().await;
    let lease = waiter.await.unwrap().unwrap();
    assert_eq!(names(lease.resources()), ["a", "b"]);
    assert_eq!(waiter_locker.metrics().wakeups, 1);
}

#[tokio::test]
async fn a_set_is_lost_as_a_whole_when_one_member_is_gone_on_a_majority() {
    let nodes = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    let locker = memory_locker(&nodes, LockOptions::default().watchdog(false));
    let lease = locker.try_acquire_all(["a", "b", "c"]).await.unwrap();
    assert!(lease.extend().await.is_ok());
    nodes[0].delete(&lock_key("b"));
    nodes[1].delete(&lock_key("b"));
    match lease.extend().await {
        Err(LockError::Lost { cause, .. }) => assert_eq!(cause, LostCause::KeyLost),
        other => panic!("expected the set lost, got {other:?}"),
    }
    assert_eq!(lease.lost().await, LostCause::KeyLost);
    assert!(!lease.is_held());
    lease.release().await;
    for node in &nodes {
        for member in ["a", "b", "c"] {
            assert_eq!(node.get(&lock_key(member)), None, "{member} left behind");
        }
    }
}

#[tokio::test]
async fn the_default_set_calls_take_all_or_nothing() {
    let memory = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    // A node kind of one's own, over the memory node's calls.
    let nodes: Vec<_> = memory.iter().cloned().map(Forwarding::new).collect();
    let locker = Redlock::new(nodes.clone(), LockOptions::default().watchdog(false)).unwrap();
    let other = Redlock::new(nodes, LockOptions::default()).unwrap();
    let b = other.try_acquire("b").await.unwrap();
    match locker.try_acquire_all(["c", "b", "a"]).await {
        Err(LockError::Held { resource, .. }) => assert_eq!(resource.as_str(), "b"),
        other => panic!("expected b held, got {other:?}"),
    }
    // `a` was taken on each node before `b` was found held, and given back.
    eventually("the set's first member given back", LIMIT, || {
        memory.iter().all(|n| n.get(&lock_key("a")).is_none())
    })
    .await;
    assert!(memory.iter().all(|n| n.get(&lock_key("c")).is_none()));
    b.release().await;

    let lease = locker.try_acquire_all(["c", "b", "a"]).await.unwrap();
    let tokens: Vec<_> = lease.fencing_tokens().map(|(_, t)| t).collect();
    assert!(lease.extend().await.is_ok());
    memory[0].delete(&lock_key("c"));
    memory[2].delete(&lock_key("c"));
    assert!(matches!(
        lease.extend().await,
        Err(LockError::Lost {
            cause: LostCause::KeyLost,
            ..
        })
    ));
    lease.release().await;
    for node in &memory {
        for member in ["a", "b", "c"] {
            assert_eq!(node.get(&lock_key(member)), None, "{member} left behind");
        }
    }
    let again = locker.try_acquire_all(["a", "b", "c"]).await.unwrap();
    for ((_, token), before) in again.fencing_tokens().zip(tokens) {
        assert!(token > before);
    }
}

/// An `acquire_all` dropped while its round is in flight: the keys that land after the
/// drop are released once they do, and no local place is left behind.
#[tokio::test]
async fn a_cancelled_set_attempt_leaves_nothing_behind() {
    let nodes = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
    for node in &nodes {
        // The operation lands when the delay has passed, whether or not anyone waits.
        node.set_delay(Duration::from_millis(200));
    }
    let locker = memory_locker(
        &nodes,
        LockOptions::default().node_timeout(Duration::from_secs(1)),
    );
    let attempt = locker.acquire_all(["a", "b", "c"], Duration::from_secs(5));
    // Given up before any node answered.
    assert!(tokio::time::timeout(Duration::from_millis(20), attempt)
        .await
        .is_err());
    assert_eq!(locker.local_resources(), 0);
    // The grants land (the operations apply in the order they were issued)...
    eventually("the late grants land", LIMIT, || {
        nodes.iter().any(|n| n.get(&lock_key("a")).is_some())
    })
    .await;
    // ...then the cleanup, issued after them, takes them back (well before the ttl).
    eventually("the late grants given back", LIMIT, || {
        nodes.iter().all(|n| {
            ["a", "b", "c"]
                .iter()
                .all(|m| n.get(&lock_key(m)).is_none())
        })
    })
    .await;
    for node in &nodes {
        node.set_delay(Duration::ZERO);
    }
    let lease = locker.try_acquire_all(["a", "b", "c"]).await.unwrap();
    lease.release().await;
}
