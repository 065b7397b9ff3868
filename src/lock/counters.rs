//! The counters a [`Redlock`](crate::Redlock) keeps, and their snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
pub(crate) struct Metrics {
    pub(crate) acquired: Counter,
    pub(crate) contended: Counter,
    pub(crate) unavailable: Counter,
    pub(crate) slow: Counter,
    pub(crate) waits: Counter,
    pub(crate) wakeups: Counter,
    pub(crate) renewals: Counter,
    pub(crate) renewal_failures: Counter,
    pub(crate) lost: Counter,
    pub(crate) released: Counter,
}

impl Metrics {
    pub(crate) fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            acquired: self.acquired.get(),
            contended: self.contended.get(),
            unavailable: self.unavailable.get(),
            too_slow: self.slow.get(),
            waits: self.waits.get(),
            wakeups: self.wakeups.get(),
            renewals: self.renewals.get(),
            renewal_failures: self.renewal_failures.get(),
            lost: self.lost.get(),
            released: self.released.get(),
        }
    }
}

/// Counters of a [`Redlock`](crate::Redlock) since it was built (see
/// [`Redlock::metrics`](crate::Redlock::metrics)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Leases granted.
    pub acquired: u64,
    /// Attempts that found the resource held.
    pub contended: u64,
    /// Attempts that found too few nodes answering.
    pub unavailable: u64,
    /// Attempts won by a majority too slowly.
    pub too_slow: u64,
    /// Acquire calls that had to wait.
    pub waits: u64,
    /// Retries triggered by a release notification.
    pub wakeups: u64,
    /// Successful renewals.
    pub renewals: u64,
    /// Renewal rounds that did not reach a majority.
    pub renewal_failures: u64,
    /// Leases lost.
    pub lost: u64,
    /// Leases released (explicitly or by drop).
    pub released: u64,
}
