//! The counters a [`Redlock`](crate::Redlock) keeps, and their snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// Writes the live counters and their public snapshot from one list, so a counter
/// cannot be kept and never reported.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        #[derive(Default)]
        pub(crate) struct Metrics {
            $(pub(crate) $name: Counter,)*
        }

        impl Metrics {
            pub(crate) fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot {
                    $($name: self.$name.0.load(Ordering::Relaxed),)*
                }
            }
        }

        /// Counters of a [`Redlock`](crate::Redlock) since it was built (see
        /// [`Redlock::metrics`](crate::Redlock::metrics)).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct MetricsSnapshot {
            $($(#[doc = $doc])* pub $name: u64,)*
        }
    };
}

counters! {
    /// Leases granted.
    acquired,
    /// Attempts that found the resource held.
    contended,
    /// Attempts that found too few nodes answering.
    unavailable,
    /// Attempts won by a majority too slowly.
    too_slow,
    /// Acquire calls that had to wait.
    waits,
    /// Retries triggered by a release notification.
    wakeups,
    /// Successful renewals.
    renewals,
    /// Renewal rounds that did not reach a majority.
    renewal_failures,
    /// Leases lost.
    lost,
    /// Leases released (explicitly or by drop).
    released,
}
