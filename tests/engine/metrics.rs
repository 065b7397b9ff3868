//! Every metric of the `metrics` feature moves when it should: a debugging recorder is
//! installed for the test's thread only (`set_default_local_recorder`; the tests run on
//! current-thread runtimes, so spawned tasks such as the watchdog record into it too),
//! and the paths are driven with the test kit, over in-process nodes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::node_calls::diverge_counters;
use axum::{body::Body, routing::post, Router};
use http::{Request, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::oneshot;
use tower::ServiceExt;
use tower_redlock::http::{key::header, replay::Replay, LockLayer};
use tower_redlock::test_util::TestStore;
use tower_redlock::{LockError, LockMode, LockOptions, Resource};

// The names of the table in `tower_redlock::metrics`, spelled out as a dashboard would.
const ACQUISITIONS: &str = "tower_redlock_acquisitions_total";
const ACQUIRE_DURATION: &str = "tower_redlock_acquire_duration_seconds";
const HOLD_DURATION: &str = "tower_redlock_hold_duration_seconds";
const LEASES_LOST: &str = "tower_redlock_leases_lost_total";
const RENEWALS: &str = "tower_redlock_renewals_total";
const NODE_ERRORS: &str = "tower_redlock_node_errors_total";
const WAITERS: &str = "tower_redlock_waiters";
const HTTP_REFUSALS: &str = "tower_redlock_http_refusals_total";
const HTTP_REPLAYS: &str = "tower_redlock_http_replays_total";

/// What the recorder saw so far. The debugging recorder's snapshots drain counters,
/// gauges and histograms alike, so every read is added up here.
struct Seen {
    snapshotter: Snapshotter,
    values: HashMap<(String, Vec<(String, String)>), Value>,
}

#[derive(Debug, Default, Clone)]
struct Value {
    count: u64,
    gauge: f64,
    samples: Vec<f64>,
}

impl Seen {
    fn new(recorder: &DebuggingRecorder) -> Self {
        Seen {
            snapshotter: recorder.snapshotter(),
            values: HashMap::new(),
        }
    }

    fn read(&mut self) {
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            let entry = self
                .values
                .entry((key.name().to_owned(), labels))
                .or_default();
            match value {
                DebugValue::Counter(n) => entry.count += n,
                DebugValue::Gauge(g) => entry.gauge += g.into_inner(),
                DebugValue::Histogram(xs) => entry.samples.extend(xs.iter().map(|x| x.0)),
            }
        }
    }

    fn get(&mut self, name: &str, labels: &[(&str, &str)]) -> Value {
        self.read();
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.sort();
        self.values
            .get(&(name.to_owned(), labels))
            .cloned()
            .unwrap_or_default()
    }

    fn count(&mut self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.get(name, labels).count
    }

    /// Every label set seen under `name`.
    fn label_sets(&mut self, name: &str) -> Vec<Vec<(String, String)>> {
        self.read();
        self.values
            .keys()
            .filter(|(n, _)| n == name)
            .map(|(_, labels)| labels.clone())
            .collect()
    }
}

/// Lets the spawned tasks run (on the test's current-thread runtime) until `done`;
/// fails instead of hanging when they never get there.
async fn settle(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never happened: {what}");
}

fn no_watchdog() -> LockOptions {
    LockOptions::default().watchdog(false)
}

#[tokio::test(start_paused = true)]
async fn acquisitions_by_outcome_with_their_durations() {
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut seen = Seen::new(&recorder);
    let store = TestStore::new();
    let locker = store.locker();

    let lease = locker.try_acquire("order:1").await.unwrap();
    assert_eq!(seen.count(ACQUISITIONS, &[("outcome", "acquired")]), 1);
    assert!(matches!(
        locker.try_acquire("order:1").await,
        Err(LockError::Held { .. })
    ));
    assert_eq!(seen.count(ACQUISITIONS, &[("outcome", "held")]), 1);

    // Waiting counts as acquire time: the paused clock moves exactly by the timeout.
    let timeout = Duration::from_millis(300);
    assert!(matches!(
        locker.acquire("order:1", timeout).await,
        Err(LockError::WaitTimeout { .. })
    ));
    let waited = seen.get(ACQUIRE_DURATION, &[("outcome", "timeout")]);
    assert_eq!(waited.samples.len(), 1);
    assert!(waited.samples[0] >= timeout.as_secs_f64(), "{waited:?}");
    assert_eq!(seen.count(ACQUISITIONS, &[("outcome", "timeout")]), 1);

    // A full queue: one caller waits, a second one finds no room.
    let one_waiter = locker.with_max_waiters(1);
    let waiting = tokio::spawn({
        let locker = one_waiter.clone();
        async move { locker.acquire("order:1", Duration::from_secs(60)).await }
    });
    settle("one waiter", || seen.get(WAITERS, &[]).gauge >= 1.0).await;
    assert!(matches!(
        one_waiter.acquire("order:1", Duration::from_secs(1)).await,
        Err(LockError::QueueFull { .. })
    ));
    assert_eq!(seen.count(ACQUISITIONS, &[("outcome", "queue_full")]), 1);
    drop(lease);
    let next = waiting.await.unwrap().unwrap();
    assert_eq!(seen.count(ACQUISITIONS, &[("outcome", "acquired")]), 2);
    assert_eq!(
        seen.get(ACQUIRE_DURATION, &[("outcome", "acquired")])
            .samples
            .len(),
        2
    );
    drop(next);

    store.set_available(false);
    assert!(matches!(
        locker.try_acquire("order:2").await,
        Err(LockError::Unavailable { .. })
    ));
    assert_eq!(seen.count(ACQUISITIONS, &[("outcome", "unavailable")]), 1);
    store.set_available(true);

    // Held in another mode: an error of no outcome of its own.
    let shared = locker
        .try_acquire_as("order:3", LockMode::Shared)
        .await
        .unwrap();
    assert!(matches!(
        locker
            .try_acquire_as("order:3", LockMode::counted(2).unwrap())
            .await,
        Err(LockError::ModeMismatch { .. })
    ));
    assert_eq!(seen.count(ACQUISITIONS, &[("outcome", "error")]), 1);
    drop(shared);

    // Acquire and fence write-back each answer in time, together too late.
    let slow = TestStore::with_nodes(
        3,
        LockOptions::default()
            .ttl(Duration::from_millis(200))
            .node_timeout(Duration::from_millis(150)),
    )
    .unwrap();
    diverge_counters(slow.nodes(), "order:4");
    slow.set_delay(Duration::from_millis(97));
    assert!(matches!(
        slow.locker().try_acquire("order:4").await,
        Err(LockError::ValidityExpired { .. })
    ));
    assert_eq!(
        seen.count(ACQUISITIONS, &[("outcome", "validity_expired")]),
        1
    );
    for outcome in ["validity_expired", "error"] {
        let durations = seen.get(ACQUIRE_DURATION, &[("outcome", outcome)]);
        assert_eq!(durations.samples.len(), 1, "{outcome}");
    }
    // Only the listed outcomes, never a resource name.
    for labels in seen.label_sets(ACQUISITIONS) {
        assert_eq!(labels.len(), 1);
        assert!([
            "acquired",
            "held",
            "timeout",
            "queue_full",
            "unavailable",
            "validity_expired",
            "draining",
            "error"
        ]
        .contains(&labels[0].1.as_str()));
    }
}

#[tokio::test(start_paused = true)]
async fn waiters_gauge_counts_callers_inside_acquire() {
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut seen = Seen::new(&recorder);
    let store = TestStore::new();
    let locker = store.locker();

    let lease = locker.try_acquire("r").await.unwrap();
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let locker = locker.clone();
            tokio::spawn(async move { locker.acquire("r", Duration::from_secs(60)).await })
        })
        .collect();
    settle("three waiters", || seen.get(WAITERS, &[]).gauge >= 3.0).await;
    drop(lease);
    for waiter in waiters {
        drop(waiter.await.unwrap().unwrap());
    }
    assert_eq!(seen.get(WAITERS, &[]).gauge, 0.0);
}

#[tokio::test(start_paused = true)]
async fn hold_durations_losses_and_renewals() {
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut seen = Seen::new(&recorder);
    let store = TestStore::with_nodes(1, no_watchdog()).unwrap();
    let locker = store.locker();

    let lease = locker.try_acquire("a").await.unwrap();
    tokio::time::advance(Duration::from_millis(1500)).await;
    lease.extend().await.unwrap();
    assert_eq!(seen.count(RENEWALS, &[("outcome", "renewed")]), 1);
    lease.release().await;
    let held = seen.get(HOLD_DURATION, &[]);
    assert_eq!(held.samples.len(), 1);
    assert!(held.samples[0] >= 1.5, "{held:?}");

    let lease = locker.try_acquire("b").await.unwrap();
    store.set_available(false);
    assert!(lease.extend().await.is_err());
    assert_eq!(seen.count(RENEWALS, &[("outcome", "no_quorum")]), 1);
    store.set_available(true);

    store.lose("b").unwrap();
    assert_eq!(seen.count(LEASES_LOST, &[("cause", "key_lost")]), 1);
    drop(lease);

    // The key deleted behind the lease's back: the next extend finds it gone.
    let lease = locker.try_acquire("c").await.unwrap();
    for node in store.nodes() {
        node.clear();
    }
    assert!(lease.extend().await.is_err());
    assert_eq!(seen.count(RENEWALS, &[("outcome", "key_lost")]), 1);
    assert_eq!(seen.count(LEASES_LOST, &[("cause", "key_lost")]), 2);

    // Without the watchdog, a lease nobody renews expires.
    let lease = locker.try_acquire("d").await.unwrap();
    assert_eq!(lease.lost().await, tower_redlock::LostCause::Expired);
    assert_eq!(seen.count(LEASES_LOST, &[("cause", "expired")]), 1);
}

#[tokio::test(start_paused = true)]
async fn node_errors_by_node_and_kind() {
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut seen = Seen::new(&recorder);
    let store = TestStore::with_nodes(3, LockOptions::default()).unwrap();
    let locker = store.locker();

    store.node(0).unwrap().set_available(false);
    let lease = locker.try_acquire("x").await.unwrap();
    assert_eq!(
        seen.count(NODE_ERRORS, &[("node", "memory"), ("error", "connection")]),
        1
    );
    // A slow node: its call times out.
    store.node(0).unwrap().set_available(true);
    store.node(1).unwrap().set_delay(Duration::from_secs(1));
    lease.release().await;
    assert_eq!(
        seen.count(NODE_ERRORS, &[("node", "memory"), ("error", "timeout")]),
        1
    );
}

async fn pay() -> &'static str {
    "paid"
}

fn post_with_key(key: &str) -> Request<Body> {
    let request = Request::post("/pay");
    let request = if key.is_empty() {
        request
    } else {
        request.header("Idempotency-Key", key)
    };
    request.body(Body::empty()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn http_refusals_by_problem_code() {
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut seen = Seen::new(&recorder);
    let store = TestStore::new();
    let (entered_tx, entered) = oneshot::channel::<()>();
    let entered_tx = Arc::new(Mutex::new(Some(entered_tx)));
    let slow = move || {
        if let Some(tx) = entered_tx.lock().unwrap().take() {
            let _ = tx.send(());
        }
        std::future::pending::<&'static str>()
    };
    let app = Router::new()
        .route("/pay", post(pay))
        .route("/slow", post(slow))
        .route_layer(LockLayer::new(store.locker(), header("Idempotency-Key")).name("payments"));

    let missing = app.clone().oneshot(post_with_key("")).await.unwrap();
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        seen.count(
            HTTP_REFUSALS,
            &[("problem", "key-missing"), ("layer", "payments")]
        ),
        1
    );

    let order = Resource::new("POST").join("/pay").join("k1");
    store
        .hold(order.clone(), Duration::from_secs(5))
        .await
        .unwrap();
    let held = app.clone().oneshot(post_with_key("k1")).await.unwrap();
    assert_eq!(held.status(), StatusCode::CONFLICT);
    assert_eq!(
        seen.count(
            HTTP_REFUSALS,
            &[("problem", "lock-held"), ("layer", "payments")]
        ),
        1
    );
    store.release(order).await.unwrap();

    store.set_available(false);
    let down = app.clone().oneshot(post_with_key("k1")).await.unwrap();
    assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        seen.count(
            HTTP_REFUSALS,
            &[("problem", "lock-unavailable"), ("layer", "payments")]
        ),
        1
    );
    store.set_available(true);

    let request = Request::post("/slow")
        .header("Idempotency-Key", "k2")
        .body(Body::empty())
        .unwrap();
    let running = tokio::spawn(app.clone().oneshot(request));
    entered.await.unwrap();
    store
        .lose(Resource::new("POST").join("/slow").join("k2"))
        .unwrap();
    let lost = running.await.unwrap().unwrap();
    assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        seen.count(
            HTTP_REFUSALS,
            &[("problem", "lock-lost"), ("layer", "payments")]
        ),
        1
    );

    assert_eq!(
        app.oneshot(post_with_key("k3")).await.unwrap().status(),
        StatusCode::OK
    );
    for labels in seen.label_sets(HTTP_REFUSALS) {
        let names: Vec<&str> = labels.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["layer", "problem"]);
    }
}

#[tokio::test(start_paused = true)]
async fn replay_outcomes() {
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut seen = Seen::new(&recorder);
    let store = TestStore::new();
    let app = Router::new().route(
        "/pay",
        post(|body: String| async move { format!("paid {body}") }).layer(
            LockLayer::new(store.locker(), header("Idempotency-Key")).replay(Replay::global()),
        ),
    );
    let pay = |body: &'static str| {
        Request::post("/pay")
            .header("Idempotency-Key", "once")
            .body(Body::from(body))
            .unwrap()
    };

    assert_eq!(
        app.clone().oneshot(pay("10")).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(seen.count(HTTP_REPLAYS, &[("outcome", "recorded")]), 1);
    let again = app.clone().oneshot(pay("10")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(seen.count(HTTP_REPLAYS, &[("outcome", "replayed")]), 1);
    let other = app.oneshot(pay("20")).await.unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(seen.count(HTTP_REPLAYS, &[("outcome", "key-reused")]), 1);
    assert_eq!(
        seen.count(
            HTTP_REFUSALS,
            &[("problem", "idempotency-key-reused"), ("layer", "")]
        ),
        1
    );
}

/// Building a locker describes the metrics (no call of the application's needed).
#[tokio::test]
async fn descriptions_name_every_metric_with_units() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let _locker = TestStore::new().locker();
    metrics::histogram!(ACQUIRE_DURATION).record(0.5);
    let described = snapshotter.snapshot().into_vec();
    let (_, unit, description, _) = described
        .iter()
        .find(|(key, ..)| key.key().name() == ACQUIRE_DURATION)
        .unwrap();
    assert_eq!(*unit, Some(metrics::Unit::Seconds));
    assert!(description.is_some());
}

/// A scrape before anything happened lists every series at zero, with its `# HELP`:
/// building the locker and the layers registers them.
#[tokio::test]
async fn a_scrape_before_the_first_request_shows_every_series_at_zero() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let store = TestStore::with_nodes(3, LockOptions::default()).unwrap();
    let _layer = LockLayer::new(store.locker(), header("Idempotency-Key")).replay(Replay::global());
    let scrape = handle.render();

    for line in [
        "# HELP tower_redlock_acquisitions_total Lock acquire calls, by outcome.",
        "tower_redlock_acquisitions_total{outcome=\"acquired\"} 0",
        "tower_redlock_acquisitions_total{outcome=\"unavailable\"} 0",
        "tower_redlock_acquire_duration_seconds_count{outcome=\"acquired\"} 0",
        "tower_redlock_hold_duration_seconds_count 0",
        "tower_redlock_leases_lost_total{cause=\"renewal_failed\"} 0",
        "tower_redlock_renewals_total{outcome=\"no_quorum\"} 0",
        "tower_redlock_waiters 0",
        "tower_redlock_http_refusals_total{problem=\"lock-held\",layer=\"\"} 0",
        "tower_redlock_http_refusals_total{problem=\"lock-unavailable\",layer=\"\"} 0",
        "tower_redlock_http_handlers_finishing 0",
        "tower_redlock_http_replays_total{outcome=\"not-recorded\"} 0",
    ] {
        assert!(
            scrape.lines().any(|l| l == line),
            "no `{line}` in:\n{scrape}"
        );
    }
    // One series per node and error kind (the in-process nodes are all `memory`).
    for error in ["timeout", "connection", "server", "protocol", "unsupported"] {
        let line =
            format!("tower_redlock_node_errors_total{{node=\"memory\",error=\"{error}\"}} 0");
        assert!(
            scrape.lines().any(|l| l == line),
            "no `{line}` in:\n{scrape}"
        );
    }
}
