//! One attempt at a set: the local places of every member, then one round on the nodes
//! (plus the fence write-back when needed), as `lock/acquire.rs` does for one resource.

use std::sync::Arc;

use tokio::time::Instant;

use super::Set;
use crate::lock::fencing::{self, FencingToken};
use crate::lock::lease::Members;
use crate::lock::lease::{LeaseInner, StatusCell};
use crate::lock::round::{Nodes, Stragglers};
use crate::lock::wait::{QueueRef, Turn};
use crate::lock::{renewal, Lease, LockError, Redlock};
use crate::node::{AcquireSetReply, AcquireSetRequest, LockKeys, Owner};

/// The local places a set holds: each member's turn and queue, in canonical order.
pub(super) type Guards = Vec<(Turn, QueueRef)>;

impl Redlock {
    pub(super) async fn try_set_once(&self, set: Set) -> Result<Lease, LockError> {
        let mut guards: Guards = Vec::with_capacity(set.resources.len());
        for resource in set.resources.iter() {
            let queue = self.shared.queues.get(resource);
            match queue.try_turn() {
                Some(turn) => guards.push((turn, queue)),
                None => {
                    self.shared.metrics.contended.inc();
                    return Err(LockError::Held {
                        holder_ttl: queue.holder_ttl(),
                        resource: resource.clone(),
                    });
                }
            }
        }
        let inner = self.attempt_set(&set).await?;
        Ok(self.finish_set(inner, guards))
    }

    /// Turns a won set round into a [`Lease`]: puts it on the renewal schedule and records the
    /// local holder of every member.
    pub(super) fn finish_set(&self, inner: Arc<LeaseInner>, guards: Guards) -> Lease {
        for (_, queue) in &guards {
            queue.set_holder(&inner);
        }
        let renewal = self
            .shared
            .options
            .watchdog
            .then(|| renewal::register(&inner));
        Lease::new(inner, (guards, renewal))
    }

    /// One Redlock round over a set (plus the fence write-back when needed). The caller
    /// holds every member's local turn.
    #[tracing::instrument(name = "redlock.acquire", level = "debug", skip_all, fields(resource = %set.resources[0], members = set.resources.len()))]
    pub(super) async fn attempt_set(&self, set: &Set) -> Result<Arc<LeaseInner>, LockError> {
        let shared = &self.shared;
        let options = &shared.options;
        let nodes = &shared.nodes;
        let first = &set.resources[0];
        let owner = Owner::random();
        let start = Instant::now();
        let in_flight =
            ReleaseSetIfDropped::new(nodes, &set.keys, &owner, Stragglers::settled(nodes.len()));
        let (tally, stragglers) = nodes
            .acquire_set(
                start,
                &AcquireSetRequest {
                    keys: &set.keys,
                    owner: &owner,
                    ttl: options.ttl,
                    fence_ttl: options.fence_ttl,
                    fencing: options.fencing,
                    fence_floor: fencing::round_floor(options.fencing),
                    seed_only_when_missing: options.seed_only_when_missing,
                },
            )
            .await;
        in_flight.disarm();
        let quorum = nodes.quorum();
        let valid_until = start + options.ttl - options.drift();
        // Every node that may hold our keys: all but those that said a member is held
        // (such a node keeps nothing of the request).
        let cleanup = |stragglers: Stragglers<AcquireSetReply>| {
            let targets = (0..nodes.len()).filter(|i| !tally.held.contains(i));
            nodes.release_set_after(stragglers, targets, &set.keys, &owner);
        };
        if tally.won.len() < quorum {
            let answered = tally.won.len() + tally.held.len();
            cleanup(stragglers);
            if answered >= quorum {
                shared.metrics.contended.inc();
                let member = tally.first_held.unwrap_or(0);
                let resource = set.resources.get(member).unwrap_or(first).clone();
                tracing::debug!(%resource, held = tally.held.len(), won = tally.won.len(), elapsed = ?start.elapsed(), "set held");
                return Err(LockError::Held {
                    resource,
                    holder_ttl: tally.holder_ttl,
                });
            }
            shared.metrics.unavailable.inc();
            tracing::warn!(resource = %first, answered, quorum, failures = tally.failures.len(), "no quorum for a set");
            return Err(LockError::Unavailable {
                resource: first.clone(),
                nodes: nodes.len(),
                answered,
                quorum,
                failures: tally.failures,
            });
        }

        // Each member's token: the highest of its counters among the nodes that granted.
        let members = set.keys.len();
        let mut tokens = vec![0u64; members];
        for (_, fences) in &tally.won {
            for (token, &fence) in tokens.iter_mut().zip(fences) {
                *token = (*token).max(fence);
            }
        }
        let behind: Vec<usize> = tally
            .won
            .iter()
            .filter(|(_, fences)| {
                fences.len() != members || fences.iter().zip(&tokens).any(|(f, t)| f < t)
            })
            .map(|&(index, _)| index)
            .collect();
        let mut stragglers = stragglers;
        if !behind.is_empty() {
            // Write-back: a majority must hold every member's token before the lease counts.
            let level = tally.won.len() - behind.len();
            let in_flight = ReleaseSetIfDropped::new(nodes, &set.keys, &owner, stragglers);
            let (confirmed, failures) = nodes
                .raise_fences(
                    behind,
                    &set.keys,
                    &tokens,
                    options.fence_ttl,
                    valid_until,
                    quorum - level.min(quorum),
                )
                .await;
            stragglers = in_flight.disarm();
            if level + confirmed < quorum {
                cleanup(stragglers);
                let validity = valid_until.saturating_duration_since(Instant::now());
                if validity <= options.min_validity {
                    // The write-back was cut short by the validity deadline: a majority
                    // answered, too slowly. Not an unavailable store; worth a retry.
                    shared.metrics.slow.inc();
                    tracing::warn!(resource = %first, ?validity, elapsed = ?start.elapsed(), "fence write-back of a set ran out of validity");
                    return Err(LockError::ValidityExpired {
                        resource: first.clone(),
                        validity,
                        min_validity: options.min_validity,
                    });
                }
                shared.metrics.unavailable.inc();
                return Err(LockError::Unavailable {
                    resource: first.clone(),
                    nodes: nodes.len(),
                    answered: level + confirmed,
                    quorum,
                    failures,
                });
            }
        }

        let validity = valid_until.saturating_duration_since(Instant::now());
        if validity <= options.min_validity {
            cleanup(stragglers);
            shared.metrics.slow.inc();
            tracing::warn!(resource = %first, ?validity, elapsed = ?start.elapsed(), "majority won a set too slowly");
            return Err(LockError::ValidityExpired {
                resource: first.clone(),
                validity,
                min_validity: options.min_validity,
            });
        }
        shared.metrics.acquired.inc();
        tracing::debug!(resource = %first, members, votes = tally.won.len(), elapsed = ?start.elapsed(), "set lease acquired");
        let status = StatusCell::new(valid_until);
        let tokens: Box<[FencingToken]> = tokens.into_iter().map(FencingToken::new).collect();
        Ok(Arc::new(LeaseInner {
            locker: shared.clone(),
            resource: first.clone(),
            keys: set.keys[0].clone(),
            owner,
            token: tokens[0],
            set: Some(Box::new(Members {
                resources: set.resources.clone(),
                keys: set.keys.clone(),
                tokens,
            })),
            acquired_at: start,
            status,
            stragglers: stragglers.detach(nodes),
            waiter: None,
        }))
    }
}

/// Releases a set attempt's keys on every node, in the background, when the attempt is
/// dropped while a round is in flight (see `ReleaseIfDropped` in `lock/acquire.rs`).
struct ReleaseSetIfDropped<'a> {
    nodes: &'a Nodes,
    keys: &'a [LockKeys],
    owner: &'a Owner,
    stragglers: Option<Stragglers<AcquireSetReply>>,
}

impl<'a> ReleaseSetIfDropped<'a> {
    fn new(
        nodes: &'a Nodes,
        keys: &'a [LockKeys],
        owner: &'a Owner,
        stragglers: Stragglers<AcquireSetReply>,
    ) -> Self {
        ReleaseSetIfDropped {
            nodes,
            keys,
            owner,
            stragglers: Some(stragglers),
        }
    }

    fn disarm(mut self) -> Stragglers<AcquireSetReply> {
        self.stragglers
            .take()
            .unwrap_or_else(|| Stragglers::settled(self.nodes.len()))
    }
}

impl Drop for ReleaseSetIfDropped<'_> {
    fn drop(&mut self) {
        if let Some(stragglers) = self.stragglers.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                self.nodes.release_set_after(
                    stragglers,
                    0..self.nodes.len(),
                    self.keys,
                    self.owner,
                );
            }
        }
    }
}
