//! Shared and counted holders of a [`MemoryNode`] (see [`SharedModes`]): the Redis
//! scripts `shared_acquire.lua`, `shared_extend.lua` and `shared_release.lua` in Rust,
//! each atomic under the store's lock.
//!
//! A resource's shared holders live beside the store's keys, by lock key: owner →
//! expiry, as the sorted set a Redis node keeps at the lock key itself. A lock key
//! never has both an entry and live holders: each side refuses while the other is live.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::queue::HandOff;
use super::{lock, Entry, MemoryNode, Store};
use crate::error::NodeError;
use crate::node::{
    AcquireReply, ExtendEntry, NodeFuture, Owner, ResourceKeys, SharedMode, SharedModes,
    SharedRequest, Waiter,
};

/// One resource's shared holders: the mode they all hold it in, owner value → expiry.
pub(super) struct Holders {
    mode: SharedMode,
    expiry: HashMap<String, Instant>,
}

impl Store {
    /// The resource's live holders, the expired ones pruned; `None` when none is live.
    fn live_holders(&mut self, lock: &str, now: Instant) -> Option<&mut Holders> {
        let holders = self.holders.get_mut(lock)?;
        holders.expiry.retain(|_, at| *at > now);
        if holders.expiry.is_empty() {
            self.holders.remove(lock);
            return None;
        }
        self.holders.get_mut(lock)
    }

    /// When shared holders are live: how long the last of them lasts (`Some`), for an
    /// exclusive caller, which is refused.
    pub(super) fn shared_pttl(&mut self, lock: &str, now: Instant) -> Option<Option<Duration>> {
        let last = self.live_holders(lock, now)?.expiry.values().max().copied();
        Some(last.map(|at| at.saturating_duration_since(now)))
    }

    /// An exclusive acquire that finds shared holders is refused; a waiting one
    /// leaves its intent for the waiter's queue ttl and joins the queue, as behind
    /// another writer (`acquire.lua`'s sorted-set case).
    pub(super) fn refuse_writer(
        &mut self,
        keys: &ResourceKeys,
        waiter: Option<&Waiter>,
        now: Instant,
    ) -> Option<AcquireReply> {
        let pttl = self.shared_pttl(&keys.lock, now)?;
        if let Some(waiter) = waiter {
            self.entries.insert(
                keys.writer(),
                Entry {
                    value: waiter.id.clone(),
                    expires: Some(now + waiter.queue_ttl),
                },
            );
            self.join(&keys.queue(), waiter, now);
        }
        Some(AcquireReply::Held { pttl })
    }

    /// Drops the resources whose holders all expired (the periodic sweep).
    pub(super) fn sweep_holders(&mut self, now: Instant) {
        self.holders.retain(|_, holders| {
            holders.expiry.retain(|_, at| *at > now);
            !holders.expiry.is_empty()
        });
    }
}

impl SharedModes for MemoryNode {
    fn acquire_shared(&self, request: &SharedRequest<'_>) -> NodeFuture<AcquireReply> {
        let keys = request.keys.clone();
        let owner = request.owner.as_str().to_owned();
        let (mode, ttl, fence_ttl) = (request.mode, request.ttl, request.fence_ttl);
        let (fencing, floor) = (request.fencing, request.fence_floor);
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            // A writer holds the key, or it is reserved for a waiting writer.
            if store.live(&keys.lock, now).is_some() {
                return Ok(AcquireReply::Held {
                    pttl: store.pttl(&keys.lock, now),
                });
            }
            // Writer preference: a live intent, and a writer still queued.
            let writer = keys.writer();
            if store.live(&writer, now).is_some() && store.head(&keys.queue(), now).is_some() {
                return Ok(AcquireReply::Held {
                    pttl: store.pttl(&writer, now),
                });
            }
            if let Some(holders) = store.live_holders(&keys.lock, now)
                && !holders.expiry.contains_key(&owner)
            {
                if holders.mode != mode {
                    return Ok(AcquireReply::OtherMode { held: holders.mode });
                }
                let limit = mode.limit().map_or(usize::MAX, |n| {
                    usize::try_from(n.get()).unwrap_or(usize::MAX)
                });
                if holders.expiry.len() >= limit {
                    let first = holders.expiry.values().min().copied();
                    return Ok(AcquireReply::Held {
                        pttl: first.map(|at| at.saturating_duration_since(now)),
                    });
                }
            }
            // The counter is checked before anything is written.
            let current = match store.live(&keys.fence, now) {
                Some(entry) if fencing => Some(entry.value.parse::<u64>().map_err(|_| {
                    NodeError::Server(
                        format!("ERR fence counter {} is not an integer", keys.fence).into(),
                    )
                })?),
                _ => None,
            };
            store
                .holders
                .entry(keys.lock.clone())
                .or_insert_with(|| Holders {
                    mode,
                    expiry: HashMap::new(),
                })
                .expiry
                .insert(owner, now + ttl);
            store.wrote(now);
            if !fencing {
                return Ok(AcquireReply::Acquired { fence: 0 });
            }
            let fence = current.map_or(floor, |current| current.saturating_add(1).max(floor));
            store.entries.insert(
                keys.fence,
                Entry {
                    value: fence.to_string(),
                    expires: Some(now + fence_ttl),
                },
            );
            Ok(AcquireReply::Acquired { fence })
        })
    }

    fn extend_shared(&self, keys: &ResourceKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        let lock_key = keys.lock.clone();
        let owner = owner.as_str().to_owned();
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            let expiry = store
                .live_holders(&lock_key, now)
                .and_then(|holders| holders.expiry.get_mut(&owner));
            Ok(expiry.map(|at| *at = now + ttl).is_some())
        })
    }

    fn extend_shared_many(
        &self,
        entries: &[ExtendEntry<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        let entries: Vec<(String, String)> = entries
            .iter()
            .map(|entry| (entry.keys.lock.clone(), entry.owner.as_str().to_owned()))
            .collect();
        // One lock for the whole batch, as the exclusive `extend_many`.
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            Ok(entries
                .iter()
                .map(|(lock_key, owner)| {
                    let expiry = store
                        .live_holders(lock_key, now)
                        .and_then(|holders| holders.expiry.get_mut(owner));
                    Ok(expiry.map(|at| *at = now + ttl).is_some())
                })
                .collect())
        })
    }

    fn release_shared(&self, keys: &ResourceKeys, owner: &Owner) -> NodeFuture<bool> {
        let keys = keys.clone();
        let owner = owner.as_str().to_owned();
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            let Some(holders) = store.live_holders(&keys.lock, now) else {
                return Ok(false);
            };
            if holders.expiry.remove(&owner).is_none() {
                return Ok(false);
            }
            let last = holders.expiry.is_empty();
            if last {
                store.holders.remove(&keys.lock);
            }
            if keys.channel.is_empty() {
                return Ok(true);
            }
            // The last holder hands the resource to the next queued writer, as an
            // exclusive release does; otherwise the resource's listeners are woken
            // (readers behind a writer's intent, a waiting permit).
            if last && shared.hand_off(&mut store, &keys, "", now) == HandOff::Reserved {
                return Ok(true);
            }
            drop(store);
            shared.wake(&keys.channel);
            Ok(true)
        })
    }
}
