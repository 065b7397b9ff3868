//! [`MemoryNode`]: the lock store inside the process, the embedded default.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::error::NodeError;
use crate::node::RecordStore;
use crate::node::ResourceKeys;
use crate::node::{
    AcquireReply, AcquireRequest, ExtendEntry, Node, NodeFuture, Owner, ReleaseSignal, SharedModes,
};
use crate::node::{LockSets, WaitQueue};

mod modes;
mod queue;
mod records;
mod set;

use queue::{reservation, HandOff, Queue};

/// Sweep expired keys after this many writes, so unique resources (idempotency keys)
/// never accumulate.
const SWEEP_EVERY: u32 = 1024;

/// A lock node that lives in this process, with the semantics of [`RedisNode`]:
/// key expiry, owner checks, fence counters, the wait queue (see
/// [`Node::wait_queue`]) and release notifications.
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
        let fault = *lock(&self.shared.fault);
        let shared = self.shared.clone();
        let check = move || {
            if lock(&shared.fault).unavailable {
                return Err(NodeError::Connection("memory node is unavailable".into()));
            }
            op(&shared)
        };
        if fault.unavailable {
            return Box::pin(std::future::ready(Err(NodeError::Connection(
                "memory node is unavailable".into(),
            ))));
        }
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
    /// Wakes the subscribers of `channel` (the broadcast wake-up of a set's release).
    fn notify(&self, channel: &str) {
        self.wake(channel);
    }

    /// Wakes the subscribers of `channel`; whether anyone listened (as `PUBLISH`
    /// answers).
    fn wake(&self, channel: &str) -> bool {
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave the maps half-updated in a way
    // that matters (each update is one insert or remove), so poisoning is ignored.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Node for MemoryNode {
    fn name(&self) -> &str {
        "memory"
    }

    // As `acquire.lua`, step by step.
    fn acquire(&self, request: &AcquireRequest<'_>) -> NodeFuture<AcquireReply> {
        let keys = request.keys.clone();
        let owner = request.owner.as_str().to_owned();
        let (ttl, fence_ttl, fencing) = (request.ttl, request.fence_ttl, request.fencing);
        let (floor, seed_only_when_missing) = (request.fence_floor, request.seed_only_when_missing);
        let waiter = request.waiter.cloned();
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            if let Some(held) = store.refuse_writer(&keys, waiter.as_ref(), now) {
                return Ok(held);
            }
            let me = waiter.as_ref().map_or("", |w| w.id.as_str());
            let queue_key = keys.queue();
            let refuse = |store: &mut Store| {
                if let Some(waiter) = &waiter {
                    store.join(&queue_key, waiter, now);
                }
                let pttl = store.pttl(&keys.lock, now);
                Ok(AcquireReply::Held { pttl })
            };
            let mine = waiter.as_ref().map(|w| (w.ticket, w.id.clone()));
            match store.live(&keys.lock, now).map(|e| e.value.clone()) {
                None => {
                    // The key is free; the queue's head still comes first, unless we
                    // come before it.
                    match store.head(&queue_key, now) {
                        Some(head) if head.1 == me => store.remove_waiter(&queue_key, me, now),
                        Some(head) if mine.as_ref().is_none_or(|mine| *mine > head) => {
                            store.entries.insert(
                                keys.lock.clone(),
                                Entry {
                                    value: owner.clone(),
                                    expires: Some(now + ttl),
                                },
                            );
                            if shared.hand_off(&mut store, &keys, me, now) == HandOff::Reserved {
                                return refuse(&mut store);
                            }
                        }
                        _ => {}
                    }
                }
                Some(holder) if holder == owner => {}
                Some(holder) => {
                    // Reserved for us, or for a later waiter (which keeps its place).
                    let (Some(waiter), Some((id, ticket))) = (&waiter, reservation(&holder)) else {
                        return refuse(&mut store);
                    };
                    if id != waiter.id {
                        if (waiter.ticket, waiter.id.as_str()) > (ticket, id) {
                            return refuse(&mut store);
                        }
                        let until = now + waiter.queue_ttl;
                        store.enqueue(&queue_key, id, ticket, until, now);
                        store.remove_waiter(&queue_key, me, now);
                    }
                }
            }
            // Granted: the counter is checked before anything of ours stays written.
            let current = match store.live(&keys.fence, now) {
                Some(entry) if fencing => match entry.value.parse::<u64>() {
                    Ok(n) => Some(n),
                    Err(_) => {
                        if store
                            .live(&keys.lock, now)
                            .is_some_and(|e| e.value == owner)
                        {
                            store.entries.remove(&keys.lock);
                        }
                        return Err(NodeError::Server(
                            format!("ERR fence counter {} is not an integer", keys.fence).into(),
                        ));
                    }
                },
                _ => None,
            };
            store.entries.insert(
                keys.lock.clone(),
                Entry {
                    value: owner,
                    expires: Some(now + ttl),
                },
            );
            store.wrote(now);
            if !fencing {
                return Ok(AcquireReply::Acquired { fence: 0 });
            }
            let fence = match current {
                Some(current) if seed_only_when_missing => current.saturating_add(1),
                Some(current) => current.saturating_add(1).max(floor),
                None => floor,
            };
            store.entries.insert(
                keys.fence.clone(),
                Entry {
                    value: fence.to_string(),
                    expires: Some(now + fence_ttl),
                },
            );
            Ok(AcquireReply::Acquired { fence })
        })
    }

    fn extend(&self, keys: &ResourceKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        let lock_key = keys.lock.clone();
        let owner = owner.as_str().to_owned();
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            match store.live(&lock_key, now) {
                Some(entry) if entry.value == owner => {
                    entry.expires = Some(now + ttl);
                    Ok(true)
                }
                _ => Ok(false),
            }
        })
    }

    fn extend_many(
        &self,
        entries: &[ExtendEntry<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        let entries: Vec<(String, String)> = entries
            .iter()
            .map(|entry| (entry.keys.lock.clone(), entry.owner.as_str().to_owned()))
            .collect();
        // One lock for the whole batch, as one script on a Redis server.
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            Ok(entries
                .iter()
                .map(|(lock_key, owner)| match store.live(lock_key, now) {
                    Some(entry) if entry.value == *owner => {
                        entry.expires = Some(now + ttl);
                        Ok(true)
                    }
                    _ => Ok(false),
                })
                .collect())
        })
    }

    fn release(&self, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<bool> {
        let keys = keys.clone();
        let owner = owner.as_str().to_owned();
        self.run(move |shared| Ok(shared.release(&keys, &owner, None)))
    }

    fn raise_fence(&self, keys: &ResourceKeys, token: u64, fence_ttl: Duration) -> NodeFuture<()> {
        let fence_key = keys.fence.clone();
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
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
                store.wrote(now);
            }
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

    // The set calls (in `set.rs`): each atomic under the store's lock.
    fn sets(&self) -> Option<&dyn LockSets> {
        Some(self)
    }

    // The queue calls are in `queue.rs`.
    fn wait_queue(&self) -> Option<&dyn WaitQueue> {
        Some(self)
    }

    fn records(&self) -> Option<&dyn RecordStore> {
        Some(self)
    }

    fn shared_modes(&self) -> Option<&dyn SharedModes> {
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
