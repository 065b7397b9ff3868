//! Quorum logic on in-process nodes with injected faults ([`MemoryNode`]'s
//! `set_available` and `set_delay`), through the public API only.
//!
//! The tokio clock is paused: delays and timeouts run in virtual time, so slow-node
//! scenarios are exact and instant. Polls are bounded in virtual time too, well below
//! the keys' ttl, so a key that vanishes was deleted, not expired.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::node_calls::{diverge_counters, Call, Forwarding};
use tower_redlock::node::ResourceKeys;
use tower_redlock::{LockError, LockOptions, MemoryNode, NodeError, Redlock, ReleaseOutcome};

const NODE_TIMEOUT: Duration = Duration::from_millis(50);
/// Bound of every poll, in (virtual) time: a tenth of the default 10 s ttl.
const LIMIT: Duration = Duration::from_secs(1);

/// Polls `done` every millisecond of virtual time until it holds; panics after `LIMIT`.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {LIMIT:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn keys(resource: &str) -> ResourceKeys {
    let lock = lock_key(resource);
    ResourceKeys {
        fence: format!("{lock}:fence"),
        channel: format!("{lock}:released"),
        lock,
    }
}

/// Release notifications of every node: a release that deleted our key publishes one;
/// an expiry does not.
/// Waits until every node that holds our lock key lost it *before the key's own expiry*:
/// only a release removes it that early. (The cleanup of a failed attempt wakes no
/// waiter, so release notifications cannot show it; the paused clock makes the bound
/// exact.)
async fn released_before_expiry(nodes: &[MemoryNode], resource: &str) {
    let key = keys(resource).lock;
    for node in nodes {
        let Some(ttl) = node.pttl(&key) else {
            continue;
        };
        let gone = async {
            while node.get(&key).is_some() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(ttl.saturating_sub(Duration::from_millis(1)), gone)
            .await
            .expect("a node never released our key");
    }
}

fn nodes() -> [MemoryNode; 3] {
    [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()]
}

fn locker(nodes: &[MemoryNode], options: LockOptions) -> Redlock {
    Redlock::new(nodes.iter().cloned(), options).unwrap()
}

fn options() -> LockOptions {
    LockOptions::default().node_timeout(NODE_TIMEOUT)
}

fn lock_key(resource: &str) -> String {
    format!("redlock:{{{resource}}}")
}

fn fence(node: &MemoryNode, resource: &str) -> Option<u64> {
    node.get(&format!("redlock:{{{resource}}}:fence"))
        .map(|v| v.parse().unwrap())
}

async fn no_key_left(nodes: &[MemoryNode], resource: &str) {
    let key = lock_key(resource);
    eventually("no lock key left on any node", || {
        nodes.iter().all(|n| n.get(&key).is_none())
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn one_unavailable_node_of_three_is_tolerated() {
    let nodes = nodes();
    let locker = locker(&nodes, options());
    nodes[1].set_available(false);
    let lease = locker.try_acquire("r").await.unwrap();
    assert_eq!(
        nodes[0].get(&lock_key("r")).as_deref(),
        Some(lease.owner_on(0).as_str())
    );
    assert_eq!(
        nodes[2].get(&lock_key("r")).as_deref(),
        Some(lease.owner_on(2).as_str())
    );
    assert!(nodes[1].is_empty());
    lease.extend().await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    no_key_left(&nodes, "r").await;
}

#[tokio::test(start_paused = true)]
async fn two_unavailable_nodes_of_three_are_unavailable() {
    let nodes = nodes();
    let locker = locker(&nodes, options());
    nodes[0].set_available(false);
    nodes[2].set_available(false);
    let err = locker.try_acquire("r").await.unwrap_err();
    let LockError::Unavailable {
        nodes: count,
        answered,
        quorum,
        failures,
        ..
    } = &err
    else {
        panic!("expected Unavailable, got {err:?}");
    };
    assert_eq!((*count, *answered, *quorum), (3, 1, 2));
    assert_eq!(failures.len(), 2);
    assert!(failures
        .iter()
        .all(|f| matches!(f.error, NodeError::Connection(_))));
    // The one node that granted it got it back.
    no_key_left(&nodes, "r").await;

    let err = locker
        .acquire("r", Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert_eq!(locker.local_resources(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_slow_node_is_not_waited_for_and_its_late_key_is_released() {
    let nodes = nodes();
    let locker = locker(&nodes, options());
    nodes[2].set_delay(NODE_TIMEOUT * 6);
    let lease = locker.try_acquire("r").await.unwrap();
    let key = lock_key("r");
    assert_eq!(
        nodes[0].get(&key).as_deref(),
        Some(lease.owner_on(0).as_str())
    );
    assert_eq!(
        nodes[1].get(&key).as_deref(),
        Some(lease.owner_on(1).as_str())
    );
    // The slow node's SET lands after the delay, long after the majority decided.
    eventually("the slow node's SET lands", || {
        nodes[2].get(&key).as_deref() == Some(lease.owner_on(2).as_str())
    })
    .await;
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
    // ... and the release reaches it too, although nobody waits for its answer.
    no_key_left(&nodes, "r").await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_attempt_leaves_no_key_of_ours_behind() {
    let nodes = nodes();
    let locker = locker(&nodes, options());
    let key = lock_key("r");
    // Another owner holds it on two nodes; the third grants it to us.
    nodes[1].set(&key, "someone-else");
    nodes[2].set(&key, "someone-else");
    nodes[0].set_delay(NODE_TIMEOUT / 2);
    let err = locker.try_acquire("r").await.unwrap_err();
    assert!(matches!(err, LockError::Held { .. }), "{err:?}");
    eventually("our key on the granting node is released", || {
        nodes[0].get(&key).is_none()
    })
    .await;
    assert_eq!(nodes[1].get(&key).as_deref(), Some("someone-else"));
    assert_eq!(nodes[2].get(&key).as_deref(), Some("someone-else"));

    // One grant, one holder, one dead node: two answers make a majority of answers,
    // so it is contention, not unavailability, and our grant is taken back.
    nodes[0].set_delay(Duration::ZERO);
    nodes[2].set_available(false);
    let err = locker.try_acquire("r").await.unwrap_err();
    assert!(matches!(err, LockError::Held { .. }), "{err:?}");
    assert_eq!(nodes[0].get(&key), None);

    // One holder and two dead nodes: too few answers to call it contention.
    nodes[0].set_available(false);
    let err = locker.try_acquire("r").await.unwrap_err();
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert_eq!(nodes[1].get(&key).as_deref(), Some("someone-else"));
}

#[tokio::test(start_paused = true)]
async fn nodes_slower_than_the_timeout_are_failures() {
    let nodes = nodes();
    let locker = locker(&nodes, options());
    nodes[0].set_available(false);
    nodes[1].set_delay(NODE_TIMEOUT * 2);
    let err = locker.try_acquire("r").await.unwrap_err();
    let LockError::Unavailable { failures, .. } = &err else {
        panic!("expected Unavailable, got {err:?}");
    };
    assert_eq!(failures.len(), 2, "{err}");
    assert!(failures
        .iter()
        .any(|f| matches!(f.error, NodeError::Timeout(_))));
    assert!(failures
        .iter()
        .any(|f| matches!(f.error, NodeError::Connection(_))));
    // The slow node's late grant and the fast node's grant are both taken back.
    eventually("the slow node's late SET lands", || {
        fence(&nodes[1], "r").is_some()
    })
    .await;
    no_key_left(&nodes, "r").await;
}

#[tokio::test(start_paused = true)]
async fn validity_expired_when_the_write_back_exceeds_the_ttl_budget() {
    // ttl 200 ms leaves 196 ms of validity; each round trip takes 120 ms, within the
    // node timeout, but acquire plus write-back take 240 ms.
    let nodes = nodes();
    let ttl = Duration::from_millis(200);
    let locker = locker(
        &nodes,
        LockOptions::default()
            .ttl(ttl)
            .node_timeout(Duration::from_millis(150)),
    );
    diverge_counters(&nodes, "r");
    for n in &nodes {
        n.set_delay(Duration::from_millis(120));
    }
    let err = locker.try_acquire("r").await.unwrap_err();
    assert!(matches!(err, LockError::ValidityExpired { .. }), "{err:?}");
    assert!(!err.is_contention());
    // Every node granted it (the third one after the decision); every grant is taken
    // back by a release, before the keys would have expired.
    released_before_expiry(&nodes, "r").await;
    no_key_left(&nodes, "r").await;

    // A waiting acquire retries such attempts rather than giving up; once the nodes
    // are fast again it succeeds.
    for n in &nodes {
        n.set_delay(Duration::ZERO);
    }
    let lease = locker.acquire("r", Duration::from_secs(5)).await.unwrap();
    assert_eq!(lease.release().await, ReleaseOutcome::Released);
}

#[tokio::test(start_paused = true)]
async fn validity_expired_when_too_little_validity_is_left() {
    // Acquire and write-back of 97 ms each answer in time, but leave 196 − 194 ms of
    // validity, below the 5 ms minimum.
    let nodes = nodes();
    let locker = locker(
        &nodes,
        LockOptions::default()
            .ttl(Duration::from_millis(200))
            .node_timeout(Duration::from_millis(150)),
    );
    diverge_counters(&nodes, "r");
    for n in &nodes {
        n.set_delay(Duration::from_millis(97));
    }
    let err = locker.try_acquire("r").await.unwrap_err();
    let LockError::ValidityExpired {
        validity,
        min_validity,
        ..
    } = err
    else {
        panic!("expected ValidityExpired, got {err:?}");
    };
    assert!(validity <= min_validity);
    released_before_expiry(&nodes, "r").await;
    no_key_left(&nodes, "r").await;
}

#[tokio::test(start_paused = true)]
async fn write_back_carries_the_token_to_every_new_majority() {
    let [a, b, c] = nodes();
    let all = [a.clone(), b.clone(), c.clone()];
    let locker = locker(&all, options());
    let res = "fenced";
    let mut last = 0;
    let round = |up: [&MemoryNode; 2], down: &MemoryNode| {
        for n in up {
            n.set_available(true);
        }
        down.set_available(false);
        let locker = locker.clone();
        let up = [up[0].clone(), up[1].clone()];
        async move {
            let lease = locker.try_acquire(res).await.unwrap();
            let token = lease.fencing_token().get();
            // The acquiring majority holds exactly the token.
            for n in &up {
                assert_eq!(fence(n, res), Some(token));
            }
            assert_eq!(lease.release().await, ReleaseOutcome::Released);
            token
        }
    };

    let mut tokens = Vec::new();
    tokens.push(round([&a, &b], &c).await); // {A, B}; C has no counter
    tokens.push(round([&b, &c], &a).await); // C starts from the clock
    tokens.push(round([&a, &c], &b).await); // A is behind: raised
                                            // A counter far behind and one far ahead of the clock.
    let ahead = tokens[2] + 1_000_000_000;
    a.set(&format!("redlock:{{{res}}}:fence"), "7");
    b.set(&format!("redlock:{{{res}}}:fence"), &ahead.to_string());
    tokens.push(round([&a, &b], &c).await);
    assert_eq!(tokens[3], ahead + 1);
    tokens.push(round([&a, &c], &b).await); // A was raised, C is behind
    tokens.push(round([&b, &c], &a).await);
    for t in &tokens {
        assert!(*t > last, "tokens do not increase: {tokens:?}");
        last = *t;
    }
}

#[tokio::test(start_paused = true)]
async fn equal_floors_keep_the_steady_state_one_round_trip() {
    let memory = nodes();
    // Counts the fence write-backs the nodes are asked for.
    let written_back = Arc::new(AtomicUsize::new(0));
    let counting = memory.iter().map(|node| {
        let written_back = written_back.clone();
        Forwarding::new(node.clone()).before(move |call| {
            if call == Call::RaiseFences {
                written_back.fetch_add(1, Ordering::SeqCst);
            }
        })
    });
    let locker = Redlock::new(counting, options()).unwrap();
    let raises = || written_back.load(Ordering::SeqCst);
    let res = "steady";
    // Counters that differ but are all behind the clock (a restored node, a stale
    // one, a missing one): every node answers the round's floor, so they converge
    // without a write-back.
    memory[0].set(&format!("redlock:{{{res}}}:fence"), "7");
    memory[1].set(&format!("redlock:{{{res}}}:fence"), "8");
    let mut last = 0;
    for _ in 0..20 {
        let lease = locker.try_acquire(res).await.unwrap();
        let token = lease.fencing_token().get();
        assert!(token > last, "token {token} after {last}");
        last = token;
        for n in &memory {
            assert_eq!(fence(n, res), Some(token), "every node answered the token");
        }
        assert_eq!(lease.release().await, ReleaseOutcome::Released);
    }
    assert_eq!(raises(), 0, "no write-back while the counters agree");

    // The write-back is still there for counters that run ahead of the clock.
    diverge_counters(&memory, res);
    let lease = locker.try_acquire(res).await.unwrap();
    assert!(lease.fencing_token().get() > last);
    assert!(raises() > 0, "counters that differ are written back");
}
