//! The watchdog: renews a held lease every third of its ttl, and declares it lost when
//! the validity runs out before a renewal succeeds. It holds no reference that keeps
//! the lease alive and stops as soon as the lease is released or dropped.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::lock::lease::{ExtendFailure, LeaseInner, LostCause};
use crate::lock::metrics;

/// Starts the watchdog of a fresh lease; dropping the returned sender stops it.
pub(crate) fn spawn(inner: Arc<LeaseInner>) -> oneshot::Sender<()> {
    let (stop, stopped) = oneshot::channel();
    let runtime = inner.locker.runtime.clone();
    metrics::spawn(&runtime, async move {
        tokio::select! {
            _ = stopped => {}
            () = renew(&inner) => {}
        }
    });
    stop
}

async fn renew(inner: &LeaseInner) {
    let options = &inner.locker.options;
    let validity = options.ttl.saturating_sub(options.drift());
    // After a failed round, try again soon: the lease is only lost at the deadline.
    let retry_every =
        (options.ttl / 30).clamp(Duration::from_millis(10), Duration::from_millis(500));
    let hold_until = options.max_hold.map(|max| inner.acquired_at + max);
    loop {
        let status = inner.status();
        if status.lost.is_some() || status.released {
            return;
        }
        let deadline = status.valid_until;
        // Renew when a third of the validity is used up, less a random twelfth: leases
        // taken together (a burst of requests) must not renew in lockstep forever,
        // sending every node thousands of extends in the same instant.
        let left = validity.mul_f64(2.0 / 3.0 + rand::random::<f64>() / 12.0);
        let renew_at = deadline
            .checked_sub(left)
            .unwrap_or(deadline)
            .max(Instant::now());
        tokio::time::sleep_until(renew_at).await;
        if hold_until.is_some_and(|until| Instant::now() + options.ttl > until) {
            tokio::time::sleep_until(deadline).await;
            inner.mark_lost(LostCause::MaxHoldReached);
            return;
        }
        loop {
            match tokio::time::timeout_at(deadline, inner.extend(deadline)).await {
                Ok(Ok(_)) => break,
                Ok(Err(ExtendFailure::KeyLost)) => {
                    inner.mark_lost(LostCause::KeyLost);
                    return;
                }
                Ok(Err(ExtendFailure::NoQuorum)) => {
                    let next = Instant::now() + retry_every;
                    if next >= deadline {
                        tokio::time::sleep_until(deadline).await;
                        inner.mark_lost(LostCause::RenewalFailed);
                        return;
                    }
                    tokio::time::sleep_until(next).await;
                }
                Err(_) => {
                    inner.mark_lost(LostCause::RenewalFailed);
                    return;
                }
            }
        }
    }
}
