//! [`LeaseHandle`]: a shareable, read-only view of a [`Lease`].

use super::*;

/// A shareable, read-only view of a [`Lease`]: its resource, fencing token, validity
/// and lost signal. Holding a handle does not keep the lease alive.
#[derive(Clone)]
pub struct LeaseHandle {
    pub(super) inner: Arc<LeaseInner>,
}

impl LeaseHandle {
    /// The lease's state, for the outcome records (`lock/record/`).
    pub(crate) fn lease_inner(&self) -> &LeaseInner {
        &self.inner
    }

    /// The resource this lease holds; for a lease over several resources (see
    /// [`Redlock::try_acquire_all`](crate::Redlock::try_acquire_all)), the first of
    /// [`resources`](LeaseHandle::resources).
    pub fn resource(&self) -> &Resource {
        self.inner.resource()
    }

    /// The fencing token: larger than the token of every earlier holder of the resource
    /// (0 for every lease of a locker built with
    /// [`LockOptions::fencing(false)`](crate::LockOptions::fencing)). For a lease over
    /// several resources, the token of the first of
    /// [`resources`](LeaseHandle::resources); see
    /// [`fencing_token_of`](LeaseHandle::fencing_token_of) for the others.
    pub fn fencing_token(&self) -> FencingToken {
        self.inner.token()
    }

    /// How this lease shares its resource ([`Redlock::try_acquire_as`]); a lease over
    /// several resources is [`LockMode::Exclusive`].
    ///
    /// [`Redlock::try_acquire_as`]: crate::Redlock::try_acquire_as
    pub fn mode(&self) -> LockMode {
        self.inner.target.mode()
    }

    /// The lease's owner value, as stored in the lock key of the locker's first node;
    /// node `i` stores [`owner_on(i)`](LeaseHandle::owner_on) (see [`Owner::for_node`]).
    pub fn owner(&self) -> &str {
        self.inner.owner.as_str()
    }

    /// The owner value stored in the lock key of the locker's node `node`.
    pub fn owner_on(&self, node: usize) -> Owner {
        self.inner.owner.for_node(node)
    }

    /// Validity left on the monotonic clock: zero once lost, released or expired.
    /// Check it right before a side effect that must not happen without the lock.
    pub fn remaining(&self) -> Duration {
        let status = self.inner.status();
        if !status.live() {
            return Duration::ZERO;
        }
        status.valid_until.saturating_duration_since(Instant::now())
    }

    /// `true` while the lease is neither lost, released nor past its validity.
    pub fn is_held(&self) -> bool {
        !self.remaining().is_zero()
    }

    /// Why the lease was lost, if it was.
    pub fn lost_cause(&self) -> Option<LostCause> {
        self.inner.status().lost
    }

    /// Resolves when the lease is lost, with the cause; never resolves for a lease that
    /// is released before. Usable in `tokio::select!` around the critical section.
    pub async fn lost(&self) -> LostCause {
        let cell = &self.inner.status;
        let watched = self.inner.locker.options.watchdog;
        loop {
            // Listening before reading: a change between the read and the wait still
            // wakes us.
            let changed = cell.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let status = cell.get();
            if let Some(cause) = status.lost {
                return cause;
            }
            if status.released {
                std::future::pending::<()>().await;
            }
            if watched {
                // The watchdog marks the loss at the validity deadline.
                changed.await;
                continue;
            }
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep_until(status.valid_until) => {
                    let expired = cell.get().valid_until <= Instant::now();
                    if expired {
                        self.inner.mark_lost(LostCause::Expired);
                    }
                }
            }
        }
    }
}

impl fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("resource", self.inner.resource())
            .field("fencing_token", &self.inner.token())
            .field("remaining", &self.remaining())
            .field("lost", &self.inner.status().lost)
            .finish()
    }
}
