//! Waiting for a set: each member's local place in canonical order, then rounds until
//! the set is won, woken by the release of any member.

use tokio::time::Instant;

use super::attempt::Guards;
use super::Set;
use crate::lock::wait::{next_release, QUEUE_TTL};
use crate::lock::{Lease, LockError, Redlock};
use crate::node::{ReleaseSignal, Resource};

impl Redlock {
    #[tracing::instrument(name = "redlock.wait", level = "debug", skip_all, fields(resource = %set.resources[0], members = set.resources.len()))]
    pub(super) async fn queue_and_acquire_set(
        &self,
        set: Set,
        started: Instant,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let shared = &self.shared;
        let queues: Vec<_> = set.resources.iter().map(|r| shared.queues.get(r)).collect();
        // Counts this caller against each member's `max_waiters` until it returns.
        let mut waiting = Vec::with_capacity(queues.len());
        for (queue, resource) in queues.iter().zip(set.resources.iter()) {
            match queue.enter(self.max_waiters) {
                Some(entered) => waiting.push(entered),
                None => {
                    return Err(LockError::QueueFull {
                        resource: resource.clone(),
                        limit: self.max_waiters,
                    })
                }
            }
        }
        let timeout = |resource: &Resource, holder_ttl| LockError::WaitTimeout {
            resource: resource.clone(),
            waited: started.elapsed(),
            holder_ttl,
        };
        // The local places in canonical order: every caller of this process takes them
        // in the same order, so none waits for another in a circle.
        let mut waited = false;
        let mut turns = Vec::with_capacity(queues.len());
        for (queue, resource) in queues.iter().zip(set.resources.iter()) {
            let turn = match queue.try_turn() {
                Some(turn) => turn,
                None => {
                    if !waited {
                        waited = true;
                        shared.metrics.waits.inc();
                    }
                    match tokio::time::timeout_at(deadline, queue.turn()).await {
                        Ok(Some(turn)) => turn,
                        _ => return Err(timeout(resource, queue.holder_ttl())),
                    }
                }
            };
            turns.push(turn);
        }
        let mut signals: Option<Vec<ReleaseSignal>> = None;
        let mut attempt = 0;
        loop {
            attempt += 1;
            if let Some(signals) = signals.as_mut() {
                signals.iter_mut().for_each(ReleaseSignal::mark_seen);
                // Before the attempt, so that a release after its refusal finds the
                // mark (or a release that used it up meanwhile woke us): a release
                // wakes nobody on a member's channel unless marked.
                shared.nodes.listen_for_release(&set.keys).await;
            }
            let (held_member, holder_ttl) = match self.attempt_set(&set).await {
                Ok(inner) => {
                    drop(waiting);
                    let guards: Guards = turns.into_iter().zip(queues).collect();
                    return Ok(self.finish_set(inner, guards));
                }
                Err(LockError::Held {
                    resource,
                    holder_ttl,
                }) => {
                    let member = set.resources.binary_search(&resource).unwrap_or(0);
                    // For the callers of this process queued behind us on that member.
                    queues[member].note_remote_holder(holder_ttl);
                    (member, holder_ttl)
                }
                Err(LockError::ValidityExpired { .. }) => (0, None),
                Err(e) => return Err(e),
            };
            let held = &set.resources[held_member];
            if Instant::now() >= deadline {
                return Err(timeout(held, holder_ttl));
            }
            if signals.is_none() {
                // Subscribe to every member, then try once more at once, marking the
                // members' queues first (see `Node::listen_for_release`): a release may
                // have come between our attempt and the subscriptions. (Sets wait on each
                // member's own channel, not in the wait queues.)
                let mut all = Vec::new();
                for keys in set.keys.iter() {
                    all.extend(shared.nodes.subscribe_broadcast(keys).await);
                }
                signals = Some(all);
                if !waited {
                    waited = true;
                    shared.metrics.waits.inc();
                }
                continue;
            }
            // At least every quarter of `QUEUE_TTL`, which keeps the marks alive.
            let delay = shared
                .options
                .retry
                .delay(attempt, holder_ttl)
                .min(QUEUE_TTL / 4);
            let retry_at = Instant::now()
                .checked_add(delay)
                .map_or(deadline, |at| at.min(deadline));
            let woken = tokio::select! {
                () = next_release(signals.as_mut().map_or(&mut [][..], Vec::as_mut_slice)) => true,
                () = tokio::time::sleep_until(retry_at) => false,
            };
            if woken {
                shared.metrics.wakeups.inc();
                attempt = 0;
            } else if Instant::now() >= deadline {
                return Err(timeout(held, holder_ttl));
            }
        }
    }
}
