//! [`MemoryNode`]: the lock store inside the process, the embedded default.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::error::NodeError;
use crate::node::{
    Acquire, Capabilities, Hold, Node, NodeFuture, PerKey, RecordStore, Release, ReleaseSignal,
    ResourceKeys, Vote, Waiter,
};

mod calls;
mod modes;
mod queue;
mod records;

use calls::How;
use queue::Queue;

/// Sweep expired keys after this many writes, so unique resources (idempotency keys)
/// never accumulate.
const SWEEP_EVERY: u32 = 1024;

/// A lock node that lives in this process, with the semantics of [`RedisNode`]:
/// key expiry, owner checks, fence counters, the wait queue (see [`Waiter`]), shared
/// and counted holders, and release notifications.
///
/// It is the embedded default: the examples run on it without Redis, and it serves
/// single-process deployments and users' own tests. It is **not** distributed: two
/// processes never see each other's `MemoryNode`.
///
/// Clones share the same store. For tests of quorum logic a node can be made to fail
/// ([`set_available`](MemoryNode::set_available)) or to answer late
/// ([`set_delay`](MemoryNode::set_delay)).
///
/// [`RedisNode`]: crate::RedisNode
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redlock::{MemoryNode, Redlock, LockOptions};
///
/// let locker = Redlock::new([MemoryNode::new()], LockOptions::default())?;
/// let lease = locker.try_acquire("order:42").await?;
/// assert!(locker.try_acquire("order:42").await.is_err());
/// lease.release().await;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Default)]
pub struct MemoryNode {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    store: Mutex<Store>,
    channels: Mutex<HashMap<String, watch::Sender<u64>>>,
    fault: Mutex<Fault>,
    order: Order,
}

/// Delayed operations apply in the order they were issued, as commands sent over one
/// connection do: ticket `n` waits until ticket `n - 1` has applied (or was dropped).
struct Order {
    issued: AtomicU64,
    applied: watch::Sender<u64>,
}

impl Default for Order {
    fn default() -> Self {
        Order {
            issued: AtomicU64::new(0),
            applied: watch::channel(0).0,
        }
    }
}

struct Ticket {
    shared: Arc<Shared>,
    number: u64,
}

impl Ticket {
    fn issue(shared: &Arc<Shared>) -> Self {
        Ticket {
            shared: shared.clone(),
            number: shared.order.issued.fetch_add(1, Ordering::AcqRel) + 1,
        }
    }

    async fn turn(&self) {
        let mut applied = self.shared.order.applied.subscribe();
        // The sender lives as long as `self.shared`: this cannot fail.
        let _ = applied.wait_for(|&done| done + 1 >= self.number).await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let number = self.number;
        self.shared
            .order
            .applied
            .send_modify(|done| *done = (*done).max(number));
    }
}

#[derive(Default)]
struct Store {
    entries: HashMap<String, Entry>,
    /// The wait queues, by queue key.
    queues: HashMap<String, Queue>,
    /// The shared holders, by lock key (see `modes.rs`).
    holders: HashMap<String, modes::Holders>,
    writes: u32,
}

struct Entry {
    value: String,
    expires: Option<Instant>,
}

#[derive(Default, Clone, Copy)]
struct Fault {
    unavailable: bool,
    delay: Duration,
}

impl MemoryNode {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// While `false`, every operation fails with a connection error, as a node that is down.
    pub fn set_available(&self, available: bool) {
        lock(&self.shared.fault).unavailable = !available;
    }

    /// Delays every answer by `delay`, as a slow network. The operation itself happens
    /// when the delay has passed, whether or not the caller still waits for the answer
    /// (as a command already sent to a slow server does), and delayed operations apply
    /// in the order they were issued.
    pub fn set_delay(&self, delay: Duration) {
        lock(&self.shared.fault).delay = delay;
    }

    /// The value of a live key.
    pub fn get(&self, key: &str) -> Option<String> {
        let mut store = lock(&self.shared.store);
        store.live(key, Instant::now()).map(|e| e.value.clone())
    }

    /// The remaining ttl of a live key (`None` when missing or without ttl).
    pub fn pttl(&self, key: &str) -> Option<Duration> {
        let now = Instant::now();
        let mut store = lock(&self.shared.store);
        store
            .live(key, now)
            .and_then(|e| e.expires)
            .map(|at| at.saturating_duration_since(now))
    }

    /// Sets a key without ttl, overwriting it (to simulate another writer in tests).
    pub fn set(&self, key: &str, value: &str) {
        let mut store = lock(&self.shared.store);
        store.entries.insert(
            key.to_owned(),
            Entry {
                value: value.to_owned(),
                expires: None,
            },
        );
    }

    /// Deletes a key (to simulate data loss in tests).
    pub fn delete(&self, key: &str) {
        lock(&self.shared.store).entries.remove(key);
    }

    /// Deletes every key, as a node restarted without persistence.
    pub fn clear(&self) {
        let mut store = lock(&self.shared.store);
        store.entries.clear();
        store.holders.clear();
    }

    /// Number of live keys.
    pub fn len(&self) -> usize {
        let now = Instant::now();
        let store = lock(&self.shared.store);
        store
            .entries
            .values()
            .filter(|e| e.expires.is_none_or(|at| at > now))
            .count()
    }

    /// `true` when no live key is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of wake-up channels kept: one per channel someone listens on (a waiter's
    /// own, a resource's); a channel goes with its last listener.
    pub fn channels(&self) -> usize {
        lock(&self.shared.channels).len()
    }

    fn run<T, F>(&self, op: F) -> NodeFuture<T>
    where
        T: Send + 'static,
        F: FnOnce(&Shared) -> Result<T, NodeError> + Send + 'static,
    {
        let down = || Err(NodeError::Connection("memory node is unavailable".into()));
        let fault = *lock(&self.shared.fault);
        if fault.unavailable {
            return Box::pin(std::future::ready(down()));
        }
        let shared = self.shared.clone();
        let check = move || {
            let unavailable = lock(&shared.fault).unavailable;
            if unavailable {
                down()
            } else {
                op(&shared)
            }
        };
        if fault.delay.is_zero() {
            return Box::pin(std::future::ready(check()));
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Box::pin(async move {
                tokio::time::sleep(fault.delay).await;
                check()
            });
        };
        // Run the operation on its own task, so that it lands even when the caller
        // gives up on the answer (a timed-out or decided quorum round): the locker
        // must clean up after such late writes, and tests must be able to see them.
        let ticket = Ticket::issue(&self.shared);
        let (tx, rx) = oneshot::channel();
        runtime.spawn(async move {
            tokio::time::sleep(fault.delay).await;
            ticket.turn().await;
            let _ = tx.send(check());
        });
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                Err(NodeError::Connection(
                    "memory node stopped with the runtime".into(),
                ))
            })
        })
    }
}

impl Shared {
    /// Wakes the subscribers of `channel`; whether anyone listened (as `PUBLISH`
    /// answers).
    pub(super) fn wake(&self, channel: &str) -> bool {
        let mut channels = lock(&self.channels);
        match channels.get(channel) {
            Some(tx) if tx.receiver_count() > 0 => {
                tx.send_modify(|n| *n = n.wrapping_add(1));
                true
            }
            Some(_) => {
                channels.remove(channel);
                false
            }
            None => false,
        }
    }
}

impl Store {
    fn live(&mut self, key: &str, now: Instant) -> Option<&mut Entry> {
        let expired = match self.entries.get(key) {
            None => return None,
            Some(e) => e.expires.is_some_and(|at| at <= now),
        };
        if expired {
            self.entries.remove(key);
            return None;
        }
        self.entries.get_mut(key)
    }

    fn wrote(&mut self, now: Instant) {
        self.writes += 1;
        if self.writes >= SWEEP_EVERY {
            self.writes = 0;
            self.entries
                .retain(|_, e| e.expires.is_none_or(|at| at > now));
            self.queues.retain(|_, q| q.expires > now);
            self.sweep_holders(now);
        }
    }
}

// A panic while holding these locks cannot leave the maps half-updated in a way that
// matters (each update is one insert or remove).
use crate::lock_unpoisoned as lock;

impl Node for MemoryNode {
    fn name(&self) -> &str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }

    fn acquire(&self, request: &Acquire<'_>) -> NodeFuture<Vote> {
        let ask = calls::Ask {
            keys: PerKey::map(request.keys, Clone::clone),
            owner: request.owner.clone(),
            mode: request.mode,
            ttl: request.ttl,
            fencing: request.fencing,
            fence_ttl: request.fence_ttl,
            floor: request.fence_floor,
            seed_only_when_missing: request.seed_only_when_missing,
            waiter: request.waiter.cloned(),
        };
        self.run(move |shared| shared.acquire(&ask))
    }

    fn extend(
        &self,
        holds: &[Hold<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        let holds: Vec<_> = holds
            .iter()
            .map(|hold| {
                let locks = PerKey::map(hold.keys, |keys| keys.lock.clone());
                (locks, hold.owner.clone(), !hold.mode.is_exclusive())
            })
            .collect();
        // One lock for the whole batch, as one script on a Redis server.
        self.run(move |shared| Ok(shared.extend(&holds, ttl)))
    }

    fn release(&self, hold: &Hold<'_>, how: Release<'_>) -> NodeFuture<bool> {
        let keys = PerKey::map(hold.keys, Clone::clone);
        let owner = hold.owner.clone();
        let shared_mode = !hold.mode.is_exclusive();
        let how = match how {
            Release::Wake => How::Wake,
            Release::Quiet => How::Quiet,
            Release::AsWaiter(waiter) => How::AsWaiter(waiter.clone()),
            Release::HandBack(waiter) => How::HandBack(waiter.clone()),
        };
        self.run(move |shared| {
            Ok(match &*keys {
                [keys] if shared_mode => {
                    shared.release_shared(keys, owner.as_str(), matches!(how, How::Quiet))
                }
                keys => shared.release(keys, owner.as_str(), &how),
            })
        })
    }

    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()> {
        let fences: Vec<(String, u64)> = keys
            .iter()
            .zip(tokens)
            .map(|(k, &token)| (k.fence.clone(), token))
            .collect();
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            for (fence_key, token) in fences {
                let current = store
                    .live(&fence_key, now)
                    .and_then(|e| e.value.parse::<u64>().ok())
                    .unwrap_or(0);
                if current < token {
                    store.entries.insert(
                        fence_key,
                        Entry {
                            value: token.to_string(),
                            expires: Some(now + fence_ttl),
                        },
                    );
                }
            }
            store.wrote(now);
            Ok(())
        })
    }

    fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        let channel = keys.channel.clone();
        let node = Arc::downgrade(&self.shared);
        self.run(move |shared| {
            let mut channels = lock(&shared.channels);
            let rx = channels
                .entry(channel.clone())
                .or_insert_with(|| watch::channel(0).0)
                .subscribe();
            Ok(ReleaseSignal::new(
                rx,
                Arc::new(Subscription { node, channel }),
            ))
        })
    }

    fn leave_queue(&self, keys: &ResourceKeys, waiter: &Waiter) -> NodeFuture<()> {
        let keys = keys.clone();
        let waiter = How::AsWaiter(waiter.clone());
        // A release by nobody's owner: only a reservation for the waiter counts as ours.
        self.run(move |shared| {
            shared.release(std::slice::from_ref(&keys), "", &waiter);
            Ok(())
        })
    }

    // A release here wakes the resource's channel whenever no queued waiter takes the
    // lock: there is no mark to leave (the default `listen_for_release`).

    fn records(&self) -> Option<&dyn RecordStore> {
        Some(self)
    }
}

/// One subscription's end: dropped with the last clone of its `ReleaseSignal` (after
/// its receiver, which the signal declares first), it drops the channel once no
/// receiver is left, so that the channels stay as many as the listeners (one per
/// waiter: each listens on its own).
struct Subscription {
    node: std::sync::Weak<Shared>,
    channel: String,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let Some(shared) = self.node.upgrade() else {
            return;
        };
        let mut channels = lock(&shared.channels);
        if channels
            .get(&self.channel)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            channels.remove(&self.channel);
        }
    }
}

impl std::fmt::Debug for MemoryNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryNode")
            .field("keys", &lock(&self.shared.store).entries.len())
            .finish()
    }
}
