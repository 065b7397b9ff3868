//! The [`Node`] contract as tests (feature `test-util`): a node kind of your own runs
//! [`check`] in its tests, as the crate's memory, Redis and etcd nodes do. Each check
//! works on resources of its own (a random prefix), so one server serves them all; a
//! failed check panics naming what broke.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::Arc;
//! use tower_redlock::node::conformance::{check, Contract};
//! use tower_redlock::node::Node;
//! use tower_redlock::MemoryNode;
//!
//! // Clones share one store: the second client of the same "server".
//! let node = MemoryNode::new();
//! check(&|| Arc::new(node.clone()) as Arc<dyn Node>, Contract::default()).await;
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::node::{
    Acquire, ClaimReply, ClaimRequest, FencingToken, Hold, LockMode, Node, Owner, Record, Release,
    Resource, ResourceKeys, StoreReply, StoreRequest, Vote, Waiter,
};

const TTL: Duration = Duration::from_secs(10);
const FENCE_TTL: Duration = Duration::from_secs(3600);
/// A hang guard for the wake-ups awaited, not a timing assertion.
const PATIENCE: Duration = Duration::from_secs(10);
const FLOOR: u64 = 1_000;

/// What a node kind promises beyond what every node does.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Contract {
    /// The node keeps a fence counter per resource, stepped by the rule
    /// `max(counter + 1, floor)` and raised by [`Node::raise_fences`] (the memory and
    /// Redis nodes). Without it (etcd: the revision is the token) the check asks only
    /// that tokens increase.
    pub fence_counter: bool,
}

impl Default for Contract {
    fn default() -> Self {
        Contract {
            fence_counter: true,
        }
    }
}

impl Contract {
    /// A node whose tokens come from elsewhere than a counter of its own (see
    /// [`fence_counter`](Contract::fence_counter)).
    pub fn without_fence_counter() -> Self {
        Contract {
            fence_counter: false,
        }
    }
}

/// Runs every check on nodes `make` hands out; `make` is called again where a check
/// needs a second client of the same store (two processes contending). The wait queue,
/// shared modes and records are checked where [`Node::capabilities`] and
/// [`Node::records`] say the node has them.
pub async fn check(make: &dyn Fn() -> Arc<dyn Node>, contract: Contract) {
    let node = make();
    let other = make();
    acquire_and_held(&*node, &*other).await;
    extend_and_release(&*node, &*other).await;
    fence_rule(&*node, contract).await;
    sets(&*node, &*other).await;
    let can = node.capabilities();
    if can.shared_modes {
        shared_modes(&*node, &*other).await;
    }
    if can.wait_queue {
        wait_queue(&*node, &*other).await;
    }
    if node.records().is_some() {
        records(&*node).await;
        orphaned_marker(&*node).await;
    }
}

/// The keys of resource `name`, under a prefix no other run uses.
fn fresh(name: &str) -> ResourceKeys {
    let prefix = format!("conformance:{}:", &Owner::random().as_str()[..12]);
    ResourceKeys::new(&prefix, &Resource::new(name))
}

fn ask<'a>(keys: &'a [ResourceKeys], owner: &'a Owner, mode: LockMode) -> Acquire<'a> {
    Acquire {
        keys,
        owner,
        mode,
        ttl: TTL,
        fencing: true,
        fence_ttl: FENCE_TTL,
        fence_floor: FLOOR,
        seed_only_when_missing: false,
        waiter: None,
    }
}

fn exclusive<'a>(keys: &'a [ResourceKeys], owner: &'a Owner) -> Acquire<'a> {
    ask(keys, owner, LockMode::Exclusive)
}

fn hold<'a>(keys: &'a [ResourceKeys], owner: &'a Owner, mode: LockMode) -> Hold<'a> {
    Hold { keys, owner, mode }
}

fn hold_of<'a>(keys: &'a [ResourceKeys], owner: &'a Owner) -> Hold<'a> {
    hold(keys, owner, LockMode::Exclusive)
}

async fn acquire(node: &dyn Node, request: &Acquire<'_>) -> Vote {
    node.acquire(request)
        .await
        .expect("the node answers acquire")
}

fn granted(vote: Vote, what: &str) -> Vec<u64> {
    match vote {
        Vote::Granted { fences } => fences.to_vec(),
        other => panic!("{what}: expected a grant, got {other:?}"),
    }
}

async fn extend(node: &dyn Node, hold: Hold<'_>) -> bool {
    let answers = node
        .extend(&[hold], TTL)
        .await
        .expect("the node answers extend");
    match answers[..] {
        [Ok(extended)] => extended,
        _ => panic!("extend: one answer per hold, got {answers:?}"),
    }
}

async fn release(node: &dyn Node, hold: Hold<'_>, how: Release<'_>) -> bool {
    node.release(&hold, how)
        .await
        .expect("the node answers release")
}

/// Granted with a fence; another owner is refused with the holder's remaining ttl.
async fn acquire_and_held(node: &dyn Node, other: &dyn Node) {
    let keys = [fresh("held")];
    let (mine, theirs) = (Owner::random(), Owner::random());
    granted(acquire(node, &exclusive(&keys, &mine)).await, "acquire");
    match acquire(other, &exclusive(&keys, &theirs)).await {
        Vote::Held {
            member: 0,
            pttl: Some(pttl),
        } => assert!(
            pttl <= TTL,
            "acquire: held with a pttl above the ttl: {pttl:?}"
        ),
        refused => panic!("acquire: a held key must answer Held with its pttl, got {refused:?}"),
    }
    assert!(release(node, hold_of(&keys, &mine), Release::Wake).await);
}

/// Compare-and-extend never re-creates a key; compare-and-delete deletes only its own.
async fn extend_and_release(node: &dyn Node, other: &dyn Node) {
    let keys = [fresh("owned")];
    let (mine, theirs) = (Owner::random(), Owner::random());
    let (held, stranger) = (hold_of(&keys, &mine), hold_of(&keys, &theirs));
    granted(acquire(node, &exclusive(&keys, &mine)).await, "acquire");
    assert!(extend(node, held).await, "extend: the owner extends");
    assert!(
        !extend(other, stranger).await,
        "extend: a stranger does not"
    );
    assert!(
        !release(other, stranger, Release::Wake).await,
        "release: a stranger does not"
    );
    assert!(
        release(node, held, Release::Wake).await,
        "release: the owner does"
    );
    assert!(
        !release(node, held, Release::Wake).await,
        "release: only once"
    );
    assert!(
        !extend(node, held).await,
        "extend: a released key is not ours"
    );
    // Not re-created by that extend: another owner finds the key free.
    granted(
        acquire(other, &exclusive(&keys, &theirs)).await,
        "free again",
    );
    assert!(release(other, stranger, Release::Quiet).await);
}

/// Tokens: the counter's rule (`max(counter + 1, floor)`, raised by `raise_fences`), or
/// at least increasing.
async fn fence_rule(node: &dyn Node, contract: Contract) {
    let keys = [fresh("fence")];
    let owner = Owner::random();
    let held = hold_of(&keys, &owner);
    let take = |floor: u64| {
        let request = Acquire {
            fence_floor: floor,
            ..exclusive(&keys, &owner)
        };
        async move {
            let token = granted(acquire(node, &request).await, "fence")[0];
            assert!(release(node, held, Release::Wake).await);
            token
        }
    };
    let first = take(FLOOR).await;
    let second = take(1).await;
    assert!(
        second > first,
        "fence: tokens increase ({first}, then {second})"
    );
    if !contract.fence_counter {
        return;
    }
    assert_eq!(first, FLOOR, "fence: a missing counter starts at the floor");
    assert_eq!(second, FLOOR + 1, "fence: counter + 1 above a lower floor");
    assert_eq!(
        take(FLOOR * 10).await,
        FLOOR * 10,
        "fence: a higher floor wins"
    );
    node.raise_fences(&keys, &[FLOOR * 20], FENCE_TTL)
        .await
        .expect("raise");
    node.raise_fences(&keys, &[FLOOR], FENCE_TTL)
        .await
        .expect("raise");
    assert_eq!(
        take(1).await,
        FLOOR * 20 + 1,
        "fence: raised, never lowered"
    );
}

/// A set is all or nothing: refused at its first held member, nothing of it kept.
async fn sets(node: &dyn Node, other: &dyn Node) {
    let members = [fresh("a"), fresh("b"), fresh("c")];
    let (mine, theirs) = (Owner::random(), Owner::random());
    let b = std::slice::from_ref(&members[1]);
    granted(acquire(other, &exclusive(b, &theirs)).await, "member b");
    match acquire(node, &exclusive(&members, &mine)).await {
        Vote::Held { member: 1, .. } => {}
        refused => panic!("sets: expected member 1 held, got {refused:?}"),
    }
    for free in [&members[0], &members[2]] {
        let free = std::slice::from_ref(free);
        let taken = acquire(other, &exclusive(free, &theirs)).await;
        granted(taken, "sets: a refused set keeps nothing");
        assert!(release(other, hold_of(free, &theirs), Release::Quiet).await);
    }
    assert!(release(other, hold_of(b, &theirs), Release::Wake).await);
    let set = hold_of(&members, &mine);
    let tokens = granted(acquire(node, &exclusive(&members, &mine)).await, "set");
    assert_eq!(tokens.len(), 3, "sets: one fence per member");
    assert!(extend(node, set).await, "sets: the owner extends the set");
    assert!(
        release(node, set, Release::Wake).await,
        "sets: the owner releases it"
    );
    assert!(!release(node, set, Release::Wake).await, "sets: once");
}

/// Readers share and exclude a writer; permits are bounded; the holders of a resource
/// hold it in one mode.
async fn shared_modes(node: &dyn Node, other: &dyn Node) {
    let keys = [fresh("modes")];
    let (r1, r2, w) = (Owner::random(), Owner::random(), Owner::random());
    let read = LockMode::Shared;
    granted(acquire(node, &ask(&keys, &r1, read)).await, "a reader");
    granted(
        acquire(other, &ask(&keys, &r2, read)).await,
        "a second reader",
    );
    let writer = acquire(node, &exclusive(&keys, &w)).await;
    assert!(
        matches!(writer, Vote::Held { .. }),
        "modes: a writer beside readers: {writer:?}"
    );
    let two = LockMode::counted(2).expect("2 permits");
    match acquire(node, &ask(&keys, &w, two)).await {
        Vote::OtherMode { held } => assert_eq!(held, read, "modes: the mode held"),
        other => panic!("modes: a permit among readers: {other:?}"),
    }
    assert!(
        extend(node, hold(&keys, &r1, read)).await,
        "modes: a reader extends"
    );
    assert!(
        !extend(node, hold(&keys, &w, read)).await,
        "modes: a stranger does not"
    );
    assert!(release(node, hold(&keys, &r1, read), Release::Wake).await);
    assert!(release(other, hold(&keys, &r2, read), Release::Wake).await);
    // Permits: two of two, the third refused until one is released.
    granted(acquire(node, &ask(&keys, &r1, two)).await, "permit 1");
    granted(acquire(node, &ask(&keys, &r2, two)).await, "permit 2");
    let third = acquire(other, &ask(&keys, &w, two)).await;
    assert!(
        matches!(third, Vote::Held { .. }),
        "modes: a third of two permits: {third:?}"
    );
    assert!(release(node, hold(&keys, &r1, two), Release::Wake).await);
    granted(acquire(other, &ask(&keys, &w, two)).await, "a freed permit");
    assert!(release(node, hold(&keys, &r2, two), Release::Wake).await);
    assert!(release(other, hold(&keys, &w, two), Release::Wake).await);
}

/// Waiters are served in the order of their tickets: a release reserves the key for
/// the queue's head and wakes it alone; its release hands it to the next.
async fn wait_queue(node: &dyn Node, other: &dyn Node) {
    let keys = [fresh("queue")];
    let (holder, first, second) = (Owner::random(), Owner::random(), Owner::random());
    let waiter = |id: &str, ticket| Waiter {
        id: id.to_owned(),
        ticket,
        queue_ttl: TTL,
    };
    let (w1, w2) = (waiter("00000000000000a1", 1), waiter("00000000000000a2", 2));
    let own = |w: &Waiter| ResourceKeys {
        channel: w.channel(&keys[0]),
        ..keys[0].clone()
    };
    let mut woken1 = node.subscribe(&own(&w1)).await.expect("subscribe");
    let mut woken2 = other.subscribe(&own(&w2)).await.expect("subscribe");
    granted(acquire(node, &exclusive(&keys, &holder)).await, "holder");
    // The later ticket asks first: the queue orders by ticket, not by arrival.
    for (node, owner, waiter) in [(other, &second, &w2), (node, &first, &w1)] {
        let refused = acquire(node, &queued(&keys, owner, waiter)).await;
        assert!(matches!(refused, Vote::Held { .. }), "queue: {refused:?}");
    }
    woken1.mark_seen();
    let held = hold_of(&keys, &holder);
    assert!(release(node, held, Release::Wake).await);
    tokio::time::timeout(PATIENCE, woken1.changed())
        .await
        .expect("queue: the release wakes the head of the queue");
    let early = acquire(other, &queued(&keys, &second, &w2)).await;
    assert!(
        matches!(early, Vote::Held { .. }),
        "queue: reserved for the head: {early:?}"
    );
    granted(
        acquire(node, &queued(&keys, &first, &w1)).await,
        "queue: the head",
    );
    woken2.mark_seen();
    let won = hold_of(&keys, &first);
    assert!(release(node, won, Release::AsWaiter(&w1)).await);
    tokio::time::timeout(PATIENCE, woken2.changed())
        .await
        .expect("queue: the head's release wakes the next");
    granted(
        acquire(other, &queued(&keys, &second, &w2)).await,
        "queue: the next",
    );
    let next = hold_of(&keys, &second);
    assert!(release(other, next, Release::AsWaiter(&w2)).await);
}

fn queued<'a>(keys: &'a [ResourceKeys], owner: &'a Owner, waiter: &'a Waiter) -> Acquire<'a> {
    Acquire {
        waiter: Some(waiter),
        ..exclusive(keys, owner)
    }
}

/// A claim of `keys` by `owner`'s lease with `token`; `orphan_ttl` as [`ClaimRequest`]'s.
fn claim_of<'a>(
    keys: &'a ResourceKeys,
    owner: &'a Owner,
    token: u64,
    orphan_ttl: Option<Duration>,
) -> ClaimRequest<'a> {
    ClaimRequest {
        keys,
        owner,
        token,
        fingerprint: b"fp",
        pending_ttl: TTL,
        orphan_ttl,
        remember_interrupted: None,
    }
}

/// Outcome records: only the lock's owner claims and stores; a stored record reads
/// back; a pending marker is discarded by its token.
async fn records(node: &dyn Node) {
    let records = node.records().expect("records");
    let keys = [fresh("records")];
    let (owner, stranger) = (Owner::random(), Owner::random());
    let token = granted(acquire(node, &exclusive(&keys, &owner)).await, "lock")[0];
    let claim = |owner: &Owner| records.claim_record(&claim_of(&keys[0], owner, token, None));
    let claimed = claim(&stranger).await.expect("claim");
    assert_eq!(claimed, ClaimReply::NotOwner, "records: a stranger's claim");
    let claimed = claim(&owner).await.expect("claim");
    assert_eq!(claimed, ClaimReply::Claimed, "records: the owner's claim");
    assert_eq!(records.read_record(&keys[0]).await.expect("read"), None);
    assert!(records
        .discard_record(&keys[0], token)
        .await
        .expect("discard"));
    let claimed = claim(&owner).await.expect("claim");
    assert_eq!(claimed, ClaimReply::Claimed, "records: claimed again");
    // A claim sent again (its answer lost) finds its own marker and leaves it there.
    let claimed = claim(&owner).await.expect("claim");
    assert_eq!(claimed, ClaimReply::Claimed, "records: a claim sent again");
    assert!(
        records
            .discard_record(&keys[0], token)
            .await
            .expect("discard"),
        "records: the marker a claim sent again found is still there"
    );
    let claimed = claim(&owner).await.expect("claim");
    assert_eq!(
        claimed,
        ClaimReply::Claimed,
        "records: claimed after the discard"
    );
    let record = Record::new(
        FencingToken::new(token),
        Bytes::from_static(b"fp"),
        Bytes::from_static(b"outcome"),
    );
    let store = |owner: &Owner| {
        let request = StoreRequest {
            keys: &keys[0],
            owner,
            record: &record,
            retention: TTL,
        };
        records.store_record(&request)
    };
    let stored = store(&stranger).await.expect("store");
    assert_eq!(stored, StoreReply::NotOwner, "records: a stranger's store");
    let stored = store(&owner).await.expect("store");
    assert_eq!(stored, StoreReply::Stored, "records: the owner's store");
    let read = records.read_record(&keys[0]).await.expect("read");
    assert_eq!(read, Some(record), "records: the stored record reads back");
    assert!(release(node, hold_of(&keys, &owner), Release::Wake).await);
}

/// An interrupted holder's pending marker, found by the next holder's claim, stays
/// found: a claim sent again (its answer lost) writes nothing and must not delete the
/// marker, or a later claim would run the work again instead of answering that the
/// outcome is unknown.
async fn orphaned_marker(node: &dyn Node) {
    let records = node.records().expect("records");
    let keys = [fresh("orphaned")];
    let claim = |owner: &Owner, token: u64| {
        records.claim_record(&claim_of(&keys[0], owner, token, Some(TTL)))
    };
    let first = Owner::random();
    let interrupted = granted(acquire(node, &exclusive(&keys, &first)).await, "lock")[0];
    let claimed = claim(&first, interrupted).await.expect("claim");
    assert_eq!(claimed, ClaimReply::Claimed, "orphaned: the first claim");
    assert!(release(node, hold_of(&keys, &first), Release::Wake).await);
    let next = Owner::random();
    let token = granted(acquire(node, &exclusive(&keys, &next)).await, "lock")[0];
    for attempt in ["found", "sent again"] {
        let claimed = claim(&next, token).await.expect("claim");
        assert!(
            matches!(claimed, ClaimReply::Orphaned { .. }),
            "orphaned: the next holder's claim {attempt}: {claimed:?}"
        );
    }
    assert!(
        records
            .discard_record(&keys[0], interrupted)
            .await
            .expect("discard"),
        "orphaned: the marker is still there after two claims found it"
    );
    assert!(release(node, hold_of(&keys, &next), Release::Wake).await);
}
