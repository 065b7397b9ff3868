//! The wait queue of a [`MemoryNode`](super::MemoryNode): `hand_off.lua` and the queue
//! parts of the acquire and release scripts, in Rust (see [`Waiter`]).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use super::{Entry, Shared, Store};
use crate::node::{ResourceKeys, Waiter, HANDOFF_TTL};

/// One resource's wait queue: waiter ids ordered by ticket, then id (as a Redis sorted
/// set orders them).
pub(super) struct Queue {
    order: BTreeSet<(u64, String)>,
    tickets: HashMap<String, u64>,
    pub(super) expires: Instant,
}

/// What a hand-off did (see `hand_off.lua`).
#[derive(PartialEq, Eq)]
pub(super) enum HandOff {
    Reserved,
    Me,
    Nobody,
}

impl Shared {
    /// `hand_off.lua`: takes waiters off the queue's head until one listens on its own
    /// channel, and reserves the lock for it.
    pub(super) fn hand_off(
        &self,
        store: &mut Store,
        keys: &ResourceKeys,
        me: &str,
        now: Instant,
    ) -> HandOff {
        let queue_key = keys.queue();
        loop {
            let Some((ticket, head)) = store.pop_head(&queue_key, now) else {
                return HandOff::Nobody;
            };
            if head == me {
                return HandOff::Me;
            }
            if self.wake(&format!("{}:{head}", keys.channel)) {
                store.entries.insert(
                    keys.lock.clone(),
                    Entry {
                        value: format!("~{head}:{ticket}"),
                        expires: Some(now + HANDOFF_TTL),
                    },
                );
                return HandOff::Reserved;
            }
        }
    }
}

impl Store {
    pub(super) fn live_queue(&mut self, key: &str, now: Instant) -> Option<&mut Queue> {
        if self.queues.get(key).is_some_and(|q| q.expires <= now) {
            self.queues.remove(key);
        }
        self.queues.get_mut(key)
    }

    pub(super) fn head(&mut self, key: &str, now: Instant) -> Option<(u64, String)> {
        let queue = self.live_queue(key, now)?;
        queue.order.first().cloned()
    }

    pub(super) fn pop_head(&mut self, key: &str, now: Instant) -> Option<(u64, String)> {
        let queue = self.live_queue(key, now)?;
        let (ticket, id) = queue.order.pop_first()?;
        queue.tickets.remove(&id);
        if queue.order.is_empty() {
            self.queues.remove(key);
        }
        Some((ticket, id))
    }

    pub(super) fn remove_waiter(&mut self, key: &str, id: &str, now: Instant) {
        let Some(queue) = self.live_queue(key, now) else {
            return;
        };
        if let Some(ticket) = queue.tickets.remove(id) {
            queue.order.remove(&(ticket, id.to_owned()));
        }
        if queue.order.is_empty() {
            self.queues.remove(key);
        }
    }

    /// A refused waiter joins the queue or keeps its place; the queue lives on.
    pub(super) fn join(&mut self, key: &str, waiter: &Waiter, now: Instant) {
        self.enqueue(key, &waiter.id, waiter.ticket, now + waiter.queue_ttl, now);
    }

    pub(super) fn enqueue(
        &mut self,
        key: &str,
        id: &str,
        ticket: u64,
        until: Instant,
        now: Instant,
    ) {
        self.live_queue(key, now);
        let queue = self.queues.entry(key.to_owned()).or_insert_with(|| Queue {
            order: BTreeSet::new(),
            tickets: HashMap::new(),
            expires: now,
        });
        if let Some(old) = queue.tickets.insert(id.to_owned(), ticket) {
            queue.order.remove(&(old, id.to_owned()));
        }
        queue.order.insert((ticket, id.to_owned()));
        queue.expires = until;
    }

    /// The remaining ttl of a live key, as `PTTL` reports it to a refused caller.
    pub(super) fn pttl(&mut self, key: &str, now: Instant) -> Option<Duration> {
        self.live(key, now)
            .and_then(|e| e.expires)
            .map(|at| at.saturating_duration_since(now))
    }
}

/// A reservation's waiter id and ticket (`~id:ticket`).
pub(super) fn reservation(value: &str) -> Option<(&str, u64)> {
    let (id, ticket) = value.strip_prefix('~')?.split_once(':')?;
    Some((id, ticket.parse().ok()?))
}
