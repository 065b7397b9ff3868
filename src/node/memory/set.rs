//! The set calls of [`MemoryNode`]: each one atomic under the store's lock, as one
//! script on a Redis server.

use std::time::Duration;

use tokio::time::Instant;

use super::queue::HandOff;
use super::{lock, Entry, MemoryNode};
use crate::error::NodeError;
use crate::node::{AcquireSetReply, AcquireSetRequest, LockSets, NodeFuture, Owner, ResourceKeys};

impl LockSets for MemoryNode {
    /// Checks every member, then sets them all or none (see `acquire_set.lua`).
    fn acquire_set(&self, request: &AcquireSetRequest<'_>) -> NodeFuture<AcquireSetReply> {
        let keys = request.keys.to_vec();
        let owner = request.owner.as_str().to_owned();
        let (ttl, fence_ttl, fencing) = (request.ttl, request.fence_ttl, request.fencing);
        let (floor, seed_only_when_missing) = (request.fence_floor, request.seed_only_when_missing);
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            // Everything is checked before anything is written.
            let mut counters = Vec::with_capacity(keys.len());
            let mut held: Option<(usize, Option<Duration>)> = None;
            for (index, member) in keys.iter().enumerate() {
                let counter = match store.live(&member.fence, now) {
                    Some(entry) if fencing => Some(entry.value.parse::<u64>().map_err(|_| {
                        NodeError::Server(
                            format!("ERR fence counter {} is not an integer", member.fence).into(),
                        )
                    })?),
                    _ => None,
                };
                counters.push(counter);
                // Shared holders hold it as an owner does.
                let pttl = match store.live(&member.lock, now) {
                    Some(entry) => Some(entry.expires.map(|at| at.saturating_duration_since(now))),
                    None => store.shared_pttl(&member.lock, now),
                };
                if let Some(pttl) = pttl {
                    held = Some(match held {
                        None => (index, pttl),
                        Some((first, longest)) => (first, longest.max(pttl)),
                    });
                }
            }
            if let Some((member, pttl)) = held {
                return Ok(AcquireSetReply::Held { member, pttl });
            }
            let mut fences = Vec::with_capacity(keys.len());
            for (member, counter) in keys.into_iter().zip(counters) {
                store.entries.insert(
                    member.lock,
                    Entry {
                        value: owner.clone(),
                        expires: Some(now + ttl),
                    },
                );
                if !fencing {
                    fences.push(0);
                    continue;
                }
                let fence = match counter {
                    Some(current) if seed_only_when_missing => current.saturating_add(1),
                    Some(current) => current.saturating_add(1).max(floor),
                    None => floor,
                };
                store.entries.insert(
                    member.fence,
                    Entry {
                        value: fence.to_string(),
                        expires: Some(now + fence_ttl),
                    },
                );
                fences.push(fence);
            }
            store.wrote(now);
            Ok(AcquireSetReply::Acquired { fences })
        })
    }

    /// Extends every member still ours; yes only if all were.
    fn extend_set(&self, keys: &[ResourceKeys], owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        let locks: Vec<String> = keys.iter().map(|k| k.lock.clone()).collect();
        let owner = owner.as_str().to_owned();
        self.run(move |shared| {
            let now = Instant::now();
            let mut store = lock(&shared.store);
            let mut all = true;
            for lock_key in &locks {
                match store.live(lock_key, now) {
                    Some(entry) if entry.value == owner => entry.expires = Some(now + ttl),
                    _ => all = false,
                }
            }
            Ok(all)
        })
    }

    /// Deletes every member still ours and wakes each one's waiters (unless its
    /// channel is empty); yes only if all were ours.
    fn release_set(&self, keys: &[ResourceKeys], owner: &Owner) -> NodeFuture<bool> {
        let keys = keys.to_vec();
        let owner = owner.as_str().to_owned();
        self.run(move |shared| {
            let now = Instant::now();
            let mut all = true;
            // Each member as a single release: handed to the next waiter of its queue,
            // else deleted and its own channel woken (after the store's lock).
            let mut broadcast = Vec::new();
            {
                let mut store = lock(&shared.store);
                for member in &keys {
                    let ours = store
                        .live(&member.lock, now)
                        .is_some_and(|e| e.value == owner);
                    if !ours {
                        all = false;
                    } else if member.channel.is_empty() {
                        store.entries.remove(&member.lock);
                    } else if shared.hand_off(&mut store, member, "", now) != HandOff::Reserved {
                        store.entries.remove(&member.lock);
                        broadcast.push(&member.channel);
                    }
                }
            }
            for channel in broadcast {
                shared.notify(channel);
            }
            Ok(all)
        })
    }

    /// Raises each member's counter to its token.
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
}
