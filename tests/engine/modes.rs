//! Shared and counted holders at the node level (`tower_redlock::node::SharedModes`),
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
    AcquireReply, AcquireRequest, AcquireSetReply, AcquireSetRequest, ClaimReply, ClaimRequest,
    ExtendEntry, Owner, Record, ResourceKeys, SharedMode, SharedModes, SharedRequest, StoreReply,
    StoreRequest, Waiter,
};
use tower_redlock::{node::Node, FencingToken, MemoryNode, RedisNode};

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

fn modes(node: &Arc<dyn Node>) -> &dyn SharedModes {
    node.shared_modes().expect("the node keeps shared holders")
}

fn resource(name: &str) -> ResourceKeys {
    keys(format!("modes:{{{name}}}"))
}

async fn shared(
    node: &Arc<dyn Node>,
    keys: &ResourceKeys,
    owner: &Owner,
    mode: SharedMode,
    ttl: Duration,
) -> AcquireReply {
    let request = SharedRequest {
        keys,
        owner,
        mode,
        ttl,
        fence_ttl: FENCE_TTL,
        fencing: true,
        fence_floor: 1,
    };
    modes(node).acquire_shared(&request).await.unwrap()
}

async fn exclusive(
    node: &Arc<dyn Node>,
    keys: &ResourceKeys,
    owner: &Owner,
    waiter: Option<&Waiter>,
) -> AcquireReply {
    let request = AcquireRequest {
        keys,
        owner,
        ttl: TTL,
        fence_ttl: FENCE_TTL,
        fencing: true,
        fence_floor: 1,
        seed_only_when_missing: false,
        waiter,
    };
    node.acquire(&request).await.unwrap()
}

fn token(reply: AcquireReply) -> u64 {
    match reply {
        AcquireReply::Acquired { fence } => fence,
        held => panic!("expected a grant, got {held:?}"),
    }
}

fn is_held(reply: &AcquireReply) -> bool {
    matches!(reply, AcquireReply::Held { .. })
}

fn waiter(id: &str, queue_ttl: Duration) -> Waiter {
    Waiter {
        id: id.to_owned(),
        ticket: 1,
        queue_ttl,
    }
}

const READ: SharedMode = SharedMode::Shared;

async fn readers_share_and_exclude_the_writer(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("share");
    let owner = owners().await;
    let (r1, r2, w) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    token(shared(&node, &keys, &r1, READ, TTL).await);
    token(shared(&node, &keys, &r2, READ, TTL).await);
    let refused = exclusive(&node, &keys, &w, None).await;
    let AcquireReply::Held { pttl: Some(pttl) } = refused else {
        panic!("a writer beside readers: {refused:?}");
    };
    assert!(pttl <= TTL);
    assert!(modes(&node).release_shared(&keys, &r1).await.unwrap());
    assert!(is_held(&exclusive(&node, &keys, &w, None).await));
    assert!(modes(&node).release_shared(&keys, &r2).await.unwrap());
    token(exclusive(&node, &keys, &w, None).await);
}

async fn a_writer_excludes_readers_and_permits(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("writer");
    let owner = owners().await;
    let (w, r, p) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    token(exclusive(&node, &keys, &w, None).await);
    assert!(is_held(&shared(&node, &keys, &r, READ, TTL).await));
    let permit = SharedMode::counted(5).unwrap();
    assert!(is_held(&shared(&node, &keys, &p, permit, TTL).await));
    assert!(node.release(&keys, &w).await.unwrap());
    token(shared(&node, &keys, &r, READ, TTL).await);
    // A permit among readers: the holders' mode, not contention.
    let other = shared(&node, &keys, &p, permit, TTL).await;
    assert_eq!(other, AcquireReply::OtherMode { held: READ });
    assert!(modes(&node).release_shared(&keys, &r).await.unwrap());
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

    assert!(modes(&node).release_shared(&keys, &r1).await.unwrap());
    tokio::time::timeout(PATIENCE, woken.changed())
        .await
        .expect("the last reader's release wakes the queued writer");
    // Reserved for the writer: readers still wait, the writer takes it.
    assert!(is_held(&shared(&node, &keys, &r2, READ, TTL).await));
    token(exclusive(&node, &keys, &w, Some(&writer)).await);
    assert!(node
        .wait_queue()
        .unwrap()
        .release_as_waiter(&keys, &w, &writer)
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
            node.wait_queue()
                .unwrap()
                .listen_for_release(&keys, TTL)
                .await
                .unwrap();
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
    let mode = SharedMode::counted(PERMITS as u32).unwrap();
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
                    assert!(modes(&node).release_shared(&keys, &owner).await.unwrap());
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
    let two = SharedMode::counted(2).unwrap();
    token(shared(&node, &keys, &live, two, 6 * PATIENCE).await);
    token(shared(&node, &keys, &dead, two, Duration::from_millis(200)).await);
    let refused = shared(&node, &keys, &next, two, TTL).await;
    let AcquireReply::Held { pttl: Some(pttl) } = refused else {
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
    assert!(!modes(&node).extend_shared(&keys, &dead, TTL).await.unwrap());
    assert!(!modes(&node).release_shared(&keys, &dead).await.unwrap());
}

async fn only_the_owner_extends_or_releases(node: Arc<dyn Node>, _: Option<&RedisServer>) {
    let keys = resource("owner");
    let owner = owners().await;
    let (holder, stranger, w) = (owner.for_node(1), owner.for_node(2), owner.for_node(3));
    let one = SharedMode::counted(1).unwrap();
    token(shared(&node, &keys, &holder, one, TTL).await);
    assert!(!modes(&node).release_shared(&keys, &stranger).await.unwrap());
    assert!(!modes(&node)
        .extend_shared(&keys, &stranger, TTL)
        .await
        .unwrap());
    assert!(is_held(&shared(&node, &keys, &stranger, one, TTL).await));
    assert!(is_held(&exclusive(&node, &keys, &w, None).await));
    assert!(modes(&node)
        .extend_shared(&keys, &holder, TTL)
        .await
        .unwrap());
    // The batched renewal: per entry, ours or not.
    let entries = [
        ExtendEntry {
            keys: &keys,
            owner: holder.clone(),
        },
        ExtendEntry {
            keys: &keys,
            owner: stranger.clone(),
        },
    ];
    let extended = modes(&node)
        .extend_shared_many(&entries, TTL)
        .await
        .unwrap();
    assert_eq!(
        extended.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        [true, false]
    );
    assert!(modes(&node).release_shared(&keys, &holder).await.unwrap());
    assert!(!modes(&node).release_shared(&keys, &holder).await.unwrap());
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
    node.wait_queue()
        .unwrap()
        .listen_for_release(&keys, TTL)
        .await
        .unwrap();
    released.mark_seen();
    assert!(node.release(&keys, &w).await.unwrap());
    tokio::time::timeout(PATIENCE, released.changed())
        .await
        .expect("a writer's release wakes the readers");

    // A permit's release wakes a permit waiter, while other holders remain.
    let two = SharedMode::counted(2).unwrap();
    token(shared(&node, &keys, &a, two, TTL).await);
    token(shared(&node, &keys, &b, two, TTL).await);
    assert!(is_held(&shared(&node, &keys, &w, two, TTL).await));
    node.wait_queue()
        .unwrap()
        .listen_for_release(&keys, TTL)
        .await
        .unwrap();
    released.mark_seen();
    assert!(modes(&node).release_shared(&keys, &a).await.unwrap());
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
    assert!(node.release(&keys, &w1).await.unwrap());
    let read1 = token(shared(&node, &keys, &r1, READ, TTL).await);
    let read2 = token(shared(&node, &keys, &r2, READ, TTL).await);
    assert!(read1 > first && read2 > first, "{first} {read1} {read2}");
    assert!(modes(&node).release_shared(&keys, &r1).await.unwrap());
    assert!(modes(&node).release_shared(&keys, &r2).await.unwrap());
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
    node.wait_queue()
        .unwrap()
        .leave_queue(&keys, &writer)
        .await
        .unwrap();
    let plain = AcquireRequest {
        keys: &keys,
        owner: &w,
        ttl: TTL,
        fence_ttl: FENCE_TTL,
        fencing: false,
        fence_floor: 0,
        seed_only_when_missing: false,
        waiter: None,
    };
    assert!(is_held(&node.acquire(&plain).await.unwrap()));
    assert!(!node.extend(&keys, &reader, TTL).await.unwrap());
    let entry = [ExtendEntry {
        keys: &keys,
        owner: reader.clone(),
    }];
    assert_eq!(
        node.extend_many(&entry, TTL)
            .await
            .unwrap()
            .into_iter()
            .map(Result::unwrap)
            .collect::<Vec<_>>(),
        [false]
    );
    assert!(!node.release(&keys, &reader).await.unwrap());
    let queue = node.wait_queue().unwrap();
    assert!(!queue
        .release_as_waiter(&keys, &reader, &writer)
        .await
        .unwrap());
    assert!(!queue.hand_back(&keys, &reader, &writer).await.unwrap());
    let members = [keys.clone(), resource("types-other")];
    let set = AcquireSetRequest {
        keys: &members,
        owner: &w,
        ttl: TTL,
        fence_ttl: FENCE_TTL,
        fencing: true,
        fence_floor: 1,
        seed_only_when_missing: false,
    };
    let sets = node.sets().unwrap();
    let reply = sets.acquire_set(&set).await.unwrap();
    assert!(
        matches!(reply, AcquireSetReply::Held { member: 0, .. }),
        "{reply:?}"
    );
    assert!(!sets.extend_set(&members, &reader, TTL).await.unwrap());
    assert!(!sets.release_set(&members, &reader).await.unwrap());
    node.raise_fence(&keys, 1, FENCE_TTL).await.unwrap();

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
    assert!(modes(&node)
        .extend_shared(&keys, &reader, TTL)
        .await
        .unwrap());
    assert!(modes(&node).release_shared(&keys, &reader).await.unwrap());
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
