//! The acquire path of [`Redlock`]: queueing in this process, the rounds until the
//! lease is won or the deadline passes, and the cleanup of a cancelled attempt.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::lease::{LeaseInner, StatusCell};
use super::round::{Nodes, Stragglers};
use super::wait::{next_release, QueueRef, Turn, QUEUE_TTL};
use super::{fencing, renewal, Lease, LockError, Redlock, Shared};
use crate::node::HANDOFF_TTL;
use crate::node::{AcquireRequest, LockKeys, Owner, ReleaseSignal, Resource, Waiter};
use fencing::FencingToken;

impl Redlock {
    #[tracing::instrument(name = "redlock.wait", level = "debug", skip_all, fields(resource = %resource))]
    pub(super) async fn queue_and_acquire(
        &self,
        resource: Resource,
        started: Instant,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let shared = &self.shared;
        let queue = shared.queues.get(&resource);
        // Counts this caller against `max_waiters` until it returns: the head of the
        // queue, contending at the nodes, waits as much as those behind it.
        let Some(waiting) = queue.enter(self.max_waiters) else {
            return Err(LockError::QueueFull {
                resource,
                limit: self.max_waiters,
            });
        };
        let timeout = |holder_ttl| LockError::WaitTimeout {
            resource: resource.clone(),
            waited: started.elapsed(),
            holder_ttl,
        };
        let mut waited = false;
        let turn = match queue.try_turn() {
            Some(turn) => turn,
            None => {
                waited = true;
                shared.metrics.waits.inc();
                match tokio::time::timeout_at(deadline, queue.turn()).await {
                    Ok(Some(turn)) => turn,
                    _ => return Err(timeout(queue.holder_ttl())),
                }
            }
        };
        let keys = LockKeys::new(&shared.options.key_prefix, &resource);
        // This process's place in the nodes' wait queues: its head's arrival (see `wait`).
        let waiter = Waiter {
            id: shared.waiter_id.clone(),
            ticket: unix_micros(),
            queue_ttl: QUEUE_TTL,
        };
        // Subscriptions a recent wait left: live before the first attempt, so that
        // attempt may join the queue at once. Otherwise the waiter joins only once it
        // is subscribed, and no hand-off to it can go unheard.
        let mut signals: Option<Vec<ReleaseSignal>> = queue.live_signals();
        let queues = shared.nodes.queued();
        let mut queued = LeaveIfGivenUp {
            nodes: &shared.nodes,
            keys: &keys,
            waiter: &waiter,
            queue: &queue,
            armed: false,
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            if let Some(signals) = signals.as_mut() {
                signals.iter_mut().for_each(ReleaseSignal::mark_seen);
            }
            let joining = signals.is_some().then_some(&waiter);
            queued.armed |= joining.is_some();
            let holder_ttl = match self.attempt_in_turn(&resource, &keys, &turn, joining).await {
                Ok(won) => {
                    // A granted head left the queue (the grant took it off).
                    queued.armed = false;
                    drop(queued);
                    drop(waiting);
                    let inner = won.into_lease(shared, resource, keys);
                    return Ok(self.finish(inner, turn, queue));
                }
                Err(LockError::Held { holder_ttl, .. }) => {
                    // For the callers queued behind us: whom they wait for, and how long.
                    queue.note_remote_holder(holder_ttl);
                    holder_ttl
                }
                Err(LockError::ValidityExpired { .. }) => None,
                Err(e) => return Err(e),
            };
            if Instant::now() >= deadline {
                return Err(timeout(holder_ttl));
            }
            if signals.is_none() {
                // Subscribe, then try once more at once, now joining the queue.
                signals = Some(queue.signals(&shared.nodes, &keys, &waiter).await);
                if !waited {
                    waited = true;
                    shared.metrics.waits.inc();
                }
                continue;
            }
            let mut delay = shared.options.retry.delay(attempt, holder_ttl);
            if queues {
                // In the queues, a release hands us the key and wakes us: an attempt
                // before the key (or another waiter's reservation) runs out, as a
                // crashed holder's or a frozen waiter's does, would only be refused, as
                // we are not at the head yet. Still at least every quarter of
                // `QUEUE_TTL`, which keeps our place alive.
                let runs_out = holder_ttl
                    .map_or(HANDOFF_TTL, |ttl| {
                        ttl.saturating_add(Duration::from_millis(1))
                    })
                    .min(HANDOFF_TTL);
                delay = delay.max(runs_out).min(QUEUE_TTL / 4);
            }
            let retry_at = Instant::now()
                .checked_add(delay)
                .map_or(deadline, |at| at.min(deadline));
            let woken = tokio::select! {
                () = next_release(signals.as_mut().map_or(&mut [][..], Vec::as_mut_slice)) => true,
                () = tokio::time::sleep_until(retry_at) => false,
            };
            if woken {
                shared.metrics.wakeups.inc();
                // A wake-up starts a new race: should this waiter lose it (a split vote,
                // or a node without a queue that woke every waiter), its next try comes
                // after a short random delay, not after the long one its earlier waiting
                // had grown to.
                attempt = 0;
            } else if Instant::now() >= deadline {
                return Err(timeout(holder_ttl));
            }
        }
    }

    pub(super) async fn attempt(
        &self,
        resource: Resource,
        keys: LockKeys,
        turn: Turn,
        queue: QueueRef,
    ) -> Result<Lease, LockError> {
        let won = self.attempt_in_turn(&resource, &keys, &turn, None).await?;
        Ok(self.finish(won.into_lease(&self.shared, resource, keys), turn, queue))
    }

    /// Turns a won round into a [`Lease`]: puts it on the renewal schedule and records the
    /// local holder.
    pub(super) fn finish(&self, inner: Arc<LeaseInner>, turn: Turn, queue: QueueRef) -> Lease {
        queue.set_holder(&inner);
        let renewal = self
            .shared
            .options
            .watchdog
            .then(|| renewal::register(&inner));
        Lease::new(inner, (turn, queue, renewal))
    }

    /// One Redlock round (plus the fence write-back when needed); `waiter`: the caller
    /// waits, and joins the wait queues if refused.
    #[tracing::instrument(name = "redlock.acquire", level = "debug", skip_all, fields(resource = %resource))]
    pub(super) async fn attempt_in_turn(
        &self,
        resource: &Resource,
        keys: &LockKeys,
        _turn: &Turn,
        waiter: Option<&Waiter>,
    ) -> Result<Won, LockError> {
        let shared = &self.shared;
        let options = &shared.options;
        let nodes = &shared.nodes;
        let owner = Owner::random();
        let start = Instant::now();
        let in_flight =
            ReleaseIfDropped::new(nodes, keys, &owner, Stragglers::settled(nodes.len()));
        let (tally, stragglers) = nodes
            .acquire(
                start,
                &AcquireRequest {
                    keys,
                    owner: &owner,
                    ttl: options.ttl,
                    fence_ttl: options.fence_ttl,
                    fencing: options.fencing,
                    fence_floor: fencing::round_floor(options.fencing),
                    seed_only_when_missing: options.seed_only_when_missing,
                    waiter,
                },
            )
            .await;
        in_flight.disarm();
        let quorum = nodes.quorum();
        let valid_until = start + options.ttl - options.drift();
        // Every node that may hold our key: all but those that said someone else holds
        // it (a straggler saying so is skipped when it answers).
        let cleanup = |stragglers: Stragglers| {
            let targets = (0..nodes.len()).filter(|i| !tally.held.contains(i));
            nodes.release_after(stragglers, targets, keys, &owner, waiter);
        };
        if tally.won.len() < quorum {
            let answered = tally.won.len() + tally.held.len();
            cleanup(stragglers);
            if answered >= quorum {
                shared.metrics.contended.inc();
                tracing::debug!(%resource, held = tally.held.len(), won = tally.won.len(), elapsed = ?start.elapsed(), "resource held");
                return Err(LockError::Held {
                    resource: resource.clone(),
                    holder_ttl: tally.holder_ttl,
                });
            }
            shared.metrics.unavailable.inc();
            tracing::warn!(%resource, answered, quorum, failures = tally.failures.len(), "no quorum");
            return Err(LockError::Unavailable {
                resource: resource.clone(),
                nodes: nodes.len(),
                answered,
                quorum,
                failures: tally.failures,
            });
        }

        let token = tally.won.iter().map(|&(_, fence)| fence).max().unwrap_or(0);
        let behind: Vec<usize> = tally
            .won
            .iter()
            .filter(|&&(_, fence)| fence < token)
            .map(|&(index, _)| index)
            .collect();
        let mut stragglers = stragglers;
        if !behind.is_empty() {
            // Write-back: a majority must hold the token before the lease counts.
            let level = tally.won.len() - behind.len();
            let in_flight = ReleaseIfDropped::new(nodes, keys, &owner, stragglers);
            let (confirmed, failures) = nodes
                .raise_fence(
                    behind,
                    keys,
                    token,
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
                    tracing::warn!(%resource, ?validity, elapsed = ?start.elapsed(), "fence write-back ran out of validity");
                    return Err(LockError::ValidityExpired {
                        resource: resource.clone(),
                        validity,
                        min_validity: options.min_validity,
                    });
                }
                shared.metrics.unavailable.inc();
                return Err(LockError::Unavailable {
                    resource: resource.clone(),
                    nodes: nodes.len(),
                    answered: level + confirmed,
                    quorum,
                    failures,
                });
            }
        }

        let now = Instant::now();
        let validity = valid_until.saturating_duration_since(now);
        if validity <= options.min_validity {
            cleanup(stragglers);
            shared.metrics.slow.inc();
            tracing::warn!(%resource, ?validity, elapsed = ?start.elapsed(), "majority won too slowly");
            return Err(LockError::ValidityExpired {
                resource: resource.clone(),
                validity,
                min_validity: options.min_validity,
            });
        }
        shared.metrics.acquired.inc();
        tracing::debug!(%resource, votes = tally.won.len(), %token, elapsed = ?start.elapsed(), "lease acquired");
        Ok(Won {
            owner,
            token,
            acquired_at: start,
            valid_until,
            stragglers: stragglers.detach(nodes),
            // Where our attempt did not win (refused, or not answered in time), it may
            // have reached the node before the previous holder's release: that release
            // then queued or reserved us there too late, and ours undoes it.
            waiter: waiter.filter(|_| tally.won.len() < nodes.len()).cloned(),
        })
    }
}

/// A won round, not yet a lease: the caller adds the resource and its keys, which it
/// owns and hands over rather than have them copied.
pub(super) struct Won {
    owner: Owner,
    token: u64,
    acquired_at: Instant,
    valid_until: Instant,
    stragglers: Option<watch::Receiver<()>>,
    waiter: Option<Waiter>,
}

impl Won {
    fn into_lease(
        self,
        shared: &Arc<Shared>,
        resource: Resource,
        keys: LockKeys,
    ) -> Arc<LeaseInner> {
        let status = StatusCell::new(self.valid_until);
        Arc::new(LeaseInner {
            locker: shared.clone(),
            resource,
            keys,
            owner: self.owner,
            token: FencingToken::new(self.token),
            set: None,
            acquired_at: self.acquired_at,
            status,
            stragglers: self.stragglers,
            waiter: self.waiter,
        })
    }
}

/// Releases an attempt's key on every node, in the background, when the attempt is
/// dropped while a round is in flight (a cancelled `acquire`): a `SET` sent before the
/// drop may land after it, and would otherwise block the resource for a whole ttl. The
/// calls of the dropped round are dropped with it, and a dropped redis-rs call is never
/// resent (no `NOSCRIPT` retry), so a release sent now follows on each connection
/// whatever of them was written; the acquire calls that outlived their own round
/// (`stragglers`) are still running, and are waited for.
struct ReleaseIfDropped<'a> {
    nodes: &'a Nodes,
    keys: &'a LockKeys,
    owner: &'a Owner,
    stragglers: Option<Stragglers>,
}

impl<'a> ReleaseIfDropped<'a> {
    fn new(nodes: &'a Nodes, keys: &'a LockKeys, owner: &'a Owner, stragglers: Stragglers) -> Self {
        ReleaseIfDropped {
            nodes,
            keys,
            owner,
            stragglers: Some(stragglers),
        }
    }

    /// The round finished: its outcome is handled by the caller.
    fn disarm(mut self) -> Stragglers {
        self.stragglers
            .take()
            .unwrap_or_else(|| Stragglers::settled(self.nodes.len()))
    }
}

impl Drop for ReleaseIfDropped<'_> {
    fn drop(&mut self) {
        // Without a runtime (it is shutting down) nothing can be sent; the keys expire.
        if let Some(stragglers) = self.stragglers.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                self.nodes.release_after(
                    stragglers,
                    0..self.nodes.len(),
                    self.keys,
                    self.owner,
                    None,
                );
            }
        }
    }
}

/// A waiter that may be in the nodes' wait queues and gives up (timeout, error,
/// cancellation) leaves them on every node, in the background, and drops its
/// subscriptions rather than leaving them for a next wait: an entry a node still holds
/// (a leave that was lost or overtaken by a late attempt) then has nobody listening, and
/// the next hand-off skips it.
struct LeaveIfGivenUp<'a> {
    nodes: &'a Nodes,
    keys: &'a LockKeys,
    waiter: &'a Waiter,
    queue: &'a QueueRef,
    armed: bool,
}

impl Drop for LeaveIfGivenUp<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.queue.forget_signals();
        // Without a runtime (it is shutting down) nothing can be sent; the queues expire.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.nodes.leave_all(self.keys, self.waiter);
        }
    }
}

/// The wall clock in µs since the Unix epoch (below 2⁵³ until the year 2255: a Redis
/// score holds it exactly).
fn unix_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

pub(super) fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}
