//! Shared and counted holders of a [`MemoryNode`](super::MemoryNode) (see
//! [`LockMode`]): what the Redis scripts keep in a sorted set, each call atomic under
//! the store's lock (their acquire is in `calls.rs`).
//!
//! A resource's shared holders live beside the store's keys, by lock key: owner →
//! expiry, as the sorted set a Redis node keeps at the lock key itself. A lock key
//! never has both an entry and live holders: each side refuses while the other is live.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::queue::HandOff;
use super::{lock, Entry, Shared, Store};
use crate::node::{LockMode, ResourceKeys, Waiter};

/// One resource's shared holders: the mode they all hold it in, owner value → expiry.
pub(super) struct Holders {
    pub(super) mode: LockMode,
    pub(super) expiry: HashMap<String, Instant>,
}

impl Store {
    /// The resource's live holders, the expired ones pruned; `None` when none is live.
    pub(super) fn live_holders(&mut self, lock: &str, now: Instant) -> Option<&mut Holders> {
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
    ) -> Option<Option<Duration>> {
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
        Some(pttl)
    }

    /// Drops the resources whose holders all expired (the periodic sweep).
    pub(super) fn sweep_holders(&mut self, now: Instant) {
        self.holders.retain(|_, holders| {
            holders.expiry.retain(|_, at| *at > now);
            !holders.expiry.is_empty()
        });
    }
}

impl Shared {
    /// Removes the holder (compare-by-owner); unless `quiet`, the last holder hands the
    /// resource to the next queued writer, as an exclusive release does, and otherwise
    /// the resource's listeners are woken (readers behind a writer's intent, a waiting
    /// permit).
    pub(super) fn release_shared(&self, keys: &ResourceKeys, owner: &str, quiet: bool) -> bool {
        let shared = self;
        let now = Instant::now();
        let mut store = lock(&shared.store);
        let Some(holders) = store.live_holders(&keys.lock, now) else {
            return false;
        };
        if holders.expiry.remove(owner).is_none() {
            return false;
        }
        let last = holders.expiry.is_empty();
        if last {
            store.holders.remove(&keys.lock);
        }
        if quiet {
            return true;
        }
        if last && shared.hand_off(&mut store, keys, "", now) == HandOff::Reserved {
            return true;
        }
        drop(store);
        shared.wake(&keys.channel);
        true
    }
}
