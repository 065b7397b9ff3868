//! The acquire path of [`Redlock`], for one resource or a set ([`Target`]): the local
//! places of every member, in canonical order, then rounds (`attempt.rs`) until the
//! lease is won or the deadline passes, woken by releases (`wait/`).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::attempt::SPLIT_RETRIES;
use super::lease::LeaseInner;
use super::round::Nodes;
use super::target::Target;
use super::wait::{next_release, QueueRef, Queues, Turn, Waiting, QUEUE_TTL};
use super::{metrics, renewal, Backoff, Lease, LockError, Redlock, RetryPolicy};
use crate::node::HANDOFF_TTL;
use crate::node::{PerKey, ReleaseSignal, Resource, ResourceKeys, Waiter};

impl Redlock {
    /// One attempt, no waiting: a lease, or [`LockError::Held`] naming the first member
    /// a caller of this process holds or queues for, or the nodes found held. An
    /// attempt lost to a split vote is not a refusal: it runs again (`SPLIT_RETRIES`).
    pub(super) async fn try_once(&self, target: Target) -> Result<Lease, LockError> {
        let shared = &self.shared;
        self.refuse_if_draining(&target.resources()[0])?;
        let queues = local_queues(&target, &shared.queues);
        let mut turns = target.each(|_| None);
        let members = target.resources().iter().zip(queues.iter());
        for ((resource, queue), turn) in members.zip(turns.iter_mut()) {
            *turn = queue.try_turn();
            if turn.is_none() && queue.releasing() {
                // This process's holder is being released (a lease dropped a moment
                // ago): not contention, so wait for it (bounded by the node timeout).
                let bound = shared.options.node_timeout.saturating_mul(2);
                *turn = tokio::time::timeout(bound, queue.turn())
                    .await
                    .ok()
                    .flatten();
            }
            if turn.is_none() {
                shared.metrics.contended.inc();
                return Err(LockError::Held {
                    holder_ttl: queue.holder_ttl(),
                    resource: resource.clone(),
                });
            }
        }
        let mut splits = 0;
        let won = loop {
            let mut split = false;
            match self.attempt(&target, None, &mut split).await {
                // No holder: undone, and again after a short random delay (the
                // default backoff's, whatever the locker's retry policy for waiters).
                Err(_) if split && splits < SPLIT_RETRIES => {
                    splits += 1;
                    let delay = Backoff::default().delay(splits, None);
                    tracing::debug!(resource = %target.resources()[0], splits, ?delay, "split vote: retrying");
                    tokio::time::sleep(delay).await;
                    self.refuse_if_draining(&target.resources()[0])?;
                }
                result => break result?,
            }
        };
        let inner = won.into_lease(shared, target);
        self.unless_drained(Ok(self.finish(inner, turns, queues)))
            .await
    }

    /// Records the local holder of every member and schedules the renewal.
    fn finish(
        &self,
        inner: Arc<LeaseInner>,
        turns: PerKey<Option<Turn>>,
        queues: PerKey<QueueRef>,
    ) -> Lease {
        for queue in queues.iter() {
            queue.set_holder(&inner);
        }
        let renewal = self
            .shared
            .options
            .watchdog
            .then(|| renewal::register(&inner));
        Lease::new(inner, (turns, queues, renewal))
    }

    /// Waits from `started` until `deadline` for `target`, unless a drain begins.
    pub(super) async fn wait_for(
        &self,
        target: Target,
        started: Instant,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let first = target.resources()[0].clone();
        let waiting = self.queue_and_acquire(target, started, deadline);
        let result = self.unless_draining(&first, waiting).await;
        metrics::acquisition(&result, Some(started));
        result
    }

    /// Waits until `deadline` for every member of `target`. Inside this process it
    /// queues for each member in canonical order (every caller takes them in the same
    /// order, so none waits for another in a circle); across processes it retries when
    /// a release wakes it or after the retry policy's delay.
    #[tracing::instrument(name = "redlock.wait", level = "debug", skip_all, fields(resource = %target.resources()[0], members = target.resources().len()))]
    async fn queue_and_acquire(
        &self,
        target: Target,
        started: Instant,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let shared = &self.shared;
        let queues = local_queues(&target, &shared.queues);
        // Counts this caller against each member's `max_waiters` until it returns: the
        // head of a queue, contending at the nodes, waits as much as those behind it.
        let mut waiting: PerKey<Option<Waiting>> = target.each(|_| None);
        let members = target.resources().iter().zip(queues.iter());
        for ((resource, queue), entered) in members.clone().zip(waiting.iter_mut()) {
            *entered = queue.enter(self.max_waiters);
            if entered.is_none() {
                return Err(LockError::QueueFull {
                    resource: resource.clone(),
                    limit: self.max_waiters,
                });
            }
        }
        let timeout = |resource: &Resource, holder_ttl| LockError::WaitTimeout {
            resource: resource.clone(),
            waited: started.elapsed(),
            holder_ttl,
        };
        let mut waited = false;
        let mut turns = target.each(|_| None);
        for ((resource, queue), turn) in members.zip(turns.iter_mut()) {
            *turn = queue.try_turn();
            if turn.is_none() {
                if !std::mem::replace(&mut waited, true) {
                    shared.metrics.waits.inc();
                }
                match tokio::time::timeout_at(deadline, queue.turn()).await {
                    Ok(Some(taken)) => *turn = Some(taken),
                    _ => return Err(timeout(resource, queue.holder_ttl())),
                }
            }
        }
        // A single resource's waiter joins the nodes' wait queues (see `wait`), in this
        // process's place: its head's arrival. A set's waiter is woken by the release
        // of any member instead, on each member's own channel.
        let waiter = target.queues().then(|| Waiter {
            id: shared.waiter_id.clone(),
            ticket: unix_micros(),
            queue_ttl: QUEUE_TTL,
        });
        let first = &queues[0];
        // Subscriptions a recent wait left: live before the first attempt, so that
        // attempt may join the queue at once. Otherwise the waiter joins only once it
        // is subscribed, and no hand-off to it can go unheard.
        let mut signals: Option<Vec<ReleaseSignal>> =
            waiter.as_ref().and_then(|_| first.live_signals());
        let queued_wake = waiter.is_some() && shared.nodes.queued();
        let mut queued = waiter.as_ref().map(|waiter| LeaveIfGivenUp {
            nodes: &shared.nodes,
            keys: &target.keys()[0],
            waiter,
            queue: first,
            armed: false,
        });
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut joining = None;
            if let Some(signals) = signals.as_mut() {
                signals.iter_mut().for_each(ReleaseSignal::mark_seen);
                match queued.as_mut() {
                    Some(queued) => {
                        joining = Some(queued.waiter);
                        queued.armed = true;
                    }
                    // Before the attempt, so that a release after its refusal finds the
                    // mark (or a release that used it up meanwhile woke us): a release
                    // wakes nobody on a member's channel unless marked.
                    None => shared.nodes.listen_for_release(target.keys()).await,
                }
            }
            let (held, holder_ttl) = match self.attempt(&target, joining, &mut false).await {
                Ok(won) => {
                    // A granted head left the queue (the grant took it off).
                    if let Some(queued) = queued.as_mut() {
                        queued.armed = false;
                    }
                    drop(queued);
                    drop(waiting);
                    let inner = won.into_lease(shared, target);
                    return Ok(self.finish(inner, turns, queues));
                }
                Err(LockError::Held {
                    resource,
                    holder_ttl,
                }) => {
                    let member = target.resources().binary_search(&resource).unwrap_or(0);
                    // For the callers of this process queued behind us on that member:
                    // whom they wait for, and how long.
                    queues[member].note_remote_holder(holder_ttl);
                    (member, holder_ttl)
                }
                Err(LockError::ValidityExpired { .. }) => (0, None),
                Err(e) => return Err(e),
            };
            let held = &target.resources()[held];
            if Instant::now() >= deadline {
                return Err(timeout(held, holder_ttl));
            }
            if !std::mem::replace(&mut waited, true) {
                shared.metrics.waits.inc();
            }
            if signals.is_none() {
                // Subscribe, then try once more at once (joining the queue, or marking
                // it): a release may have come between our attempt and the subscriptions.
                signals = Some(match &waiter {
                    Some(waiter) => {
                        first
                            .signals(&shared.nodes, &target.keys()[0], waiter)
                            .await
                    }
                    None => shared.nodes.subscribe_broadcast(target.keys()).await,
                });
                continue;
            }
            let mut delay = shared.options.retry.delay(attempt, holder_ttl);
            if queued_wake {
                // In the queues, a release hands us the key and wakes us: an attempt
                // before the key (or a reservation) runs out would only be refused. Still
                // at least every quarter of `QUEUE_TTL`, which keeps our place alive.
                let runs_out = holder_ttl
                    .map_or(HANDOFF_TTL, |ttl| {
                        ttl.saturating_add(Duration::from_millis(1))
                    })
                    .min(HANDOFF_TTL);
                delay = delay.max(runs_out).min(QUEUE_TTL / 4);
            } else if waiter.is_none() {
                // At least every quarter of `QUEUE_TTL`, which keeps the marks alive.
                delay = delay.min(QUEUE_TTL / 4);
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
                // A wake-up starts a new race: if lost, the next try comes after a short
                // random delay, not the long one earlier waiting had grown to.
                attempt = 0;
            } else if Instant::now() >= deadline {
                return Err(timeout(held, holder_ttl));
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
    keys: &'a ResourceKeys,
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

/// `timeout` after `from`, or thirty years from now past the clock's end.
pub(super) fn after(from: Instant, timeout: Duration) -> Instant {
    from.checked_add(timeout)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365 * 30))
}

/// Each member's place in this process: the resource's local queue (one holder at a
/// time, the others wait in order), or one of its own for a target that shares its
/// resource (see [`Queues::own`]).
fn local_queues(target: &Target, queues: &Arc<Queues>) -> PerKey<QueueRef> {
    if target.shares() {
        target.each(|resource| queues.own(resource))
    } else {
        target.each(|resource| queues.get(resource))
    }
}
