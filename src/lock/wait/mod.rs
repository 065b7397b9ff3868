//! Waiting for a held resource without polling, and in arrival order across processes
//! (the guide: [Waiting across processes](crate::guide::stores#waiting-across-processes)).
//!
//! Inside a process, callers that want the same resource queue FIFO on a one-permit
//! semaphore: only the head of the queue (or the holder) talks to the nodes, and a
//! release of this process hands the resource to the next local waiter at once.
//!
//! Across processes, the head waiter joins the resource's wait queue on every node that
//! keeps one ([`Capabilities::wait_queue`](crate::node::Capabilities::wait_queue)), a
//! sorted set of waiter ids (one per locker) scored by the **ticket**: the wall clock
//! (µs) when this process's head began to contend. Ticket and id travel with every
//! attempt to every node, so every node orders the queue the same way (nodes that each
//! favoured another head would split the votes forever); clock skew only shifts places.
//!
//! - A refused attempt adds the waiter, or keeps its place, and keeps the queue alive
//!   for [`QUEUE_TTL`] more; a waiter attempts again at least every quarter of it, so a
//!   queue whose waiters all died expires by itself.
//! - A waiter in the queues does not retry on the retry policy's short backoff (a
//!   release wakes it; an earlier attempt would only be refused), but when the key it
//!   was refused by runs out: a crashed holder's, or a frozen waiter's reservation.
//! - A waiter subscribes to its own channel *before* it joins, so a release never hands
//!   it the lock unheard. Its subscriptions outlive the wait by [`LINGER`]: a process
//!   that waits again soon joins with its first attempt and costs no `SUBSCRIBE`.
//! - Sets and shared holders keep the broadcast wake-up, on each member's own channel;
//!   on the Redis nodes such a waiter first marks the member's queue
//!   ([`Node::listen_for_release`](crate::node::Node::listen_for_release)), since a
//!   release publishes there only when its hand-off reaches the mark: the release of a
//!   resource nobody waits for publishes nothing.
//!
//! The queue decides only who may *try*: a grant is still one node's vote, so mutual
//! exclusion and the token order never depend on it. Where most nodes keep no queue,
//! the retry policy's backoff covers lost messages and crashed holders.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::future::select_all;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::lock::{lease::LeaseInner, metrics, round::Nodes};
use crate::node::{ReleaseSignal, Resource, ResourceKeys, Waiter};

/// How long a resource's wait queue lives after a waiter's latest attempt.
pub(crate) const QUEUE_TTL: Duration = Duration::from_secs(10);
/// How long a waiter's subscriptions are kept after its wait ended, for its next wait.
pub(crate) const LINGER: Duration = Duration::from_secs(2);
/// Most resources whose subscriptions linger at once.
const MAX_PARKED: usize = 1024;

/// The waiters and the holder of one resource inside this process.
pub(crate) struct LocalQueue {
    /// One permit, taken as a [`Turn`]: by the local lease, or by the head waiter while
    /// it contends.
    permit: Semaphore,
    /// Callers waiting for the permit.
    waiting: AtomicUsize,
    /// The local lease holding the resource, if any.
    holder: Mutex<Weak<LeaseInner>>,
    /// When another process's hold ends, as last reported to the head waiter: what
    /// the callers queued behind the head wait for.
    remote_until: Mutex<Option<Instant>>,
    /// Subscriptions to this locker's wake-up channels on the nodes, made by the first
    /// waiter that needed them (or taken over from a recent wait) and kept while the
    /// queue lives, then for [`LINGER`].
    signals: Mutex<Option<Vec<ReleaseSignal>>>,
}

/// All local queues of a locker, one per resource in use.
#[derive(Default)]
pub(crate) struct Queues {
    /// Each queue with the number of [`QueueRef`]s to it, counted under the lock (the
    /// `Arc`'s own count drops only after a `QueueRef`'s drop has let go of the lock, so
    /// two refs dropping at once could each see the other and leave the entry behind).
    map: Mutex<HashMap<Resource, (Arc<LocalQueue>, usize)>>,
    /// Subscriptions of queues that ended lately, with when they ended.
    parked: Mutex<HashMap<Resource, (Vec<ReleaseSignal>, Instant)>>,
    /// Told when a queue ends (its holder released, its waiters gone): a drain waits on it.
    pub(crate) changed: tokio::sync::Notify,
    /// Numbers the queues of holders that share their resource ([`Queues::own`]).
    own: AtomicU64,
}

/// A counted reference to a resource's local queue. The queue is removed from the map
/// when the last reference drops.
pub(crate) struct QueueRef {
    queues: Arc<Queues>,
    resource: Resource,
    queue: Arc<LocalQueue>,
}

impl Queues {
    pub(crate) fn get(self: &Arc<Self>, resource: &Resource) -> QueueRef {
        let mut map = crate::lock_unpoisoned(&self.map);
        let (queue, refs) = map.entry(resource.clone()).or_insert_with(|| {
            let queue = Arc::new(LocalQueue {
                permit: Semaphore::new(1),
                waiting: AtomicUsize::new(0),
                holder: Mutex::new(Weak::new()),
                remote_until: Mutex::new(None),
                signals: Mutex::new(self.unpark(resource)),
            });
            (queue, 0)
        });
        *refs += 1;
        let queue = queue.clone();
        QueueRef {
            queues: self.clone(),
            resource: resource.clone(),
            queue,
        }
    }

    /// A queue of its own for a caller that shares its resource (a reader, a permit):
    /// it never waits for this process's other holders of the resource, whose
    /// exclusion is the nodes' to decide. Kept in the map under a name of its own, so
    /// that a drain sees its lease as it sees the others.
    pub(crate) fn own(self: &Arc<Self>, resource: &Resource) -> QueueRef {
        let id = self.own.fetch_add(1, Ordering::Relaxed);
        self.get(&resource.join(format!("\u{1}shared-{id}")))
    }

    /// Number of resources with a local holder or waiter.
    pub(crate) fn len(&self) -> usize {
        crate::lock_unpoisoned(&self.map).len()
    }

    /// The leases of this process that hold a resource now (for a drain and the test
    /// kit).
    pub(crate) fn holders(&self) -> Vec<Arc<LeaseInner>> {
        let map = crate::lock_unpoisoned(&self.map);
        map.values()
            .filter_map(|(queue, _)| crate::lock_unpoisoned(&queue.holder).upgrade())
            .filter(|lease| lease.status().live())
            .collect()
    }

    /// The subscriptions a recent wait for `resource` left, if they are recent enough.
    fn unpark(&self, resource: &Resource) -> Option<Vec<ReleaseSignal>> {
        let mut parked = crate::lock_unpoisoned(&self.parked);
        // Nothing parked (no recent wait): spares every new queue a hash of the name.
        if parked.is_empty() {
            return None;
        }
        let (signals, at) = parked.remove(resource)?;
        (at.elapsed() < LINGER).then_some(signals)
    }

    /// Keeps the subscriptions of a wait that ended for [`LINGER`]; a sweeper task runs
    /// while any are kept, so an idle locker unsubscribes too.
    fn park(self: &Arc<Self>, resource: Resource, signals: Vec<ReleaseSignal>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut parked = crate::lock_unpoisoned(&self.parked);
        let now = Instant::now();
        parked.retain(|_, (_, at)| now.duration_since(*at) < LINGER);
        if parked.len() >= MAX_PARKED {
            return;
        }
        let first = parked.is_empty();
        parked.insert(resource, (signals, now));
        if first {
            let queues = Arc::downgrade(self);
            runtime.spawn(async move {
                loop {
                    tokio::time::sleep(LINGER).await;
                    let Some(queues) = queues.upgrade() else {
                        return;
                    };
                    let mut parked = crate::lock_unpoisoned(&queues.parked);
                    let now = Instant::now();
                    parked.retain(|_, (_, at)| now.duration_since(*at) < LINGER);
                    if parked.is_empty() {
                        return;
                    }
                }
            });
        }
    }
}

impl Drop for QueueRef {
    fn drop(&mut self) {
        let ended = {
            let mut map = crate::lock_unpoisoned(&self.queues.map);
            // One lookup (a hash of the name) rather than a lookup and a removal: this
            // runs on every release.
            match map.entry(self.resource.clone()) {
                Entry::Occupied(mut entry) => {
                    entry.get_mut().1 -= 1;
                    if entry.get().1 == 0 {
                        entry.remove();
                        true
                    } else {
                        false
                    }
                }
                Entry::Vacant(_) => false,
            }
        };
        if ended {
            self.queues.changed.notify_waiters();
            let signals = crate::lock_unpoisoned(&self.queue.signals).take();
            if let Some(signals) = signals {
                self.queues.park(self.resource.clone(), signals);
            }
        }
    }
}

impl std::ops::Deref for QueueRef {
    type Target = LocalQueue;

    fn deref(&self) -> &LocalQueue {
        &self.queue
    }
}

/// This process's turn at a resource: its local queue's one permit, held by the lease
/// (or by the head waiter while it contends) and handed back when dropped. It keeps the
/// queue rather than an `Arc` of the semaphore, as Tokio's owned permit would: the
/// semaphore sits inside the queue, one allocation fewer per resource taken.
pub(crate) struct Turn(Arc<LocalQueue>);

impl Drop for Turn {
    fn drop(&mut self) {
        self.0.permit.add_permits(1);
    }
}

impl QueueRef {
    /// The resource's turn, if nobody of this process holds or contends for it.
    pub(crate) fn try_turn(&self) -> Option<Turn> {
        self.queue.permit.try_acquire().ok()?.forget();
        Some(Turn(self.queue.clone()))
    }

    /// The resource's turn, once the callers ahead have had theirs. Cancellation-safe:
    /// a caller dropped while waiting takes no permit.
    pub(crate) async fn turn(&self) -> Option<Turn> {
        // Only a closed semaphore fails, and this one is never closed.
        self.queue.permit.acquire().await.ok()?.forget();
        Some(Turn(self.queue.clone()))
    }

    /// Joins the waiters unless `limit` already wait.
    pub(crate) fn enter(&self, limit: usize) -> Option<Waiting> {
        let waiting = &self.queue.waiting;
        let enter = |current: usize| (current < limit).then_some(current + 1);
        waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, enter)
            .ok()?;
        metrics::waiters(1.0);
        Some(Waiting(self.queue.clone()))
    }
}

/// Counts one waiting caller for as long as it lives. Keeps the queue rather than a
/// borrow of its counter, so that a set's waiter can keep one per member.
pub(crate) struct Waiting(Arc<LocalQueue>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
        metrics::waiters(-1.0);
    }
}

impl LocalQueue {
    /// Remaining validity of the local holder if a lease of this process holds it,
    /// else the remaining ttl of another process's hold as last reported to the head
    /// waiter, if it has not run out.
    pub(crate) fn holder_ttl(&self) -> Option<std::time::Duration> {
        let holder = crate::lock_unpoisoned(&self.holder).upgrade();
        if let Some(status) = holder.map(|h| h.status())
            && status.live()
        {
            return Some(status.valid_until.saturating_duration_since(Instant::now()));
        }
        let until = (*crate::lock_unpoisoned(&self.remote_until))?;
        let left = until.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// Whether this process's holder is being released and nobody of this process
    /// waits for the resource: the turn is about to be free.
    pub(crate) fn releasing(&self) -> bool {
        if self.waiting.load(Ordering::Acquire) > 0 {
            return false;
        }
        let holder = crate::lock_unpoisoned(&self.holder).upgrade();
        holder.is_some_and(|holder| holder.status().released)
    }

    pub(crate) fn set_holder(&self, lease: &Arc<LeaseInner>) {
        *crate::lock_unpoisoned(&self.holder) = Arc::downgrade(lease);
        *crate::lock_unpoisoned(&self.remote_until) = None;
    }

    /// Records the holder's remaining ttl that the nodes reported to the head waiter.
    pub(crate) fn note_remote_holder(&self, ttl: Option<std::time::Duration>) {
        *crate::lock_unpoisoned(&self.remote_until) =
            ttl.and_then(|ttl| Instant::now().checked_add(ttl));
    }

    /// The wake-up subscriptions, if they are already made: a waiter holding them
    /// before its attempt cannot miss a wake-up published after it.
    pub(crate) fn live_signals(&self) -> Option<Vec<ReleaseSignal>> {
        crate::lock_unpoisoned(&self.signals).clone()
    }

    /// Drops the wake-up subscriptions (a waiter that gave up).
    pub(crate) fn forget_signals(&self) {
        crate::lock_unpoisoned(&self.signals).take();
    }

    /// The wake-up subscriptions on every node that answered, made on first use (only
    /// the head of the local queue calls it).
    pub(crate) async fn signals(
        &self,
        nodes: &Nodes,
        keys: &ResourceKeys,
        waiter: &Waiter,
    ) -> Vec<ReleaseSignal> {
        if let Some(signals) = self.live_signals() {
            return signals;
        }
        let signals = nodes.subscribe_all(keys, waiter).await;
        if !signals.is_empty() {
            *crate::lock_unpoisoned(&self.signals) = Some(signals.clone());
        }
        signals
    }
}

/// Resolves at the next release notification on any of the signals; never when empty.
pub(crate) async fn next_release(signals: &mut [ReleaseSignal]) {
    if signals.is_empty() {
        return std::future::pending().await;
    }
    select_all(signals.iter_mut().map(|s| Box::pin(s.changed()))).await;
}

mod nodes;
#[cfg(test)]
mod tests;
