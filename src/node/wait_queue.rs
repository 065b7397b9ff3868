//! The cross-process wait queue: a capability a node may have ([`Node::wait_queue`]).
//! With it a majority of nodes serve waiters in the order they began to contend; the
//! engine's side (the local FIFO, who joins, when to leave) is in `lock/wait.rs`.

use std::time::Duration;

#[cfg(doc)]
use crate::node::{AcquireRequest, Node};
use crate::node::{NodeFuture, Owner, ResourceKeys};

/// A cross-process wait queue per resource: the capability a node hands out with
/// [`Node::wait_queue`]. A node that keeps one does, atomically with each operation:
///
/// - **acquire** with a [`waiter`](AcquireRequest::waiter) or without: grants only
///   a caller that finds the lock free *and* is the queue's head or finds the queue
///   empty, or that finds the lock reserved for its waiter (see release). A free
///   lock with another waiter at the head is reserved for that head instead (as a
///   release does), and the caller is refused. A refused caller with a waiter joins
///   the queue (or keeps its place), ordered by [`Waiter::ticket`] then
///   [`Waiter::id`], and the queue lives [`Waiter::queue_ttl`] more. A granted head
///   leaves the queue.
/// - **release**: after deleting its own key, takes waiters off the queue's head
///   until one is subscribed to its own channel, reserves the lock for it for
///   [`HANDOFF_TTL`] and wakes it alone; the lock is deleted when nobody listens.
///   Subscribers of the resource's own channel are woken only while registered
///   with [`listen_for_release`](WaitQueue::listen_for_release).
///   An empty `keys.channel` (a test kit's undo) only deletes the key.
/// - [`leave_queue`](WaitQueue::leave_queue): the waiter leaves the queue, and a lock
///   reserved for it is handed to the next waiter.
///
/// A node without a queue ignores the waiter and wakes every waiter of the resource on
/// `keys.channel` at each release; [`listen_for_release`](WaitQueue::listen_for_release)
/// is then needless: such a release always wakes the channel's subscribers.
pub trait WaitQueue: Send + Sync {
    /// [`release`](Node::release) of a lease won by `waiter`'s attempt: the waiter also
    /// leaves the queue, and a key reserved for it counts as the lease's. Its attempt
    /// may have reached this node before the previous holder's release did, which then
    /// handed it the key here too late; this release hands it on.
    fn release_as_waiter(
        &self,
        keys: &ResourceKeys,
        owner: &Owner,
        waiter: &Waiter,
    ) -> NodeFuture<bool>;

    /// Like [`release`](Node::release), but a key that still holds `owner` is reserved
    /// again for `waiter` instead of handed to the next waiter: the cleanup of a
    /// waiter's failed attempt, which keeps its turn. Its attempt may have reached this
    /// node before the previous holder's release reached the others; it is woken again
    /// when those releases hand it the lock.
    fn hand_back(&self, keys: &ResourceKeys, owner: &Owner, waiter: &Waiter) -> NodeFuture<bool>;

    /// Takes `waiter` out of the resource's wait queue, and hands a lock reserved for
    /// it to the next waiter. The locker calls it when a waiter that may be queued
    /// gives up: timeout, error or cancellation.
    fn leave_queue(&self, keys: &ResourceKeys, waiter: &Waiter) -> NodeFuture<()>;

    /// Registers, for `ttl`, a waiter that listens on the resource's own channel
    /// (`keys.channel`: a waiter for a set of resources) rather than in the wait queue,
    /// so that the resource's next release wakes it there. Called before each attempt
    /// of such a waiter once it is subscribed: the mark may be used up by a release
    /// that woke it.
    ///
    /// A node with a queue may wake nobody on the resource's channel otherwise, so that
    /// its release of a resource nobody waits for stays as cheap as the lock itself:
    /// the Redis nodes keep the mark in the queue, after every waiter, and the release
    /// that reaches it publishes on the channel.
    fn listen_for_release(&self, keys: &ResourceKeys, ttl: Duration) -> NodeFuture<()>;
}

/// How long a lock released to the next waiter stays reserved for it (see
/// [`WaitQueue`]): a woken waiter claims it within a round trip; one that is
/// frozen (its process stopped, its network cut) is skipped once this passed.
pub const HANDOFF_TTL: Duration = Duration::from_secs(1);

/// One process's place in a resource's cross-process wait queue (see
/// [`WaitQueue`]): only the head waiter of a process joins it; the callers
/// behind it wait in the process.
///
/// Every node gets the same `ticket` and `id`, so every node orders the queue the
/// same way: nodes that each favoured another head would split the votes forever.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter {
    /// The locker's waiter id: 16 hex digits, drawn once per locker.
    pub id: String,
    /// The place in the queue: the waiting caller's wall clock (µs since the Unix
    /// epoch) when it began to contend. Ties are broken by `id`.
    pub ticket: u64,
    /// How long the queue lives after this waiter's latest attempt (the locker
    /// attempts again well within it while it waits).
    pub queue_ttl: Duration,
}

impl Waiter {
    /// The waiter's own wake-up channel: the resource's channel, `:` and the id.
    pub fn channel(&self, keys: &ResourceKeys) -> String {
        format!("{}:{}", keys.channel, self.id)
    }

    /// The value a lock key holds while it is reserved for this waiter:
    /// `~<id>:<ticket>`. It can never equal an [`Owner`] (those are hex digits only).
    /// A waiter takes a key reserved for itself (whatever the ticket) or for a waiter
    /// that comes after it in the queue's order, on every node alike: a node that
    /// handed the key on while the waiter was served elsewhere cannot split the votes.
    pub fn reservation(&self) -> String {
        format!("~{}:{}", self.id, self.ticket)
    }

    /// Whether `value` (a lock key's) is a reservation for this waiter.
    pub fn is_reserved_in(&self, value: &str) -> bool {
        value
            .strip_prefix('~')
            .and_then(|rest| rest.strip_prefix(self.id.as_str()))
            .is_some_and(|rest| rest.starts_with(':'))
    }
}
