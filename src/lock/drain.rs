//! Graceful shutdown: [`Redlock::drain`].

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::lease::{release, LeaseInner, LostCause};
use super::{Lease, LockError, Redlock};
use crate::Resource;

/// What [`Redlock::drain`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Leases still held at the deadline, marked lost and released by the drain.
    pub released_at_deadline: usize,
}

impl Redlock {
    /// Shuts this locker (and every clone of it) down gracefully, as a deploy does:
    ///
    /// 1. From now on no new lease is granted: `try_acquire`, `acquire` and their set
    ///    forms fail with [`LockError::Draining`] (the layer answers 503
    ///    `lock-unavailable` with `Retry-After`, so clients go to another instance).
    ///    So do the callers already waiting, woken at once: in this process's queue and
    ///    in the nodes' wait queues, which they leave, so no other instance waits for
    ///    them. A lease a node granted as the drain began is released, not handed over.
    /// 2. The leases held now — handlers in their critical section, including those
    ///    finishing after their client left — are given until `deadline` to end and be
    ///    released by their holders.
    /// 3. At the deadline, every lease still held is marked lost
    ///    ([`LostCause::Drained`]: under [`OnLost::Abort`](crate::http::OnLost::Abort) its
    ///    handler is stopped) and released on the nodes at once, so no key waits out
    ///    its ttl and no other instance answers 409 or waits for it.
    ///
    /// Call it after axum's graceful shutdown has answered the requests in flight: it
    /// waits for what runs on without a client (an example:
    /// [the operations guide](crate::guide::operations#shutting-down-drain)).
    pub async fn drain(&self, deadline: Duration) -> Drained {
        self.shared.draining.store(true, Ordering::Release);
        self.shared.drain_began.notify_waiters();
        let until = super::acquire::after(Instant::now(), deadline);
        loop {
            // Listening before looking: a release between the two still wakes us.
            let emptied = self.shared.queues.changed.notified();
            let mut emptied = std::pin::pin!(emptied);
            emptied.as_mut().enable();
            let held = self.held_now();
            if held.is_empty() {
                tracing::info!("drained: every lease of this locker was released by its holder");
                return Drained {
                    released_at_deadline: 0,
                };
            }
            if tokio::time::timeout_at(until, emptied).await.is_err() {
                break;
            }
        }
        let held = self.held_now();
        tracing::warn!(
            leases = held.len(),
            "drain deadline passed: releasing the leases still held"
        );
        let releases = held.iter().map(|inner| async move {
            inner.mark_lost(LostCause::Drained);
            release(inner).await
        });
        futures_util::future::join_all(releases).await;
        Drained {
            released_at_deadline: held.len(),
        }
    }

    /// Whether [`drain`](Redlock::drain) was called: then `Err` for `resource`.
    pub(crate) fn refuse_if_draining(&self, resource: &Resource) -> Result<(), LockError> {
        if self.shared.draining.load(Ordering::Acquire) {
            return Err(LockError::Draining {
                resource: resource.clone(),
            });
        }
        Ok(())
    }

    /// `acquire` (a waiting acquisition), unless a drain has begun or begins before it is
    /// granted: then [`LockError::Draining`]. The acquisition is dropped where it waits
    /// (it is cancellation-safe: it leaves the local and the nodes' queues).
    pub(crate) async fn unless_draining(
        &self,
        resource: &Resource,
        acquire: impl Future<Output = Result<Lease, LockError>>,
    ) -> Result<Lease, LockError> {
        // Listening before looking: a drain between the two still wakes us.
        let began = self.shared.drain_began.notified();
        let mut began = std::pin::pin!(began);
        began.as_mut().enable();
        self.refuse_if_draining(resource)?;
        let granted = tokio::select! {
            biased;
            () = began => Err(LockError::Draining {
                resource: resource.clone(),
            }),
            granted = acquire => granted,
        };
        self.unless_drained(granted).await
    }

    /// `granted`, unless a drain began meanwhile: its lease is then released, and
    /// [`LockError::Draining`]. A drain that looks for the leases held after this
    /// check finds this one (it was recorded as held before).
    pub(crate) async fn unless_drained(
        &self,
        granted: Result<Lease, LockError>,
    ) -> Result<Lease, LockError> {
        let lease = granted?;
        match self.refuse_if_draining(&lease.resources()[0]) {
            Ok(()) => Ok(lease),
            Err(draining) => {
                lease.release().await;
                Err(draining)
            }
        }
    }

    /// The leases of this locker held in this process now, each once (a set's lease
    /// holds several resources).
    fn held_now(&self) -> Vec<Arc<LeaseInner>> {
        let mut held = self.shared.queues.holders();
        held.sort_by_key(|inner| Arc::as_ptr(inner) as usize);
        held.dedup_by(|a, b| Arc::ptr_eq(a, b));
        held
    }
}
