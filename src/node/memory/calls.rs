//! The lock calls of a [`MemoryNode`](super::MemoryNode), each atomic under the store's
//! lock, as one script on a Redis server: acquire (one resource with the wait queue, a
//! set all or nothing, a shared holder), extend, release and the fence rule, once.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::modes::Holders;
use super::queue::{reservation, HandOff};
use super::{Entry, Shared, Store};
use crate::error::NodeError;
use crate::node::{LockMode, Owner, PerKey, ResourceKeys, Vote, Waiter, HANDOFF_TTL};

/// An acquire, owned by the call's task.
pub(super) struct Ask {
    pub(super) keys: PerKey<ResourceKeys>,
    pub(super) owner: Owner,
    pub(super) mode: LockMode,
    pub(super) ttl: Duration,
    pub(super) fencing: bool,
    pub(super) fence_ttl: Duration,
    pub(super) floor: u64,
    pub(super) seed_only_when_missing: bool,
    pub(super) waiter: Option<Waiter>,
}

/// A release, owned by the call's task (see [`Release`](crate::node::Release)).
pub(super) enum How {
    Wake,
    Quiet,
    AsWaiter(Waiter),
    HandBack(Waiter),
}

impl Store {
    /// A key's fence counter, read before anything of the grant is written: a counter
    /// that is not an integer fails the whole call.
    fn counter(
        &mut self,
        keys: &ResourceKeys,
        ask: &Ask,
        now: Instant,
    ) -> Result<Option<u64>, NodeError> {
        match self.live(&keys.fence, now) {
            Some(entry) if ask.fencing => entry.value.parse::<u64>().map(Some).map_err(|_| {
                NodeError::Server(
                    format!("ERR fence counter {} is not an integer", keys.fence).into(),
                )
            }),
            _ => Ok(None),
        }
    }

    /// The fence rule, for every grant: the counter becomes `max(counter + 1, floor)`
    /// (`floor` when missing) and lives `fence_ttl`; 0 without fencing.
    fn step(&mut self, keys: &ResourceKeys, counter: Option<u64>, ask: &Ask, now: Instant) -> u64 {
        if !ask.fencing {
            return 0;
        }
        let fence = match counter {
            Some(current) if ask.seed_only_when_missing => current.saturating_add(1),
            Some(current) => current.saturating_add(1).max(ask.floor),
            None => ask.floor,
        };
        self.entries.insert(
            keys.fence.clone(),
            Entry {
                value: fence.to_string(),
                expires: Some(now + ask.fence_ttl),
            },
        );
        fence
    }

    fn set_owner(&mut self, key: &str, owner: &str, expires: Instant) {
        self.entries.insert(
            key.to_owned(),
            Entry {
                value: owner.to_owned(),
                expires: Some(expires),
            },
        );
    }
}

impl Shared {
    pub(super) fn acquire(&self, ask: &Ask) -> Result<Vote, NodeError> {
        match (ask.mode, &*ask.keys) {
            (LockMode::Exclusive, [keys]) => self.acquire_one(keys, ask),
            (LockMode::Exclusive, _) => self.acquire_set(ask),
            (_, [keys]) => self.acquire_shared(keys, ask),
            _ => Err(NodeError::Unsupported(
                "a set of resources in a shared mode".into(),
            )),
        }
    }

    /// One resource, exclusively, with the wait queue (as `acquire.lua`, step by step).
    fn acquire_one(&self, keys: &ResourceKeys, ask: &Ask) -> Result<Vote, NodeError> {
        let now = Instant::now();
        let mut store = super::lock(&self.store);
        let waiter = ask.waiter.as_ref();
        if let Some(pttl) = store.refuse_writer(keys, waiter, now) {
            return Ok(Vote::Held { member: 0, pttl });
        }
        let owner = ask.owner.as_str();
        let me = waiter.map_or("", |w| w.id.as_str());
        let queue_key = keys.queue();
        let refuse = |store: &mut Store| {
            if let Some(waiter) = waiter {
                store.join(&queue_key, waiter, now);
            }
            let pttl = store.pttl(&keys.lock, now);
            Ok(Vote::Held { member: 0, pttl })
        };
        let mine = waiter.map(|w| (w.ticket, w.id.clone()));
        match store.live(&keys.lock, now).map(|e| e.value.clone()) {
            None => {
                // The key is free; the queue's head still comes first, unless we come
                // before it.
                match store.head(&queue_key, now) {
                    Some(head) if head.1 == me => store.remove_waiter(&queue_key, me, now),
                    Some(head) if mine.as_ref().is_none_or(|mine| *mine > head) => {
                        store.set_owner(&keys.lock, owner, now + ask.ttl);
                        if self.hand_off(&mut store, keys, me, now) == HandOff::Reserved {
                            return refuse(&mut store);
                        }
                    }
                    _ => {}
                }
            }
            Some(holder) if holder == owner => {}
            Some(holder) => {
                // Reserved for us, or for a later waiter (which keeps its place).
                let (Some(waiter), Some((id, ticket))) = (waiter, reservation(&holder)) else {
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
        let counter = store.counter(keys, ask, now).inspect_err(|_| {
            // A free key we set for the queue's head's sake is not left behind.
            if store
                .live(&keys.lock, now)
                .is_some_and(|e| e.value == owner)
            {
                store.entries.remove(&keys.lock);
            }
        })?;
        store.set_owner(&keys.lock, owner, now + ask.ttl);
        store.wrote(now);
        let fence = store.step(keys, counter, ask, now);
        Ok(Vote::Granted {
            fences: PerKey::one(fence),
        })
    }

    /// A set: every member checked, then all set or none (as `acquire.lua` does for a set).
    fn acquire_set(&self, ask: &Ask) -> Result<Vote, NodeError> {
        let now = Instant::now();
        let mut store = super::lock(&self.store);
        let mut counters = Vec::with_capacity(ask.keys.len());
        let mut held: Option<(usize, Option<Duration>)> = None;
        for (index, member) in ask.keys.iter().enumerate() {
            counters.push(store.counter(member, ask, now)?);
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
            return Ok(Vote::Held { member, pttl });
        }
        let fences = ask.keys.iter().zip(counters).map(|(member, counter)| {
            store.set_owner(&member.lock, ask.owner.as_str(), now + ask.ttl);
            store.step(member, counter, ask, now)
        });
        let fences = PerKey::from(fences.collect::<Vec<_>>());
        store.wrote(now);
        Ok(Vote::Granted { fences })
    }

    /// A shared or counted holder (as `acquire.lua` in a shared mode).
    fn acquire_shared(&self, keys: &ResourceKeys, ask: &Ask) -> Result<Vote, NodeError> {
        let now = Instant::now();
        let mut store = super::lock(&self.store);
        let held = |pttl| Ok(Vote::Held { member: 0, pttl });
        // A writer holds the key, or it is reserved for a waiting writer.
        if store.live(&keys.lock, now).is_some() {
            return held(store.pttl(&keys.lock, now));
        }
        // Writer preference: a live intent, and a writer still queued.
        let writer = keys.writer();
        if store.live(&writer, now).is_some() && store.head(&keys.queue(), now).is_some() {
            return held(store.pttl(&writer, now));
        }
        if let Some(holders) = store.live_holders(&keys.lock, now)
            && !holders.expiry.contains_key(ask.owner.as_str())
        {
            if holders.mode != ask.mode {
                return Ok(Vote::OtherMode { held: holders.mode });
            }
            let limit = ask.mode.limit().map_or(usize::MAX, |n| {
                usize::try_from(n.get()).unwrap_or(usize::MAX)
            });
            if holders.expiry.len() >= limit {
                let first = holders.expiry.values().min().copied();
                return held(first.map(|at| at.saturating_duration_since(now)));
            }
        }
        let counter = store.counter(keys, ask, now)?;
        store
            .holders
            .entry(keys.lock.clone())
            .or_insert_with(|| Holders {
                mode: ask.mode,
                expiry: HashMap::new(),
            })
            .expiry
            .insert(ask.owner.as_str().to_owned(), now + ask.ttl);
        store.wrote(now);
        let fence = store.step(keys, counter, ask, now);
        Ok(Vote::Granted {
            fences: PerKey::one(fence),
        })
    }

    /// Extends each hold (`(lock keys, owner, shared)`) still its owner's.
    pub(super) fn extend(
        &self,
        holds: &[(PerKey<String>, Owner, bool)],
        ttl: Duration,
    ) -> Vec<Result<bool, NodeError>> {
        let now = Instant::now();
        let mut store = super::lock(&self.store);
        let mut extend = |lock_key: &String, owner: &Owner, shared: bool| {
            let owner = owner.as_str();
            if shared {
                let expiry = store
                    .live_holders(lock_key, now)
                    .and_then(|holders| holders.expiry.get_mut(owner));
                return expiry.map(|at| *at = now + ttl).is_some();
            }
            match store.live(lock_key, now) {
                Some(entry) if entry.value == owner => {
                    entry.expires = Some(now + ttl);
                    true
                }
                _ => false,
            }
        };
        holds
            .iter()
            .map(|(locks, owner, shared)| {
                // Every member, even past one that is gone: as the set script does.
                let lost = locks
                    .iter()
                    .filter(|lock_key| !extend(lock_key, owner, *shared));
                Ok(lost.count() == 0)
            })
            .collect()
    }

    /// The release of every key of a hold (the release script, member by member):
    /// compare-and-delete, then as `how` says. `true` only if every key was ours.
    pub(super) fn release(&self, keys: &[ResourceKeys], owner: &str, how: &How) -> bool {
        let now = Instant::now();
        let mut store = super::lock(&self.store);
        let mut all = true;
        for member in keys {
            let leaving = match how {
                How::AsWaiter(waiter) => {
                    store.remove_waiter(&member.queue(), &waiter.id, now);
                    Some(waiter)
                }
                _ => None,
            };
            let Some(entry) = store.live(&member.lock, now) else {
                all = false;
                continue;
            };
            let ours =
                entry.value == owner || leaving.is_some_and(|w| w.is_reserved_in(&entry.value));
            if !ours {
                all = false;
                continue;
            }
            match how {
                How::HandBack(waiter) => {
                    entry.value = waiter.reservation();
                    entry.expires = Some(now + HANDOFF_TTL);
                }
                How::Quiet => {
                    store.entries.remove(&member.lock);
                }
                How::Wake | How::AsWaiter(_) => {
                    if self.hand_off(&mut store, member, "", now) != HandOff::Reserved {
                        // Nobody queued: the broadcast wake-up (sets of resources and
                        // shared holders wait on it).
                        store.entries.remove(&member.lock);
                        self.wake(&member.channel);
                    }
                }
            }
        }
        all
    }
}
