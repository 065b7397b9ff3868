//! What the crate records through the [`metrics`](https://docs.rs/metrics/0.24) facade,
//! with the `metrics` feature. The application installs the recorder (a Prometheus
//! exporter, StatsD, …); without one, or without the feature, nothing is recorded and
//! the calls below compile to nothing.
//!
//! Names and units follow the Prometheus conventions (`_total` counters, `_seconds`
//! histograms). Labels are bounded: never a resource, a key or a URL with credentials,
//! only the values listed here (and node names, which are the addresses a locker was
//! built with, without passwords).
//!
//! | metric | type | labels | what it counts | when to alert |
//! |---|---|---|---|---|
//! | `tower_redlock_acquisitions_total` | counter | `outcome`: `acquired`, `held`, `timeout`, `unavailable`, `validity_expired`, `queue_full`, `draining` | calls of [`try_acquire`](crate::Redlock::try_acquire) and [`acquire`](crate::Redlock::acquire) (so every locked request), by how they ended | a rising share of `unavailable` or `validity_expired` (the store, or the network to it, is failing); `held`/`timeout` is contention, alert only on a change from the usual rate |
//! | `tower_redlock_acquire_duration_seconds` | histogram | `outcome` (as above) | time from the call to its answer, **including time spent waiting** for another holder | p99 of `acquired` far above one round trip: requests queue behind each other |
//! | `tower_redlock_hold_duration_seconds` | histogram | — | time from acquisition to release, per lease (released, dropped or lost) | holds near the `max_hold` or ttl: handlers run longer than the lease was sized for |
//! | `tower_redlock_leases_lost_total` | counter | `cause`: `renewal_failed`, `key_lost`, `max_hold_reached`, `expired`, `drained` | leases lost while held | any increase: a handler ran (or may still run) without the lock; the fencing token is then the only guard |
//! | `tower_redlock_renewals_total` | counter | `outcome`: `renewed`, `no_quorum`, `key_lost` | extend rounds (the watchdog's and [`Lease::extend`](crate::Lease::extend)'s) | `no_quorum` or `key_lost` rising: leases are about to be lost |
//! | `tower_redlock_node_errors_total` | counter | `node` (the node's name), `error`: `timeout`, `connection`, `server`, `protocol`, `unsupported` | node calls that failed, per node | one node's rate rising: it is down or slow (the quorum still answers); several: outage ahead |
//! | `tower_redlock_waiters` | gauge | — | callers of this process inside [`acquire`](crate::Redlock::acquire) (queued, or contending at the nodes), over every locker | a level that keeps growing: requests pile up behind held resources |
//! | `tower_redlock_http_refusals_total` | counter | `problem`: the [problem code](crate::http::problem) (`lock-held`, `lock-wait-timeout`, `lock-unavailable`, `lock-queue-full`, `lock-lost`, `key-missing`, `key-invalid`, …); `layer`: the layer's [`name`](crate::http::LockLayer::name) (empty when unnamed, and for the `Locked` extractor) | requests the [`LockLayer`](crate::http::LockLayer) answered with a problem instead of the handler's response | `lock-unavailable` or `lock-lost` above zero; `key-missing`/`key-invalid` rising: a client sends bad requests |
//! | `tower_redlock_http_handlers_finishing` | gauge | — | handlers that run on under their lease after their client left ([`OnDisconnect::Finish`](crate::http::OnDisconnect::Finish)) | a level that keeps growing: clients give up before handlers finish (their timeouts are shorter than the handlers) |
//! | `tower_redlock_http_replays_total` | counter | `outcome`: `replayed`, `key-reused`, `recorded`, `not-recorded` | [idempotent replay](crate::http::replay): responses replayed, keys reused for another request, responses recorded or not | `not-recorded` rising: the store failed after the handler ran, retries will run the handler again |
//!
//! Every series is described and registered at zero when it can first move: the
//! engine's when a locker is built (per node for `node_errors_total`), the layer's
//! when a [`LockLayer`](crate::http::LockLayer) is built (`http_replays_total` with
//! [`replay`](crate::http::LockLayer::replay)). So a scrape before the first request already
//! lists them, as Prometheus expects: install the recorder before building either.
//!
//! The per-locker counters of [`Redlock::metrics`](crate::Redlock::metrics) are
//! always kept, with or without this feature, and so is [`tasks_spawned`]: the
//! background tasks the engine started, for benchmarks that count client work per
//! acquisition.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::NodeError;
use crate::lock::{LockError, LostCause};

// The names of the table above; private, as tests/engine/metrics.rs reads them back
// from a recorder by their literal names.
#[cfg(feature = "metrics")]
mod names {
    pub(super) const ACQUISITIONS: &str = "tower_redlock_acquisitions_total";
    pub(super) const ACQUIRE_DURATION: &str = "tower_redlock_acquire_duration_seconds";
    pub(super) const HOLD_DURATION: &str = "tower_redlock_hold_duration_seconds";
    pub(super) const LEASES_LOST: &str = "tower_redlock_leases_lost_total";
    pub(super) const RENEWALS: &str = "tower_redlock_renewals_total";
    pub(super) const NODE_ERRORS: &str = "tower_redlock_node_errors_total";
    pub(super) const WAITERS: &str = "tower_redlock_waiters";
    pub(super) const HTTP_REFUSALS: &str = "tower_redlock_http_refusals_total";
    pub(super) const HTTP_REPLAYS: &str = "tower_redlock_http_replays_total";
    pub(super) const HTTP_HANDLERS_FINISHING: &str = "tower_redlock_http_handlers_finishing";
}
#[cfg(feature = "metrics")]
use names::*;

/// Registers the descriptions and units with the installed recorder, so exporters
/// print `# HELP` lines; done where the series are registered at zero.
#[cfg(feature = "metrics")]
fn describe() {
    use ::metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(ACQUISITIONS, "Lock acquire calls, by outcome.");
    describe_histogram!(
        ACQUIRE_DURATION,
        Unit::Seconds,
        "Time to acquire a lock, including waiting, by outcome."
    );
    describe_histogram!(HOLD_DURATION, Unit::Seconds, "Time leases were held.");
    describe_counter!(LEASES_LOST, "Leases lost while held, by cause.");
    describe_counter!(RENEWALS, "Lease extend rounds, by outcome.");
    describe_gauge!(
        HTTP_HANDLERS_FINISHING,
        "Handlers running to their end under their lease after their client left."
    );
    describe_counter!(NODE_ERRORS, "Failed lock node calls, by node and error.");
    describe_gauge!(
        WAITERS,
        "Callers of this process waiting to acquire a lock."
    );
    describe_counter!(
        HTTP_REFUSALS,
        "Requests refused by the lock layer, by problem code."
    );
    describe_counter!(HTTP_REPLAYS, "Idempotent replay outcomes.");
}

/// The `outcome` labels of [`ACQUISITIONS`] and [`ACQUIRE_DURATION`].
#[cfg(feature = "metrics")]
const ACQUIRE_OUTCOMES: [&str; 7] = [
    "acquired",
    "held",
    "timeout",
    "unavailable",
    "validity_expired",
    "queue_full",
    "draining",
];
/// The `cause` labels of [`LEASES_LOST`].
#[cfg(feature = "metrics")]
const LOST_CAUSES: [(LostCause, &str); 5] = [
    (LostCause::RenewalFailed, "renewal_failed"),
    (LostCause::KeyLost, "key_lost"),
    (LostCause::MaxHoldReached, "max_hold_reached"),
    (LostCause::Expired, "expired"),
    (LostCause::Drained, "drained"),
];
/// The `outcome` labels of [`RENEWALS`].
#[cfg(feature = "metrics")]
const RENEWAL_OUTCOMES: [&str; 3] = ["renewed", "no_quorum", "key_lost"];
/// The `error` labels of [`NODE_ERRORS`].
#[cfg(feature = "metrics")]
const NODE_ERROR_KINDS: [&str; 5] = ["timeout", "connection", "server", "protocol", "unsupported"];
/// The `outcome` labels of [`HTTP_REPLAYS`].
#[cfg(feature = "metrics")]
const REPLAY_OUTCOMES: [&str; 4] = ["replayed", "key-reused", "recorded", "not-recorded"];

/// Describes the engine's series and registers each one at zero (every documented
/// label value, every node), so that a scrape before the first acquisition already
/// shows them: Prometheus's `rate()` and alerts on `increase()` need the zero before
/// the first event. Called when a locker is built; the recorder must be installed
/// before.
pub(crate) fn engine_series<'a>(nodes: impl IntoIterator<Item = &'a str>) {
    let _ = nodes;
    #[cfg(feature = "metrics")]
    {
        describe();
        for outcome in ACQUIRE_OUTCOMES {
            ::metrics::counter!(ACQUISITIONS, "outcome" => outcome).increment(0);
            // Registered, not recorded: an exporter shows it with a count of zero.
            let _ = ::metrics::histogram!(ACQUIRE_DURATION, "outcome" => outcome);
        }
        let _ = ::metrics::histogram!(HOLD_DURATION);
        for (_, cause) in LOST_CAUSES {
            ::metrics::counter!(LEASES_LOST, "cause" => cause).increment(0);
        }
        for outcome in RENEWAL_OUTCOMES {
            ::metrics::counter!(RENEWALS, "outcome" => outcome).increment(0);
        }
        for node in nodes {
            for error in NODE_ERROR_KINDS {
                ::metrics::counter!(NODE_ERRORS, "node" => node.to_owned(), "error" => error)
                    .increment(0);
            }
        }
        // Moved by zero, not set: other lockers of the process may have waiters.
        ::metrics::gauge!(WAITERS).increment(0.0);
    }
}

/// As [`engine_series`], for the layer's series: refusals by every problem code in
/// `codes`, the handlers finishing, and replay's outcomes when `replay` is on.
pub(crate) fn http_series(
    codes: impl IntoIterator<Item = &'static str>,
    replay: bool,
    layer: &str,
) {
    let _ = (&codes, replay, layer);
    #[cfg(feature = "metrics")]
    {
        describe();
        for code in codes {
            ::metrics::counter!(HTTP_REFUSALS, "problem" => code, "layer" => layer.to_owned())
                .increment(0);
        }
        ::metrics::gauge!(HTTP_HANDLERS_FINISHING).increment(0.0);
        if replay {
            for outcome in REPLAY_OUTCOMES {
                ::metrics::counter!(HTTP_REPLAYS, "outcome" => outcome).increment(0);
            }
        }
    }
}

/// When an acquire call started: the clock is read only when the metrics record it.
pub(crate) fn started() -> Option<tokio::time::Instant> {
    cfg!(feature = "metrics").then(tokio::time::Instant::now)
}

/// Records one acquire call that started at `started` (see [`started`]).
#[inline]
pub(crate) fn acquisition<T>(result: &Result<T, LockError>, started: Option<tokio::time::Instant>) {
    let _ = (result, started);
    #[cfg(feature = "metrics")]
    {
        let elapsed = started.map_or(std::time::Duration::ZERO, |at| at.elapsed());
        // Literal names and labels make static keys: a key built per call (from
        // `acquire_outcome`) costs an allocation and a hash on every acquisition.
        macro_rules! record {
            ($outcome:literal) => {{
                ::metrics::counter!("tower_redlock_acquisitions_total", "outcome" => $outcome)
                    .increment(1);
                ::metrics::histogram!("tower_redlock_acquire_duration_seconds", "outcome" => $outcome)
                    .record(elapsed);
            }};
        }
        match result {
            Ok(_) => record!("acquired"),
            Err(LockError::Held { .. }) => record!("held"),
            Err(LockError::WaitTimeout { .. }) => record!("timeout"),
            Err(LockError::Unavailable { .. }) => record!("unavailable"),
            Err(LockError::ValidityExpired { .. }) => record!("validity_expired"),
            Err(LockError::QueueFull { .. }) => record!("queue_full"),
            Err(LockError::Draining { .. }) => record!("draining"),
            Err(_) => record!("error"),
        }
    }
}

/// Records the end of a lease acquired at `acquired_at`.
#[inline]
pub(crate) fn hold(acquired_at: tokio::time::Instant) {
    let _ = acquired_at;
    #[cfg(feature = "metrics")]
    ::metrics::histogram!("tower_redlock_hold_duration_seconds").record(acquired_at.elapsed());
}

/// Records a lease lost for `cause`.
#[inline]
pub(crate) fn lost(cause: LostCause) {
    let _ = cause;
    #[cfg(feature = "metrics")]
    {
        let label = LOST_CAUSES
            .iter()
            .find(|(c, _)| *c == cause)
            .map_or("", |(_, l)| l);
        ::metrics::counter!(LEASES_LOST, "cause" => label).increment(1);
    }
}

/// Records one extend round: `renewed`, `no_quorum` or `key_lost`.
#[inline]
pub(crate) fn renewal(outcome: &'static str) {
    let _ = outcome;
    #[cfg(feature = "metrics")]
    ::metrics::counter!(RENEWALS, "outcome" => outcome).increment(1);
}

/// The `error` label of a node error.
#[cfg(feature = "metrics")]
pub(crate) fn node_error_kind(error: &NodeError) -> &'static str {
    match error {
        NodeError::Timeout(_) => "timeout",
        NodeError::Connection(_) => "connection",
        NodeError::Server(_) => "server",
        NodeError::Protocol(_) => "protocol",
        NodeError::Unsupported(_) => "unsupported",
    }
}

/// Counts a failed call to the node named `node`, also one that finishes in the
/// background after its round was decided (a slow node's timeouts come last).
#[inline]
pub(crate) fn node_error(node: &str, error: &NodeError) {
    let _ = (node, error);
    #[cfg(feature = "metrics")]
    ::metrics::counter!(
        NODE_ERRORS,
        "node" => node.to_owned(),
        "error" => node_error_kind(error)
    )
    .increment(1);
}

/// Moves the waiters gauge by `delta` (one caller entering or leaving `acquire`).
#[inline]
pub(crate) fn waiters(delta: f64) {
    let _ = delta;
    #[cfg(feature = "metrics")]
    ::metrics::gauge!(WAITERS).increment(delta);
}

/// Moves the gauge of handlers finishing after their client left by `delta`.
#[inline]
pub(crate) fn handlers_finishing(delta: f64) {
    let _ = delta;
    #[cfg(feature = "metrics")]
    ::metrics::gauge!(HTTP_HANDLERS_FINISHING).increment(delta);
}

/// Records a request refused with the problem `code` by the layer named `layer`
/// (empty: unnamed, or the `Locked` extractor).
#[inline]
pub(crate) fn refusal(code: &'static str, layer: Option<&std::sync::Arc<str>>) {
    let _ = (code, layer);
    #[cfg(feature = "metrics")]
    {
        let layer: ::metrics::SharedString = layer.map_or("".into(), |name| name.clone().into());
        ::metrics::counter!(HTTP_REFUSALS, "problem" => code, "layer" => layer).increment(1);
    }
}

/// Records an idempotent replay outcome.
#[inline]
pub(crate) fn replay(outcome: &'static str) {
    let _ = outcome;
    #[cfg(feature = "metrics")]
    ::metrics::counter!(HTTP_REPLAYS, "outcome" => outcome).increment(1);
}

static TASKS_SPAWNED: AtomicU64 = AtomicU64::new(0);

/// Tokio tasks the lock engine has spawned in this process so far, over every locker
/// (the renewal of leases, releases, the calls that outlive a decided round). The
/// nodes' own connection and subscription tasks are not counted. Benchmarks read it
/// before and after a run to count tasks per acquisition.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let before = tower_redlock::metrics::tasks_spawned();
/// let locker = tower_redlock::Redlock::in_memory();
/// let lease = locker.try_acquire("r").await.unwrap();
/// lease.release().await;
/// let per_acquisition = tower_redlock::metrics::tasks_spawned() - before;
/// # let _ = per_acquisition;
/// # }
/// ```
pub fn tasks_spawned() -> u64 {
    TASKS_SPAWNED.load(Ordering::Relaxed)
}

/// Spawns `task` on `runtime`, counted by [`tasks_spawned`].
pub(crate) fn spawn<F>(
    runtime: &tokio::runtime::Handle,
    task: F,
) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    TASKS_SPAWNED.fetch_add(1, Ordering::Relaxed);
    runtime.spawn(task)
}
