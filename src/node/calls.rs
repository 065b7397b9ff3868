//! What the engine sends a node and what it answers: one shape for one resource or a
//! set ([`Acquire`], [`Hold`]), in any [`LockMode`], and the one-value-per-key list
//! ([`PerKey`]) that keeps a single resource's answer inline.

use std::time::Duration;

use crate::node::{LockMode, Owner, ResourceKeys, Waiter};

/// One value per key of a call, in the call's order: inline for one resource (no
/// allocation on the most common path), a `Vec` for a set.
#[derive(Clone, PartialEq, Eq)]
pub struct PerKey<T>(Repr<T>);

#[derive(Clone, PartialEq, Eq)]
enum Repr<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> PerKey<T> {
    /// The value of a call over one key.
    pub fn one(value: T) -> Self {
        PerKey(Repr::One(value))
    }

    /// `f` of every item of `items`, inline when there is one.
    pub fn map<X>(items: &[X], mut f: impl FnMut(&X) -> T) -> Self {
        match items {
            [only] => PerKey::one(f(only)),
            _ => PerKey(Repr::Many(items.iter().map(f).collect())),
        }
    }
}

impl<T> From<Vec<T>> for PerKey<T> {
    fn from(values: Vec<T>) -> Self {
        PerKey(Repr::Many(values))
    }
}

impl<T> std::ops::Deref for PerKey<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.0 {
            Repr::One(value) => std::slice::from_ref(value),
            Repr::Many(values) => values,
        }
    }
}

impl<T> std::ops::DerefMut for PerKey<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.0 {
            Repr::One(value) => std::slice::from_mut(value),
            Repr::Many(values) => values,
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for PerKey<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Arguments of [`Node::acquire`](crate::node::Node::acquire): one resource or a set,
/// in a [`LockMode`].
///
/// A set (two or more keys) is **all or nothing on the node**: when one member is held
/// by someone else, nothing of the request stays held there, and the answer names the
/// first member found held. Sets are exclusive only, and never carry a waiter: the
/// engine asks a set in [`LockMode::Exclusive`] with `waiter: None`.
#[derive(Debug, Clone, Copy)]
pub struct Acquire<'a> {
    /// The keys of every resource, in canonical order (sorted, no duplicates). Never
    /// empty; one resource is a set of one.
    pub keys: &'a [ResourceKeys],
    /// The owner value of this acquisition (this node's, see [`Owner::for_node`]).
    pub owner: &'a Owner,
    /// Exclusive, shared or counted (see [`LockMode`] for what each asks of a node).
    pub mode: LockMode,
    /// The lock keys' (or the shared holder's) time to live.
    pub ttl: Duration,
    /// Maintain the fence counters; when `false` (see
    /// [`LockOptions::fencing`](crate::LockOptions::fencing)) the node sets the lock keys
    /// only and answers a fence of 0 for each.
    pub fencing: bool,
    /// The fence counters' time to live.
    pub fence_ttl: Duration,
    /// The least fence value this acquisition may return: each granted key's counter
    /// becomes `max(counter + 1, fence_floor)` (`fence_floor` when missing). It is the
    /// acquiring client's clock in ms × 2¹⁰, read once per round so that every node gets
    /// the same floor (see [`fencing`](crate::fencing)); 0 when `fencing` is `false`.
    pub fence_floor: u64,
    /// Test hook: apply `fence_floor` only when the counter is missing (the unsafe rule
    /// a counter restored behind breaks). Set by
    /// `LockOptions::unsafe_fence_seed_only_when_missing`; never set it otherwise.
    #[doc(hidden)]
    pub seed_only_when_missing: bool,
    /// The waiting caller's place in the wait queue, when it waits for one resource
    /// exclusively ([`Redlock::acquire`](crate::Redlock::acquire)); `None` otherwise.
    /// Nodes without a queue ignore it (see [`Capabilities::wait_queue`]).
    pub waiter: Option<&'a Waiter>,
}

/// One node's answer to [`Node::acquire`](crate::node::Node::acquire): its vote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Vote {
    /// Every key was granted; `fences[i]` is key `i`'s fence counter now (0 without
    /// fencing).
    Granted {
        /// Each key's fence counter after the step, in the request's order.
        fences: PerKey<u64>,
    },
    /// Someone else holds a key (or, in a shared mode, the mode's limit is reached):
    /// nothing of this request is held on the node.
    Held {
        /// The index (in the request's order) of the first key found held.
        member: usize,
        /// The longest remaining ttl of what stands in the way (`None`: no ttl).
        pttl: Option<Duration>,
    },
    /// Shared holders hold the resource in another mode than the one asked (see
    /// [`LockMode`]).
    OtherMode {
        /// The mode the live holders hold it in.
        held: LockMode,
    },
}

/// What a lease holds on a node: its keys, its owner value there, and its mode; the
/// argument of [`Node::extend`](crate::node::Node::extend) and
/// [`Node::release`](crate::node::Node::release). A set's hold counts as extended (or
/// released) only when every member is.
#[derive(Debug, Clone, Copy)]
pub struct Hold<'a> {
    /// The keys of every resource of the lease, in canonical order.
    pub keys: &'a [ResourceKeys],
    /// The owner value expected in the lock keys (already this node's).
    pub owner: &'a Owner,
    /// The mode the lease was granted in: a shared holder is an entry among the
    /// resource's holders, not the lock key's value.
    pub mode: LockMode,
}

/// How [`Node::release`](crate::node::Node::release) lets go of a hold.
#[derive(Debug, Clone, Copy)]
pub enum Release<'a> {
    /// A lease's release: compare-and-delete each key, then hand it to the queue's next
    /// waiter (a node with a wait queue) or wake the key's channel.
    Wake,
    /// The undo of an attempt that granted nobody anything: compare-and-delete only,
    /// waking nobody.
    Quiet,
    /// The release of a lease won by this waiter's attempt (one resource, exclusive):
    /// the waiter also leaves the queue, and a key reserved for it counts as the lease's.
    /// Its attempt may have reached the node before the previous holder's release did,
    /// which then handed it the key there too late; this release hands it on.
    AsWaiter(&'a Waiter),
    /// The undo of a waiter's failed attempt (one resource, exclusive): a key that still
    /// holds the owner is reserved again for the waiter, which keeps its turn, instead
    /// of going to the next one.
    HandBack(&'a Waiter),
}

/// What a node kind can do beyond the calls every node answers, read once when the
/// locker is built ([`Node::capabilities`](crate::node::Node::capabilities)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The node keeps a cross-process wait queue per resource (see
    /// [`Waiter`]): a locker whose majority keep one serves waiters in order; without,
    /// each release wakes every waiter of the resource on its channel.
    pub wait_queue: bool,
    /// The node keeps shared and counted holders ([`LockMode::Shared`],
    /// [`LockMode::Counted`]); a locker refuses those modes with a node that does not.
    pub shared_modes: bool,
}

impl Capabilities {
    /// Every capability: a wait queue and shared modes.
    pub const ALL: Capabilities = Capabilities {
        wait_queue: true,
        shared_modes: true,
    };
}
