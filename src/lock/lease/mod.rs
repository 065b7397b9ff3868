//! [`Lease`]: proof of holding a resource, and [`LeaseHandle`], a shareable view of it.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::lock::{metrics, round::OwnerTally, target::Target, LockError, Shared};
use crate::node::{Owner, PerKey, Resource, ResourceKeys, Waiter};
use crate::{FencingToken, LockMode};

mod handle;

pub use handle::LeaseHandle;

/// Why a lease was lost. Reported once, by [`LeaseHandle::lost`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LostCause {
    /// Renewals failed on a majority of nodes until the validity ran out.
    RenewalFailed,
    /// A majority no longer holds our key: it expired, was deleted, or belongs to
    /// someone else.
    KeyLost,
    /// [`LockOptions::max_hold`](crate::LockOptions::max_hold) was reached and the last
    /// validity ran out.
    MaxHoldReached,
    /// The validity ran out without renewal (the watchdog is off).
    Expired,
    /// [`Redlock::drain`](crate::Redlock::drain) released it at its deadline: the
    /// process is shutting down.
    Drained,
}

impl fmt::Display for LostCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostCause::RenewalFailed => "renewal failed on a majority of nodes",
            LostCause::KeyLost => "the key is gone or owned by someone else on a majority of nodes",
            LostCause::MaxHoldReached => "the maximum hold time was reached",
            LostCause::Expired => "the validity ran out without renewal",
            LostCause::Drained => "released by a drain at shutdown",
        })
    }
}

/// What [`Lease::release`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReleaseOutcome {
    /// A majority deleted our key: the resource is free now.
    Released,
    /// A majority no longer held our key: the lease had already expired or been lost.
    NotHeld,
    /// Too few nodes gave a clear answer; the keys expire after the ttl at the latest.
    Unconfirmed {
        /// Nodes that deleted our key.
        released: usize,
        /// Nodes that did not answer.
        failed: usize,
    },
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Status {
    pub(crate) valid_until: Instant,
    pub(crate) lost: Option<LostCause>,
    pub(crate) released: bool,
}

impl Status {
    /// Neither lost nor released (it may be past its validity).
    pub(crate) fn live(&self) -> bool {
        self.lost.is_none() && !self.released
    }
}

/// A lease's [`Status`], and a wake-up for whoever waits in [`LeaseHandle::lost`] when
/// it changes. Not a `tokio::sync::watch`, which allocates apart from the lease and
/// costs every lease on drop; `Notify` costs nothing until someone waits.
pub(crate) struct StatusCell {
    status: Mutex<Status>,
    changed: Notify,
}

impl StatusCell {
    pub(crate) fn new(valid_until: Instant) -> Self {
        StatusCell {
            status: Mutex::new(Status {
                valid_until,
                lost: None,
                released: false,
            }),
            changed: Notify::new(),
        }
    }

    pub(crate) fn get(&self) -> Status {
        *self.lock()
    }

    /// Applies `modify`; wakes the waiters of `lost()` when it returns `true`.
    pub(crate) fn send_if_modified(&self, modify: impl FnOnce(&mut Status) -> bool) -> bool {
        let modified = modify(&mut self.lock());
        if modified {
            self.changed.notify_waiters();
        }
        modified
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Status> {
        // A status is copied in and out whole: a poisoned lock still holds a valid one.
        crate::lock_unpoisoned(&self.status)
    }
}

pub(crate) struct LeaseInner {
    pub(crate) locker: Arc<Shared>,
    /// The resources and their keys, in canonical order.
    pub(crate) target: Target,
    /// Each member's fencing token (a raw value), in canonical order.
    pub(crate) tokens: PerKey<u64>,
    pub(crate) owner: Owner,
    pub(crate) acquired_at: Instant,
    pub(crate) status: StatusCell,
    /// Closed once the acquire calls that outlived the winning round have finished
    /// (`None`: there were none). The release waits for it: an acquire retried after
    /// `NOSCRIPT` could otherwise land behind our own release and keep the key there.
    pub(crate) stragglers: Option<watch::Receiver<()>>,
    /// The waiter whose attempt won the lease, when that attempt joined the wait
    /// queues and some node did not grant it in time: its release also takes the
    /// waiter off those queues (see `wait`).
    pub(crate) waiter: Option<Waiter>,
}

impl LeaseInner {
    pub(crate) fn status(&self) -> Status {
        self.status.get()
    }

    /// The resource of a single lease; a set's first member.
    pub(crate) fn resource(&self) -> &Resource {
        &self.target.resources()[0]
    }

    /// The fencing token of [`resource`](Self::resource).
    pub(crate) fn token(&self) -> FencingToken {
        FencingToken::new(self.tokens[0])
    }

    /// Every resource of the lease, in canonical order.
    pub(crate) fn resources(&self) -> &[Resource] {
        self.target.resources()
    }

    /// Neither lost, released nor past its validity.
    pub(crate) fn is_held(&self) -> bool {
        let status = self.status();
        status.live() && status.valid_until > Instant::now()
    }

    /// Marks the lease released, without waking the receivers: they only wait in
    /// `lost()`, which never resolves for a released lease, so a wake-up would put each
    /// back to sleep (and costs the release more than the rest of its bookkeeping).
    fn mark_released(&self) {
        self.status.send_if_modified(|s| {
            s.released = true;
            false
        });
    }

    /// Marks the lease lost unless it already is, or was released. Returns whether
    /// this call marked it.
    pub(crate) fn mark_lost(&self, cause: LostCause) -> bool {
        let marked = self.status.send_if_modified(|s| {
            if s.live() {
                s.lost = Some(cause);
                // Counted before `lost()` wakes up, so the metrics never lag the signal.
                self.locker.metrics.lost.inc();
                metrics::lost(cause);
                true
            } else {
                false
            }
        });
        if marked {
            tracing::warn!(resource = %self.resource(), token = %self.token(), %cause, "lease lost");
        }
        marked
    }

    /// Whether an extension starting at `now` would carry the lease past
    /// [`max_hold`](crate::LockOptions::max_hold): no renewal may, by the watchdog or
    /// by hand. A limit past the end of the monotonic clock is no limit.
    pub(crate) fn renewal_passes_max_hold(&self, now: Instant) -> bool {
        let options = &self.locker.options;
        let Some(until) = options
            .max_hold
            .and_then(|max| self.acquired_at.checked_add(max))
        else {
            return false;
        };
        now.checked_add(options.ttl).is_none_or(|end| end > until)
    }

    /// The lock keys of this lease, one per resource.
    pub(crate) fn lock_keys(&self) -> &[ResourceKeys] {
        self.target.keys()
    }

    /// The votes this lease needs to hold (a majority but for counted leases).
    pub(crate) fn quorum(&self) -> usize {
        self.target.quorum(self.locker.nodes.len())
    }

    /// Applies the answers of an extend round that started at `start` (this lease's
    /// own, or a batch of the renewal scheduler): the new validity, or why not.
    pub(crate) fn settle_extend(
        &self,
        start: Instant,
        tally: OwnerTally,
    ) -> Result<Instant, ExtendFailure> {
        let locker = &self.locker;
        let quorum = self.quorum();
        if tally.no >= quorum {
            metrics::renewal("key_lost");
            return Err(ExtendFailure::KeyLost);
        }
        let valid_until = start + locker.options.ttl - locker.options.drift();
        if tally.yes >= quorum && Instant::now() < valid_until {
            let applied = self.status.send_if_modified(|s| {
                if s.live() {
                    s.valid_until = valid_until;
                    true
                } else {
                    false
                }
            });
            if applied {
                locker.metrics.renewals.inc();
                metrics::renewal("renewed");
                tracing::trace!(resource = %self.resource(), votes = tally.yes, elapsed = ?start.elapsed(), "lease extended");
                return Ok(valid_until);
            }
            metrics::renewal("key_lost");
            return Err(ExtendFailure::KeyLost);
        }
        locker.metrics.renewal_failures.inc();
        metrics::renewal("no_quorum");
        tracing::debug!(resource = %self.resource(), votes = tally.yes, failures = tally.failures.len(), "extend round failed");
        Err(ExtendFailure::NoQuorum)
    }
}

pub(crate) enum ExtendFailure {
    KeyLost,
    NoQuorum,
}

/// Proof that this process holds a resource, until it is released, dropped or lost.
///
/// While the lease lives the watchdog renews it (unless turned off in
/// [`LockOptions`](crate::LockOptions)). Dropping it releases the resource in the
/// background without blocking; [`release`](Lease::release) does the same and reports
/// the outcome. Everything that reads the lease — fencing token, validity, the lost
/// signal — is on [`LeaseHandle`], which the lease derefs to and which can be cloned
/// into other tasks.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_redlock::{ReleaseOutcome, Redlock};
///
/// let locker = Redlock::in_memory();
/// let lease = locker.acquire("invoice:7", Duration::from_secs(1)).await?;
/// let token = lease.fencing_token(); // pass it to the storage with every write
/// assert!(lease.is_held());
/// tokio::select! {
///     cause = lease.lost() => panic!("lost: {cause}"),
///     _ = async { /* the critical section */ } => {}
/// }
/// assert_eq!(lease.release().await, ReleaseOutcome::Released);
/// # let _ = token;
/// # Ok(())
/// # }
/// ```
pub struct Lease {
    handle: LeaseHandle,
    held: Option<Held>,
}

/// What a live lease owns besides its handle, dropped when it is released: its place
/// at the head of the local queue (`wait::Turn`, `wait::QueueRef`; for a set, every
/// member's) and in the renewal schedule (`renewal::Registration`), in that order.
/// Type-erased, so that the lease depends on neither: both depend on the lease.
type Held = Box<dyn Send + Sync>;

impl Lease {
    pub(crate) fn new(inner: Arc<LeaseInner>, places: impl Send + Sync + 'static) -> Self {
        Lease {
            handle: LeaseHandle { inner },
            held: Some(Box::new(places)),
        }
    }

    /// A handle to this lease that can be cloned and sent to other tasks.
    pub fn handle(&self) -> LeaseHandle {
        self.handle.clone()
    }

    /// Extends the validity by a full ttl on a majority of nodes, measured from the
    /// start of this round. Never re-creates a key that is gone: a lost lease stays lost.
    ///
    /// The watchdog does this on its own; call it only with the watchdog off.
    ///
    /// Refused with [`LockError::Lost`] and [`LostCause::MaxHoldReached`] when the
    /// extension would carry the lease past
    /// [`max_hold`](crate::LockOptions::max_hold) (the watchdog's rule too); the lease
    /// stays held until its current validity runs out, and then counts as expired.
    #[tracing::instrument(name = "redlock.extend", level = "debug", skip_all, fields(resource = %self.resource(), token = %self.fencing_token()))]
    pub async fn extend(&self) -> Result<Duration, LockError> {
        let inner = &self.handle.inner;
        let status = inner.status();
        if let Some(cause) = status.lost {
            return Err(self.lost_error(cause));
        }
        if inner.renewal_passes_max_hold(Instant::now()) {
            return Err(self.lost_error(LostCause::MaxHoldReached));
        }
        if status.valid_until <= Instant::now() && !inner.locker.options.watchdog {
            // Ran out before anyone asked: the same answer `lost()` gives.
            inner.mark_lost(LostCause::Expired);
            return Err(self.lost_error(inner.status().lost.unwrap_or(LostCause::Expired)));
        }
        let (nodes, ttl, start) = (
            &inner.locker.nodes,
            inner.locker.options.ttl,
            Instant::now(),
        );
        let timeout = nodes
            .timeout()
            .min(status.valid_until.saturating_duration_since(start));
        let tally = nodes
            .extend(&inner.target, &inner.owner, ttl, timeout)
            .await;
        match inner.settle_extend(start, tally) {
            Ok(_) => Ok(self.remaining()),
            Err(ExtendFailure::KeyLost) => {
                inner.mark_lost(LostCause::KeyLost);
                Err(self.lost_error(inner.status().lost.unwrap_or(LostCause::KeyLost)))
            }
            Err(ExtendFailure::NoQuorum) => {
                if Instant::now() >= inner.status().valid_until {
                    inner.mark_lost(LostCause::RenewalFailed);
                    return Err(self.lost_error(LostCause::RenewalFailed));
                }
                let nodes = &inner.locker.nodes;
                Err(nodes.unavailable(inner.resource(), 0, inner.quorum(), Vec::new()))
            }
        }
    }

    fn lost_error(&self, cause: LostCause) -> LockError {
        LockError::Lost {
            resource: self.handle.inner.resource().clone(),
            cause,
        }
    }

    /// Releases the resource: compare-and-delete on every node, then hands the resource
    /// to the next waiter of this process. Returns once every node answered or timed out.
    ///
    /// Cancel-safe: dropping this future before the nodes answered (a `tokio::select!`
    /// against a shutdown signal, a timeout) still releases, in the background, as
    /// dropping the lease does; only the outcome is lost.
    pub async fn release(mut self) -> ReleaseOutcome {
        let inner = self.handle.inner.clone();
        // Runs here rather than in a task of its own (a task per release costs more
        // than the rest of the client's work on it); should this future be dropped
        // half-way, the guard starts the release again in the background, and a
        // compare-and-delete sent twice deletes once.
        let mut unfinished = Unfinished {
            inner: Some(inner.clone()),
            held: self.held.take(),
        };
        let outcome = release(&inner).await;
        unfinished.inner = None;
        // Dropping the guard now drops `held`: the next local waiter goes ahead only
        // after the nodes answered, so it does not find our key.
        outcome
    }
}

/// A release not yet finished: dropped with `inner` still set, it releases in the
/// background, and keeps `held` (the local queue's permit) until the nodes answered, so
/// the next local waiter does not find our key. Never blocks.
struct Unfinished {
    inner: Option<Arc<LeaseInner>>,
    held: Option<Held>,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let held = self.held.take();
        let runtime = inner.locker.runtime.clone();
        metrics::spawn(&runtime, async move {
            release(&inner).await;
            drop(held);
        });
    }
}

#[tracing::instrument(name = "redlock.release", level = "debug", skip_all, fields(resource = %inner.resource(), token = %inner.token()))]
pub(crate) async fn release(inner: &LeaseInner) -> ReleaseOutcome {
    inner.mark_released();
    let locker = &inner.locker;
    if let Some(mut settled) = inner.stragglers.clone() {
        // Bounded: every straggler is bounded by the node timeout.
        let _ = settled.changed().await;
    }
    let (nodes, owner, waiter) = (&locker.nodes, &inner.owner, inner.waiter.as_ref());
    let tally = nodes.release(&inner.target, owner, waiter).await;
    let quorum = inner.quorum();
    let outcome = if tally.yes >= quorum {
        ReleaseOutcome::Released
    } else if tally.no >= quorum {
        ReleaseOutcome::NotHeld
    } else {
        ReleaseOutcome::Unconfirmed {
            released: tally.yes,
            failed: tally.failures.len(),
        }
    };
    locker.metrics.released.inc();
    metrics::hold(inner.acquired_at);
    tracing::debug!(resource = %inner.resource(), token = %inner.token(), ?outcome, held_for = ?inner.acquired_at.elapsed(), "lease released");
    outcome
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        // Marked now, not when the task runs: a `try_acquire` of this process in
        // between waits for the release instead of finding the resource held.
        self.handle.inner.mark_released();
        drop(Unfinished {
            inner: Some(self.handle.inner.clone()),
            held: Some(held),
        });
    }
}

impl std::ops::Deref for Lease {
    type Target = LeaseHandle;

    fn deref(&self) -> &LeaseHandle {
        &self.handle
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.handle, f)
    }
}
