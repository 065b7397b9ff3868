//! Waiting for a held resource without polling.
//!
//! Inside a process, callers that want the same resource queue FIFO on a one-permit
//! semaphore: only the head of the queue (or the holder) talks to the nodes, and a
//! release of this process hands the resource to the next local waiter at once.
//!
//! Across processes, the head waiter subscribes to the resource's release channel on
//! every node (one shared pub/sub connection per node) and retries as soon as a
//! release is published. A fallback retry with exponential backoff and full jitter,
//! capped by the holder's remaining ttl, covers lost messages and crashed holders.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use futures_util::future::select_all;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{OnceCell, Semaphore};
use tokio::time::Instant;

use crate::lock::lease::LeaseInner;
use crate::lock::metrics;
use crate::lock::round::Nodes;
use crate::node::ReleaseSignal;
use crate::node::{LockKeys, Resource};

/// The waiters and the holder of one resource inside this process.
pub(crate) struct LocalQueue {
    /// One permit: held by the local lease, or by the head waiter while it contends.
    pub(crate) permit: Arc<Semaphore>,
    /// Callers waiting for the permit.
    waiting: AtomicUsize,
    /// The local lease holding the resource, if any.
    holder: Mutex<Weak<LeaseInner>>,
    /// When another process's hold ends, as last reported to the head waiter: what
    /// the callers queued behind the head wait for.
    remote_until: Mutex<Option<Instant>>,
    /// Release subscriptions on the nodes, made by the first waiter that needed them
    /// and kept while the queue lives.
    signals: OnceCell<Vec<ReleaseSignal>>,
}

/// All local queues of a locker, one per resource in use.
#[derive(Default)]
pub(crate) struct Queues {
    /// Each queue with the number of [`QueueRef`]s to it, counted under the lock (the
    /// `Arc`'s own count drops only after a `QueueRef`'s drop has let go of the lock, so
    /// two refs dropping at once could each see the other and leave the entry behind).
    map: Mutex<HashMap<Resource, (Arc<LocalQueue>, usize)>>,
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
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let (queue, refs) = map.entry(resource.clone()).or_insert_with(|| {
            let queue = Arc::new(LocalQueue {
                permit: Arc::new(Semaphore::new(1)),
                waiting: AtomicUsize::new(0),
                holder: Mutex::new(Weak::new()),
                remote_until: Mutex::new(None),
                signals: OnceCell::new(),
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

    /// Number of resources with a local holder or waiter.
    pub(crate) fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for QueueRef {
    fn drop(&mut self) {
        let mut map = self.queues.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, refs)) = map.get_mut(&self.resource) {
            *refs -= 1;
            if *refs == 0 {
                map.remove(&self.resource);
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

/// Counts one waiting caller for as long as it lives.
pub(crate) struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        metrics::waiters(-1.0);
    }
}

impl LocalQueue {
    /// Joins the waiters unless `limit` already wait.
    pub(crate) fn enter(&self, limit: usize) -> Option<Waiting<'_>> {
        let mut current = self.waiting.load(Ordering::Acquire);
        loop {
            if current >= limit {
                return None;
            }
            match self.waiting.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    metrics::waiters(1.0);
                    return Some(Waiting(&self.waiting));
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// Remaining validity of the local holder if a lease of this process holds it,
    /// else the remaining ttl of another process's hold as last reported to the head
    /// waiter, if it has not run out.
    pub(crate) fn holder_ttl(&self) -> Option<std::time::Duration> {
        let holder = self
            .holder
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .upgrade();
        if let Some(status) = holder.map(|h| h.status()) {
            if !status.released && status.lost.is_none() {
                return Some(status.valid_until.saturating_duration_since(Instant::now()));
            }
        }
        let until = (*self.remote_until.lock().unwrap_or_else(|p| p.into_inner()))?;
        let left = until.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    pub(crate) fn set_holder(&self, lease: &Arc<LeaseInner>) {
        *self.holder.lock().unwrap_or_else(|p| p.into_inner()) = Arc::downgrade(lease);
        *self.remote_until.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Records the holder's remaining ttl that the nodes reported to the head waiter.
    pub(crate) fn note_remote_holder(&self, ttl: Option<std::time::Duration>) {
        *self.remote_until.lock().unwrap_or_else(|p| p.into_inner()) =
            ttl.map(|ttl| Instant::now() + ttl);
    }

    /// The release subscriptions on every node that answered, made on first use.
    pub(crate) async fn signals(&self, nodes: &Nodes, keys: &LockKeys) -> Vec<ReleaseSignal> {
        self.signals
            .get_or_init(|| nodes.subscribe_all(keys))
            .await
            .clone()
    }
}

impl Nodes {
    /// Subscribes to the resource's release channel on every node, concurrently;
    /// nodes that fail or time out are left out (the fallback retry covers them).
    pub(crate) async fn subscribe_all(&self, keys: &LockKeys) -> Vec<ReleaseSignal> {
        let timeout = self.timeout();
        let calls: FuturesUnordered<_> = self
            .each()
            .map(|node| tokio::time::timeout(timeout, node.subscribe(keys)))
            .collect();
        calls
            .filter_map(|answer| async move { answer.ok().and_then(Result::ok) })
            .collect()
            .await
    }
}

/// Resolves at the next release notification on any of the signals; never when empty.
pub(crate) async fn next_release(signals: &mut [ReleaseSignal]) {
    if signals.is_empty() {
        return std::future::pending().await;
    }
    select_all(signals.iter_mut().map(|s| Box::pin(s.changed()))).await;
}

#[cfg(feature = "test-util")]
impl Queues {
    /// The leases of this process that hold a resource now (for the test kit).
    pub(crate) fn holders(&self) -> Vec<Arc<LeaseInner>> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.values()
            .filter_map(|(queue, _)| {
                queue
                    .holder
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .upgrade()
            })
            .filter(|lease| {
                let status = lease.status();
                status.lost.is_none() && !status.released
            })
            .collect()
    }
}
