//! The cross-process wait queue a node may keep ([`Capabilities::wait_queue`]): with it
//! a majority of nodes serve waiters in the order they began to contend; the engine's
//! side (the local FIFO, who joins, when to leave) is in `lock/wait/`. Its contract
//! is on [`Waiter`].

use std::time::Duration;

use crate::node::ResourceKeys;
#[cfg(doc)]
use crate::node::{Acquire, Capabilities, Node, Owner, Release};

/// How long a lock released to the next waiter stays reserved for it (see
/// [`Waiter`]): a woken waiter claims it within a round trip; one that is
/// frozen (its process stopped, its network cut) is skipped once this passed.
pub const HANDOFF_TTL: Duration = Duration::from_secs(1);

/// One process's place in a resource's cross-process wait queue (see
/// below): only the head waiter of a process joins it; the callers
/// behind it wait in the process.
///
/// Every node gets the same `ticket` and `id`, so every node orders the queue the
/// same way: nodes that each favoured another head would split the votes forever.
///
/// # What a node that keeps a queue does
///
/// A node whose [`Capabilities::wait_queue`] is set does, atomically with each operation:
///
/// - **acquire** with a [`waiter`](Acquire::waiter) or without: grants only
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
///   with [`listen_for_release`](Node::listen_for_release).
///   [`Release::Quiet`] only deletes the key; [`Release::AsWaiter`] and
///   [`Release::HandBack`] are a waiter's own releases.
/// - [`leave_queue`](Node::leave_queue): the waiter leaves the queue, and a lock
///   reserved for it is handed to the next waiter.
///
/// A node without a queue ignores the waiter and wakes every waiter of the resource on
/// `keys.channel` at each release.
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
