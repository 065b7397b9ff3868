//! Shared and counted holders at the node level (`tower_redlock::LockMode`'s contract),
//! each check run on a `MemoryNode` and on a real `redis-server` (`RedisNode`): readers
//! share, a writer excludes them and they exclude it, a waiting writer holds new readers
//! back until it is served or its intent expires, never more than `n` permits, a dead
//! holder's permit frees itself, compare-by-owner, wake-ups on release, tokens from the
//! one counter, and every exclusive call meeting shared holders answers rather than
//! failing.
use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use support::node_calls::{keys, owners};
use support::RedisServer;
use tower_redlock::node::{
    Acquire, ClaimReply, ClaimRequest, Hold, Owner, Record, Release, ResourceKeys, StoreReply,
    StoreRequest, Vote, Waiter,
};
use tower_redlock::{node::Node, FencingToken, LockMode, MemoryNode, RedisNode};

const TTL: Duration = Duration::from_secs(10);
const FENCE_TTL: Duration = Duration::from_secs(3600);
/// A hang guard for awaited events, not a timing assertion.
const PATIENCE: Duration = Duration::from_secs(10);

/// Each check, once on a `MemoryNode` and once on a real `redis-server`.
macro_rules! on_both {
    ($($check:ident),* $(,)?) => {$(
        mod $check {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$check(Arc::new(MemoryNode::new()), None).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                let server = RedisServer::start();
                let node = RedisNode::open(server.url()).unwrap();
                super::$check(Arc::new(node), Some(&server)).await;
            }
        }
    )*};
}

on_both!(
    readers_share_and_exclude_the_writer,
    a_writer_excludes_readers_and_permits,
    a_waiting_writer_holds_new_readers_back_until_served,
    an_abandoned_writers_intent_expires,
    permits_are_never_exceeded,
    a_dead_holders_permit_frees_itself,
    only_the_owner_extends_or_releases,
    a_release_wakes_the_listeners,
    tokens_come_from_the_one_counter,
    exclusive_calls_meeting_shared_holders_answer,
);

/// What `owner` holds of the one resource `keys` in `mode`.
fn hold<'a>(keys: &'a ResourceKeys, owner: &'a Owner, mode: LockMode) -> Hold<'a> {
    Hold {
        keys: std::slice::from_ref(keys),
        owner,
        mode,
    }
}

/// A shared holder's release (which shared mode does not matter to a node).
async fn release_shared(node: &Arc<dyn Node>, keys: &ResourceKeys, owner: &Owner) -> bool {
    let hold = hold(keys, owner, LockMode::Shared);
    node.release(&hold, Release::Wake).await.unwrap()
}

async fn release(node: &Arc<dyn Node>, keys: &ResourceKeys, owner: &Owner) -> bool {
    let hold = hold(keys, owner, LockMode::Exclusive);
    node.release(&hold, Release::Wake).await.unwrap()
}

/// One hold's extend, a batch of one.
async fn extend(node: &Arc<dyn Node>, hold: Hold<'_>, ttl: Duration) -> bool {
    let answers = node.extend(&[hold], ttl).await.unwrap();
    let [answer] = &answers[..] else {
        panic!("one answer per hold: {answers:?}");
    };
    *answer.as_ref().unwrap()
}

fn resource(name: &str) -> ResourceKeys {
    keys(format!("modes:{{{name}}}"))
}

async fn shared(
    node: &Arc<dyn Node>,
    keys: &ResourceKeys,
    owner: &Owner,
    mode: LockMode,
    ttl: Duration,
) -> Vote {
    let request = Acquire {
        keys: std::slice::from_ref(keys),
        owner,
        mode,
        ttl,
        fence_ttl: FENCE_TTL,
        fencing: true,
        fence_floor: 1,
        seed_only_when_missing: false,
        waiter: None,
    };
    node.acquire(&request).await.unwrap()
}

async fn exclusive(
    node: &Arc<dyn Node>,
    keys: &ResourceKeys,
    owner: &Owner,
    waiter: Option<&Waiter>,
) -> Vote {
    let request = Acquire {
        keys: std::slice::from_ref(keys),
        owner,
        mode: LockMode::Exclusive,
        ttl: TTL,
        fence_ttl: FENCE_TTL,
        fencing: true,
        fence_floor: 1,
        seed_only_when_missing: false,
        waiter,
    };
    node.acquire(&request).await.unwrap()
}

fn token(reply: Vote) -> u64 {
    match reply {
        Vote::Granted { fences } => fences[0],
        held => panic!("expected a grant, got {held:?}"),
    }
}

fn is_held(reply: &Vote) -> bool {
    matches!(reply, Vote::Held { .. })
}

fn waiter(id: &str, queue_ttl: Duration) -> Waiter {
    Waiter {
        id: id.to_owned(),
        ticket: 1,
        queue_ttl,
    }
}

const READ: LockMode = LockMode::Shared;

async fn readers_share_and_exclude_the_writer(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("share");
    let owner = owners().await;
    let (r1, r2, w) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    token(shared(&node, &keys, &r1, READ, TTL).await);
    token(shared(&node, &keys, &r2, READ, TTL).await);
    let refused = exclusive(&node, &keys, &w, None).await;
    let Vote::Held {
        pttl: Some(pttl), ..
    } = refused
    else {
        panic!("a writer beside readers: {refused:?}");
    };
    assert!(pttl <= TTL);
    assert!(release_shared(&node, &keys, &r1).await);
    assert!(is_held(&exclusive(&node, &keys, &w, None).await));
    assert!(release_shared(&node, &keys, &r2).await);
    token(exclusive(&node, &keys, &w, None).await);
}

async fn a_writer_excludes_readers_and_permits(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("writer");
    let owner = owners().await;
    let (w, r, p) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    token(exclusive(&node, &keys, &w, None).await);
    assert!(is_held(&shared(&node, &keys, &r, READ, TTL).await));
    let permit = LockMode::counted(5).unwrap();
    assert!(is_held(&shared(&node, &keys, &p, permit, TTL).await));
    assert!(release(&node, &keys, &w).await);
    token(shared(&node, &keys, &r, READ, TTL).await);
    // A permit among readers: the holders' mode, not contention.
    let other = shared(&node, &keys, &p, permit, TTL).await;
    assert_eq!(other, Vote::OtherMode { held: READ });
    assert!(release_shared(&node, &keys, &r).await);
    token(shared(&node, &keys, &p, permit, TTL).await);
}

async fn a_waiting_writer_holds_new_readers_back_until_served(
    node: Arc<dyn Node>,
    _: Option<&RedisServer>,
) {
    let keys = resource("preference");
    let owner = owners().await;
    let (r1, r2, w) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    let writer = waiter("00000000000000aa", TTL);
    // The writer listens on its own channel, so the last reader hands it the key.
    let mut woken = node
        .subscribe(&ResourceKeys {
            channel: writer.channel(&keys),
            ..keys.clone()
        })
        .await
        .unwrap();
    woken.mark_seen();

    token(shared(&node, &keys, &r1, READ, TTL).await);
    assert!(is_held(&exclusive(&node, &keys, &w, Some(&writer)).await));
    // A stream of readers does not starve it: new readers wait behind it.
    assert!(is_held(&shared(&node, &keys, &r2, READ, TTL).await));

    assert!(release_shared(&node, &keys, &r1).await);
    tokio::time::timeout(PATIENCE, woken.changed())
        .await
        .expect("the last reader's release wakes the queued writer");
    // Reserved for the writer: readers still wait, the writer takes it.
    assert!(is_held(&shared(&node, &keys, &r2, READ, TTL).await));
    token(exclusive(&node, &keys, &w, Some(&writer)).await);
    let won = hold(&keys, &w, LockMode::Exclusive);
    assert!(node
        .release(&won, Release::AsWaiter(&writer))
        .await
        .unwrap());
    // Served: its intent no longer holds readers back, though its ttl has not run out.
    token(shared(&node, &keys, &r2, READ, TTL).await);
}

async fn an_abandoned_writers_intent_expires(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("abandoned");
    let owner = owners().await;
    let (r1, r2, w) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    // A writer that waits once and dies: nobody refreshes its place or its intent.
    let writer = waiter("00000000000000bb", Duration::from_millis(300));
    token(shared(&node, &keys, &r1, READ, TTL).await);
    assert!(is_held(&exclusive(&node, &keys, &w, Some(&writer)).await));
    assert!(is_held(&shared(&node, &keys, &r2, READ, TTL).await));
    // The waiting reader marks the queue before each attempt, as a waiter on the
    // resource's channel does: that keeps the queue (and the dead writer in it) alive,
    // so only the intent's own expiry lets readers in.
    let reader = node.clone();
    support::eventually_async("the dead writer's intent expires", PATIENCE, || {
        let (node, keys, r2) = (reader.clone(), keys.clone(), r2.clone());
        async move {
            node.listen_for_release(&keys, TTL).await.unwrap();
            !is_held(&shared(&node, &keys, &r2, READ, TTL).await)
        }
    })
    .await;
}

async fn permits_are_never_exceeded(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    const PERMITS: usize = 3;
    const TASKS: usize = 32;
    const CYCLES: usize = 60;
    let keys = Arc::new(resource("permits"));
    let owner = owners().await;
    let mode = LockMode::counted(PERMITS as u32).unwrap();
    let holding = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let granted = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (node, keys, owner) = (node.clone(), keys.clone(), owner.for_node(task));
            let (holding, most, granted) = (holding.clone(), most.clone(), granted.clone());
            tokio::spawn(async move {
                for _ in 0..CYCLES {
                    if is_held(&shared(&node, &keys, &owner, mode, TTL).await) {
                        tokio::task::yield_now().await;
                        continue;
                    }
                    // Counted between the grant's answer and the release's call: never
                    // more than the node's own count.
                    let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    granted.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    holding.fetch_sub(1, Ordering::SeqCst);
                    assert!(release_shared(&node, &keys, &owner).await);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= PERMITS, "{most} holders of {PERMITS} permits");
    assert!(granted.load(Ordering::SeqCst) > 0);
}

async fn a_dead_holders_permit_frees_itself(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("dead");
    let owner = owners().await;
    let (live, dead, next) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    // A live holder keeps the resource's key alive (longer than the test waits): the
    // dead one's entry must be pruned by itself.
    let two = LockMode::counted(2).unwrap();
    token(shared(&node, &keys, &live, two, 6 * PATIENCE).await);
    token(shared(&node, &keys, &dead, two, Duration::from_millis(200)).await);
    let refused = shared(&node, &keys, &next, two, TTL).await;
    let Vote::Held {
        pttl: Some(pttl), ..
    } = refused
    else {
        panic!("a third holder of two permits: {refused:?}");
    };
    // The earliest permit's expiry: the dead holder's.
    assert!(pttl <= Duration::from_millis(200), "{pttl:?}");
    let waiting = node.clone();
    support::eventually_async("the dead holder's permit expires", PATIENCE, || {
        let (node, keys, next) = (waiting.clone(), keys.clone(), next.clone());
        async move { !is_held(&shared(&node, &keys, &next, two, TTL).await) }
    })
    .await;
    // The dead holder's entry stays lost.
    assert!(!extend(&node, hold(&keys, &dead, READ), TTL).await);
    assert!(!release_shared(&node, &keys, &dead).await);
}

async fn only_the_owner_extends_or_releases(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("owner");
    let owner = owners().await;
    let (holder, stranger, w) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    let one = LockMode::counted(1).unwrap();
    token(shared(&node, &keys, &holder, one, TTL).await);
    assert!(!release_shared(&node, &keys, &stranger).await);
    assert!(!extend(&node, hold(&keys, &stranger, READ), TTL).await);
    assert!(is_held(&shared(&node, &keys, &stranger, one, TTL).await));
    assert!(is_held(&exclusive(&node, &keys, &w, None).await));
    assert!(extend(&node, hold(&keys, &holder, READ), TTL).await);
    // The batched renewal: per entry, ours or not.
    let holds = [hold(&keys, &holder, one), hold(&keys, &stranger, one)];
    let extended = node.extend(&holds, TTL).await.unwrap();
    assert_eq!(
        extended.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        [true, false]
    );
    assert!(release_shared(&node, &keys, &holder).await);
    assert!(!release_shared(&node, &keys, &holder).await);
    token(shared(&node, &keys, &stranger, one, TTL).await);
}

async fn a_release_wakes_the_listeners(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("wake");
    let owner = owners().await;
    let (w, a, b) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    let mut released = node.subscribe(&keys).await.unwrap();

    // A writer's release wakes the readers waiting on the resource's channel.
    token(exclusive(&node, &keys, &w, None).await);
    assert!(is_held(&shared(&node, &keys, &a, READ, TTL).await));
    node.listen_for_release(&keys, TTL).await.unwrap();
    released.mark_seen();
    assert!(release(&node, &keys, &w).await);
    tokio::time::timeout(PATIENCE, released.changed())
        .await
        .expect("a writer's release wakes the readers");

    // A permit's release wakes a permit waiter, while other holders remain.
    let two = LockMode::counted(2).unwrap();
    token(shared(&node, &keys, &a, two, TTL).await);
    token(shared(&node, &keys, &b, two, TTL).await);
    assert!(is_held(&shared(&node, &keys, &w, two, TTL).await));
    node.listen_for_release(&keys, TTL).await.unwrap();
    released.mark_seen();
    assert!(release_shared(&node, &keys, &a).await);
    tokio::time::timeout(PATIENCE, released.changed())
        .await
        .expect("a permit's release wakes a waiter");
    token(shared(&node, &keys, &w, two, TTL).await);
}

async fn tokens_come_from_the_one_counter(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("tokens");
    let owner = owners().await;
    let (w1, r1, r2, w2) = (
        owner.for_node(1),
        owner.for_node(2),
        owner.for_node(3),
        owner.for_node(4),
    );
    let first = token(exclusive(&node, &keys, &w1, None).await);
    assert!(release(&node, &keys, &w1).await);
    let read1 = token(shared(&node, &keys, &r1, READ, TTL).await);
    let read2 = token(shared(&node, &keys, &r2, READ, TTL).await);
    assert!(read1 > first && read2 > first, "{first} {read1} {read2}");
    assert!(release_shared(&node, &keys, &r1).await);
    assert!(release_shared(&node, &keys, &r2).await);
    let second = token(exclusive(&node, &keys, &w2, None).await);
    assert!(second > read1.max(read2), "{read1} {read2} {second}");
}

/// Every exclusive call of the `Node` trait (and the records) on a resource held by
/// readers answers "held" or "not ours": never an error, and the readers keep it.
async fn exclusive_calls_meeting_shared_holders_answer(
    node: Arc<dyn Node>,
    server: Option<&RedisServer>,
) {
    let keys = resource("types");
    let owner = owners().await;
    let (reader, w) = (owner.for_node(1), owner.for_node(2));
    token(shared(&node, &keys, &reader, READ, TTL).await);
    let writer = waiter("00000000000000cc", TTL);

    // The fenced acquire (pipelined on a standalone server), the waiting one (the
    // script), and the unfenced one (a plain SET NX).
    assert!(is_held(&exclusive(&node, &keys, &w, None).await));
    assert!(is_held(&exclusive(&node, &keys, &w, Some(&writer)).await));
    node.leave_queue(&keys, &writer).await.unwrap();
    let plain = Acquire {
        keys: std::slice::from_ref(&keys),
        owner: &w,
        mode: LockMode::Exclusive,
        ttl: TTL,
        fence_ttl: FENCE_TTL,
        fencing: false,
        fence_floor: 0,
        seed_only_when_missing: false,
        waiter: None,
    };
    assert!(is_held(&node.acquire(&plain).await.unwrap()));
    assert!(!extend(&node, hold(&keys, &reader, LockMode::Exclusive), TTL).await);
    let other = resource("types-batch");
    let entry = [
        hold(&keys, &reader, LockMode::Exclusive),
        hold(&other, &reader, LockMode::Exclusive),
    ];
    assert_eq!(
        node.extend(&entry, TTL)
            .await
            .unwrap()
            .into_iter()
            .map(Result::unwrap)
            .collect::<Vec<_>>(),
        [false, false]
    );
    assert!(!release(&node, &keys, &reader).await);
    let as_reader = hold(&keys, &reader, LockMode::Exclusive);
    assert!(!node
        .release(&as_reader, Release::AsWaiter(&writer))
        .await
        .unwrap());
    assert!(!node
        .release(&as_reader, Release::HandBack(&writer))
        .await
        .unwrap());
    let members = [keys.clone(), resource("types-other")];
    let set = Acquire {
        keys: &members,
        owner: &w,
        mode: LockMode::Exclusive,
        ttl: TTL,
        fence_ttl: FENCE_TTL,
        fencing: true,
        fence_floor: 1,
        seed_only_when_missing: false,
        waiter: None,
    };
    let reply = node.acquire(&set).await.unwrap();
    assert!(matches!(reply, Vote::Held { member: 0, .. }), "{reply:?}");
    let set_hold = Hold {
        keys: &members,
        owner: &reader,
        mode: LockMode::Exclusive,
    };
    assert!(!extend(&node, set_hold, TTL).await);
    assert!(!node.release(&set_hold, Release::Wake).await.unwrap());
    node.raise_fences(std::slice::from_ref(&keys), &[1], FENCE_TTL)
        .await
        .unwrap();

    let records = node.records().expect("records");
    let claim = ClaimRequest {
        keys: &keys,
        owner: &reader,
        token: 1,
        fingerprint: b"fp",
        pending_ttl: TTL,
        orphan_ttl: None,
        remember_interrupted: None,
    };
    assert!(matches!(
        records.claim_record(&claim).await.unwrap(),
        ClaimReply::NotOwner
    ));
    let record = Record::new(
        FencingToken::new(1),
        Bytes::from_static(b"fp"),
        Bytes::new(),
    );
    let store = StoreRequest {
        keys: &keys,
        owner: &reader,
        record: &record,
        retention: TTL,
    };
    assert!(matches!(
        records.store_record(&store).await.unwrap(),
        StoreReply::NotOwner
    ));

    // The reader still holds it, whole.
    if let Some(server) = server {
        assert_eq!(
            server.cmd(&["ZCARD", &keys.lock]),
            support::RespValue::Integer(1)
        );
    }
    assert!(extend(&node, hold(&keys, &reader, READ), TTL).await);
    assert!(release_shared(&node, &keys, &reader).await);
    token(exclusive(&node, &keys, &w, None).await);
}

/// Through a locker (the quorum): the holders of a resource share one mode. Three
/// permits of 3, then a caller with 5 (the next version of a service, with a raised
/// limit) is refused naming both counts, waiting or not, as a reader among them is;
/// once the old holders are gone the new limit takes, and the old one is refused.
mod one_mode_per_resource {
    use super::*;
    use tower_redlock::{LockError, LockMode, LockOptions, Redlock};

    fn mismatch(outcome: Result<tower_redlock::Lease, LockError>, held: LockMode, asked: LockMode) {
        match outcome {
            Err(error @ LockError::ModeMismatch { .. }) => {
                let LockError::ModeMismatch {
                    held: found,
                    asked: sent,
                    ..
                } = &error
                else {
                    unreachable!()
                };
                assert_eq!((*found, *sent), (held, asked));
                let text = error.to_string();
                assert!(
                    text.contains(&format!("{held:?}")) && text.contains(&format!("{asked:?}")),
                    "{text}"
                );
            }
            other => panic!("expected {asked:?} refused beside {held:?}, got {other:?}"),
        }
    }

    async fn check(locker: Redlock) {
        let three = LockMode::counted(3).unwrap();
        let five = LockMode::counted(5).unwrap();
        let mut old = Vec::new();
        for _ in 0..3 {
            old.push(locker.try_acquire_as("export", three).await.unwrap());
        }
        mismatch(locker.try_acquire_as("export", five).await, three, five);
        mismatch(
            locker.acquire_as("export", five, PATIENCE).await,
            three,
            five,
        );
        mismatch(
            locker.try_acquire_as("export", LockMode::Shared).await,
            three,
            LockMode::Shared,
        );
        for lease in old {
            lease.release().await;
        }
        let mut new = Vec::new();
        for _ in 0..5 {
            new.push(locker.try_acquire_as("export", five).await.unwrap());
        }
        mismatch(locker.try_acquire_as("export", three).await, five, three);
        for lease in new {
            lease.release().await;
        }
        let reader = locker
            .try_acquire_as("report", LockMode::Shared)
            .await
            .unwrap();
        mismatch(
            locker.try_acquire_as("report", three).await,
            LockMode::Shared,
            three,
        );
        reader.release().await;
        locker
            .try_acquire_as("report", three)
            .await
            .unwrap()
            .release()
            .await;
    }

    fn options() -> LockOptions {
        LockOptions::default().node_timeout(support::PATIENT_NODE_TIMEOUT)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_memory_nodes() {
        check(Redlock::new([MemoryNode::new()], options()).unwrap()).await;
        let three = [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()];
        check(Redlock::new(three, options()).unwrap()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_one_redis_server() {
        let server = RedisServer::start();
        check(Redlock::from_urls([server.url()], options()).unwrap()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_three_redis_servers() {
        let servers = RedisServer::start_many(3);
        let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
        check(Redlock::from_urls(urls, options()).unwrap()).await;
    }
}
