//! What one acquisition takes: a single resource or a set of them. The engine has one
//! path (`acquire.rs` the waiting, `attempt.rs` one round, `round.rs` the fan-out),
//! generic over a [`Target`]; the target only says which node calls to make and how
//! its members are kept. A single resource is its own type, so its path is compiled
//! apart and keeps everything inline: one fence value in a `[u64; 1]`, one turn, one
//! queue, the same node calls and scripts as ever.
//!
//! How a single resource is taken — exclusive, shared or counted ([`LockMode`]) — is
//! part of [`Single`]: the mode picks the node calls (the exclusive ones, or
//! [`SharedModes`](crate::node::SharedModes)'), the rest of the path is the same. A set
//! is exclusive.

use std::sync::Arc;
use std::time::Duration;

use super::quorum;
use crate::node::NodeCalls;
use crate::node::{
    AcquireReply, AcquireRequest, AcquireSetReply, AcquireSetRequest, Node, NodeFuture, Owner,
    Resource, ResourceKeys, SharedMode, SharedRequest, Waiter,
};
use crate::LockMode;

/// The settings of one acquire call, whatever the target (`owner` is the node's own).
#[derive(Clone, Copy)]
pub(crate) struct Ask<'a> {
    pub(crate) owner: &'a Owner,
    pub(crate) ttl: Duration,
    pub(crate) fence_ttl: Duration,
    pub(crate) fencing: bool,
    pub(crate) fence_floor: u64,
    pub(crate) seed_only_when_missing: bool,
    /// The waiter joining the nodes' wait queues; only a [`Single`] has one.
    pub(crate) waiter: Option<&'a Waiter>,
}

/// One node's vote in an acquire round.
pub(crate) enum Vote<F> {
    /// The node granted every member; each member's fence counter.
    Granted(F),
    /// Someone else holds a member: the first one (in canonical order) found held,
    /// and the longest remaining ttl the node saw.
    Held {
        member: usize,
        pttl: Option<Duration>,
    },
    /// Shared holders hold the resource in another mode.
    OtherMode(SharedMode),
}

/// One resource or a set, in canonical order: what the engine's rounds are generic over.
pub(crate) trait Target: Send + Sync + Sized + 'static {
    /// One value per member, inline for a single resource (`[X; 1]`), a `Vec` for a set.
    type Each<X: Send + Sync + 'static>: AsRef<[X]>
        + AsMut<[X]>
        + IntoIterator<Item = X>
        + Send
        + Sync
        + 'static;
    /// A node's answer to the acquire call.
    type Reply: Send + 'static;
    /// What a failed attempt's cleanup keeps to release its keys in the background.
    type Undo: Send + Sync + 'static;
    /// Whether a waiter joins the nodes' wait queues, which only the exclusive single
    /// acquire call carries; a set's or a shared holder's waiter is woken by every
    /// release of a member instead.
    fn queues(&self) -> bool;

    /// Whether the target shares its resource (a reader, a permit): then it takes a
    /// local queue of its own rather than the resource's, which has one holder at a time.
    fn shares(&self) -> bool {
        false
    }

    /// The mode of the lease (a set's is exclusive).
    fn mode(&self) -> LockMode {
        LockMode::Exclusive
    }

    /// The votes this target needs among `nodes` nodes (see [`quorum::for_mode`]).
    fn quorum(&self, nodes: usize) -> usize {
        quorum::of(nodes)
    }

    /// The members, in canonical order (never empty).
    fn resources(&self) -> &[Resource];
    /// Each member's keys, in canonical order.
    fn keys(&self) -> &[ResourceKeys];
    /// `f` of every member, in canonical order.
    fn each<X: Send + Sync + 'static>(&self, f: impl FnMut(&Resource) -> X) -> Self::Each<X>;

    fn acquire(&self, node: &Arc<dyn Node>, ask: &Ask<'_>) -> NodeFuture<Self::Reply>;
    fn vote(reply: Self::Reply) -> Vote<Self::Each<u64>>;
    /// Whether a reply says someone else holds a member: then nothing of ours is there.
    fn refused(reply: &Self::Reply) -> bool;
    /// Raises each member's fence counter to its token on `node`.
    fn raise(&self, node: &dyn Node, tokens: &[u64], fence_ttl: Duration) -> NodeFuture<()>;
    fn extend(&self, node: &dyn Node, owner: &Owner, ttl: Duration) -> NodeFuture<bool>;
    /// Releases a lease; `waiter`: its attempt was a waiter's (see
    /// [`Node::release_as_waiter`]).
    fn release(&self, node: &dyn Node, owner: &Owner, waiter: Option<&Waiter>) -> NodeFuture<bool>;

    /// What [`Self::undo_call`] needs, owned; `waiter`: the attempt was a waiter's.
    fn undo(&self, waiter: Option<&Waiter>) -> Self::Undo;
    /// Releases a failed attempt's keys on `node`.
    fn undo_call(undo: &Self::Undo, node: &dyn Node, owner: &Owner) -> NodeFuture<bool>;

    /// The won target with its tokens, as a lease keeps them.
    fn into_members(self, tokens: Self::Each<u64>) -> Members;
}

/// One resource: the node's single-key calls, exclusive or shared.
pub(crate) struct Single {
    resource: Resource,
    keys: ResourceKeys,
    mode: LockMode,
}

impl Single {
    pub(crate) fn new(prefix: &str, resource: Resource, mode: LockMode) -> Self {
        let keys = ResourceKeys::new(prefix, &resource);
        Single {
            resource,
            keys,
            mode,
        }
    }

    pub(crate) fn mode(&self) -> LockMode {
        self.mode
    }

    /// The node-level mode of a shared or counted lease; `None` for an exclusive one.
    fn shared(&self) -> Option<SharedMode> {
        match self.mode {
            LockMode::Shared => Some(SharedMode::Shared),
            LockMode::Counted(n) => Some(SharedMode::Counted(n)),
            _ => None,
        }
    }

    /// The keys without the channel: a release that wakes nobody.
    fn quiet(&self) -> ResourceKeys {
        ResourceKeys {
            channel: String::new(),
            ..self.keys.clone()
        }
    }
}

/// Undoing a single resource's attempt: released as a lease is (on a node with a wait
/// queue, a key taken from the queue's head goes on to the next waiter), or, for a
/// waiter, which keeps its turn, handed back to it
/// ([`WaitQueue::hand_back`](crate::node::WaitQueue::hand_back)); a shared holder's
/// entry is removed without waking anyone.
pub(crate) enum UndoSingle {
    Exclusive {
        keys: ResourceKeys,
        waiter: Option<Waiter>,
    },
    Shared(ResourceKeys),
}

impl Target for Single {
    type Each<X: Send + Sync + 'static> = [X; 1];
    type Reply = AcquireReply;
    type Undo = UndoSingle;

    fn queues(&self) -> bool {
        self.mode.is_exclusive()
    }

    fn quorum(&self, nodes: usize) -> usize {
        quorum::for_mode(nodes, self.mode)
    }

    fn shares(&self) -> bool {
        !self.mode.is_exclusive()
    }

    fn mode(&self) -> LockMode {
        self.mode
    }

    fn resources(&self) -> &[Resource] {
        std::slice::from_ref(&self.resource)
    }

    fn keys(&self) -> &[ResourceKeys] {
        std::slice::from_ref(&self.keys)
    }

    fn each<X: Send + Sync + 'static>(&self, mut f: impl FnMut(&Resource) -> X) -> [X; 1] {
        [f(&self.resource)]
    }

    fn acquire(&self, node: &Arc<dyn Node>, ask: &Ask<'_>) -> NodeFuture<AcquireReply> {
        if let Some(mode) = self.shared() {
            return node.acquire_shared(&SharedRequest {
                keys: &self.keys,
                owner: ask.owner,
                mode,
                ttl: ask.ttl,
                fence_ttl: ask.fence_ttl,
                fencing: ask.fencing,
                fence_floor: ask.fence_floor,
            });
        }
        node.acquire(&AcquireRequest {
            keys: &self.keys,
            owner: ask.owner,
            ttl: ask.ttl,
            fence_ttl: ask.fence_ttl,
            fencing: ask.fencing,
            fence_floor: ask.fence_floor,
            seed_only_when_missing: ask.seed_only_when_missing,
            waiter: ask.waiter,
        })
    }

    fn vote(reply: AcquireReply) -> Vote<[u64; 1]> {
        match reply {
            AcquireReply::Acquired { fence } => Vote::Granted([fence]),
            AcquireReply::Held { pttl } => Vote::Held { member: 0, pttl },
            AcquireReply::OtherMode { held } => Vote::OtherMode(held),
        }
    }

    fn refused(reply: &AcquireReply) -> bool {
        matches!(
            reply,
            AcquireReply::Held { .. } | AcquireReply::OtherMode { .. }
        )
    }

    fn raise(&self, node: &dyn Node, tokens: &[u64], fence_ttl: Duration) -> NodeFuture<()> {
        node.raise_fence(&self.keys, tokens[0], fence_ttl)
    }

    fn extend(&self, node: &dyn Node, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        match self.mode {
            LockMode::Exclusive => node.extend(&self.keys, owner, ttl),
            _ => node.extend_shared(&self.keys, owner, ttl),
        }
    }

    fn release(&self, node: &dyn Node, owner: &Owner, waiter: Option<&Waiter>) -> NodeFuture<bool> {
        match (self.mode, waiter) {
            (LockMode::Exclusive, Some(waiter)) => {
                node.release_as_waiter(&self.keys, owner, waiter)
            }
            (LockMode::Exclusive, None) => node.release(&self.keys, owner),
            _ => node.release_shared(&self.keys, owner),
        }
    }

    fn undo(&self, waiter: Option<&Waiter>) -> UndoSingle {
        match self.mode {
            LockMode::Exclusive => UndoSingle::Exclusive {
                keys: self.keys.clone(),
                waiter: waiter.cloned(),
            },
            _ => UndoSingle::Shared(self.quiet()),
        }
    }

    fn undo_call(undo: &UndoSingle, node: &dyn Node, owner: &Owner) -> NodeFuture<bool> {
        match undo {
            UndoSingle::Exclusive {
                keys,
                waiter: Some(waiter),
            } => node.hand_back(keys, owner, waiter),
            UndoSingle::Exclusive { keys, waiter: None } => node.release(keys, owner),
            UndoSingle::Shared(keys) => node.release_shared(keys, owner),
        }
    }

    fn into_members(self, tokens: [u64; 1]) -> Members {
        Members::Single(self, tokens)
    }
}

/// A set of two or more resources: the node's set calls (all or nothing on each node).
pub(crate) struct Set {
    resources: Box<[Resource]>,
    keys: Box<[ResourceKeys]>,
}

impl Set {
    /// The set of `resources`, already in canonical order.
    pub(crate) fn new(prefix: &str, resources: Vec<Resource>) -> Self {
        let keys = resources
            .iter()
            .map(|r| ResourceKeys::new(prefix, r))
            .collect();
        Set {
            resources: resources.into_boxed_slice(),
            keys,
        }
    }
}

/// Undoing a set's attempt: the members' keys without their channels, as nothing was
/// granted to anyone, so the cleanup wakes no waiter.
pub(crate) struct Quiet(Box<[ResourceKeys]>);

impl Target for Set {
    type Each<X: Send + Sync + 'static> = Vec<X>;
    type Reply = AcquireSetReply;
    type Undo = Quiet;

    fn queues(&self) -> bool {
        false
    }

    fn resources(&self) -> &[Resource] {
        &self.resources
    }

    fn keys(&self) -> &[ResourceKeys] {
        &self.keys
    }

    fn each<X: Send + Sync + 'static>(&self, f: impl FnMut(&Resource) -> X) -> Vec<X> {
        self.resources.iter().map(f).collect()
    }

    fn acquire(&self, node: &Arc<dyn Node>, ask: &Ask<'_>) -> NodeFuture<AcquireSetReply> {
        node.clone().acquire_set(&AcquireSetRequest {
            keys: &self.keys,
            owner: ask.owner,
            ttl: ask.ttl,
            fence_ttl: ask.fence_ttl,
            fencing: ask.fencing,
            fence_floor: ask.fence_floor,
            seed_only_when_missing: ask.seed_only_when_missing,
        })
    }

    fn vote(reply: AcquireSetReply) -> Vote<Vec<u64>> {
        match reply {
            AcquireSetReply::Acquired { fences } => Vote::Granted(fences),
            AcquireSetReply::Held { member, pttl } => Vote::Held { member, pttl },
        }
    }

    fn refused(reply: &AcquireSetReply) -> bool {
        matches!(reply, AcquireSetReply::Held { .. })
    }

    fn raise(&self, node: &dyn Node, tokens: &[u64], fence_ttl: Duration) -> NodeFuture<()> {
        node.raise_fences(&self.keys, tokens, fence_ttl)
    }

    fn extend(&self, node: &dyn Node, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        node.extend_set(&self.keys, owner, ttl)
    }

    fn release(&self, node: &dyn Node, owner: &Owner, _: Option<&Waiter>) -> NodeFuture<bool> {
        node.release_set(&self.keys, owner)
    }

    fn undo(&self, _: Option<&Waiter>) -> Quiet {
        let keys = self.keys.iter().map(|keys| ResourceKeys {
            channel: String::new(),
            ..keys.clone()
        });
        Quiet(keys.collect())
    }

    fn undo_call(undo: &Quiet, node: &dyn Node, owner: &Owner) -> NodeFuture<bool> {
        node.release_set(&undo.0, owner)
    }

    fn into_members(self, tokens: Vec<u64>) -> Members {
        Members::Set(Box::new((self, tokens)))
    }
}

/// What a lease holds: its target and each member's fencing token (a raw value).
pub(crate) enum Members {
    Single(Single, [u64; 1]),
    Set(Box<(Set, Vec<u64>)>),
}

impl Members {
    /// The votes this lease needs among `nodes` nodes to hold (see
    /// [`quorum::for_mode`]).
    pub(crate) fn quorum(&self, nodes: usize) -> usize {
        match self {
            Members::Single(single, _) => single.quorum(nodes),
            Members::Set(set) => set.0.quorum(nodes),
        }
    }

    pub(crate) fn resources(&self) -> &[Resource] {
        match self {
            Members::Single(single, _) => single.resources(),
            Members::Set(set) => set.0.resources(),
        }
    }

    pub(crate) fn keys(&self) -> &[ResourceKeys] {
        match self {
            Members::Single(single, _) => single.keys(),
            Members::Set(set) => set.0.keys(),
        }
    }

    pub(crate) fn tokens(&self) -> &[u64] {
        match self {
            Members::Single(_, tokens) => tokens,
            Members::Set(set) => &set.1,
        }
    }
}
