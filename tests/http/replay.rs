//! Idempotent replay (`LockLayer::replay`) end to end: a real axum `Router` driven with
//! `ServiceExt::oneshot`, over `MemoryNode`, one real `redis-server` and three.
//!
//! No sleeps sequence anything: handlers report with `Notify`s and wait on `watch`
//! gates; expiries and effects on the nodes are observed with `support::eventually`,
//! always with a bound that is reached only when a test fails. No timing is asserted.
use crate::support;

// The demo's router, as it is served (`cargo run --example orders`).
use crate::orders_example as orders;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use support::{eventually, eventually_async, RedisServer};
use tokio::sync::{watch, Notify};
use tower::ServiceExt;
use tower_redlock::http::{
    key::{header, Header},
    replay::{Fingerprint, Replay, Replaying, UnknownOutcome},
    Contention, LockLayer, OnDisconnect, OnLost,
};
use tower_redlock::record::Claim;
use tower_redlock::{
    http::{problem::ProblemKind, LeaseLost},
    LeaseHandle, LockError, LockOptions, MemoryNode, Redlock, Resource,
};

/// Generous bound for things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(10);
/// Bound on waiting for a response; only reached when a test fails.
const RESPONSE_LIMIT: Duration = Duration::from_secs(60);

// ------------------------------------------------------------------------------------
// backends

/// The lock nodes of a test: in-process, or real `redis-server`s.
enum Backend {
    Memory(MemoryNode),
    Redis(Vec<RedisServer>),
}

impl Backend {
    fn memory() -> Backend {
        Backend::Memory(MemoryNode::new())
    }

    fn redis(n: usize) -> Backend {
        Backend::Redis(RedisServer::start_many(n))
    }

    /// Every backend a rule is checked on: `MemoryNode`, one Redis, three Redis.
    fn all() -> Vec<Backend> {
        vec![Backend::memory(), Backend::redis(1), Backend::redis(3)]
    }

    fn name(&self) -> String {
        match self {
            Backend::Memory(_) => "memory".to_owned(),
            Backend::Redis(servers) => format!("{} redis", servers.len()),
        }
    }

    fn locker(&self, options: LockOptions) -> Redlock {
        match self {
            Backend::Memory(node) => Redlock::new([node.clone()], options).unwrap(),
            Backend::Redis(servers) => {
                Redlock::from_urls(servers.iter().map(RedisServer::url), options).unwrap()
            }
        }
    }

    fn servers(&mut self) -> &mut [RedisServer] {
        match self {
            Backend::Redis(servers) => servers,
            Backend::Memory(_) => panic!("not a Redis backend"),
        }
    }

    /// The state of the record key on every node: `pending`, `done` or `None`.
    fn record_states(&self, resource: &Resource) -> Vec<Option<String>> {
        let key = record_key(resource);
        match self {
            Backend::Memory(node) => {
                vec![node.get(&key).map(|value| match value.split(' ').next() {
                    Some("P") => "pending".to_owned(),
                    Some("D") => "done".to_owned(),
                    other => panic!("unexpected record {other:?}"),
                })]
            }
            Backend::Redis(servers) => servers
                .iter()
                .map(|server| server.cmd(&["HGET", &key, "state"]).to_string_lossy())
                .collect(),
        }
    }

    /// `true` once no node has the record key any more.
    fn record_gone(&self, resource: &Resource) -> bool {
        self.record_states(resource).iter().all(Option::is_none)
    }

    /// The record key on every node, for failure messages.
    fn dump(&self, resource: &Resource) -> String {
        let key = record_key(resource);
        match self {
            Backend::Memory(node) => format!("{:?}", node.get(&key)),
            Backend::Redis(servers) => servers
                .iter()
                .map(|server| {
                    let fields = server.cmd(&["HMGET", &key, "state", "token", "orphan"]);
                    let pttl = server.pttl(&key);
                    format!("{fields:?} pttl {pttl}")
                })
                .collect::<Vec<_>>()
                .join("; "),
        }
    }

    /// Waits until no node has the record key any more.
    async fn wait_record_gone(&self, what: &str, resource: &Resource) {
        let start = std::time::Instant::now();
        while !self.record_gone(resource) {
            if start.elapsed() > PROMPTLY {
                panic!("{}: {what}: still {}", self.name(), self.dump(resource));
            }
            tokio::time::sleep(support::POLL_INTERVAL).await;
        }
    }
}

/// A per-node timeout that a loaded test machine does not exceed by accident (a killed
/// node fails at once; a paused one costs this much per call).
fn options() -> LockOptions {
    LockOptions::default().node_timeout(Duration::from_millis(250))
}

/// The Redis key of a resource's record under the default prefix.
fn record_key(resource: &Resource) -> String {
    format!("redlock:{{{}}}:record", resource.as_str())
}

fn payments_resource(key: &str) -> Resource {
    Resource::new("POST").join("/payments").join(key)
}

// ------------------------------------------------------------------------------------
// the app

/// A `POST /payments` handler that counts its runs (the ledger) and can be held at a
/// gate, answer 500 on its first runs, or wait for its lease to be lost.
#[derive(Clone, Default)]
struct Payments {
    runs: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    gate: Option<watch::Sender<bool>>,
    fail_first: usize,
    wait_for_loss: Arc<AtomicBool>,
}

impl Payments {
    fn gated() -> Self {
        Payments {
            gate: Some(watch::channel(false).0),
            ..Payments::default()
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn open_gate(&self) {
        self.gate
            .as_ref()
            .expect("a gated handler")
            .send_replace(true);
    }

    fn app(&self, layer: ReplayLayer) -> Router {
        let payments = self.clone();
        Router::new()
            .route(
                "/payments",
                post(move |lease: Extension<LeaseHandle>, body: Bytes| {
                    let payments = payments.clone();
                    async move { payments.pay(lease.0, body).await }
                }),
            )
            .route_layer(layer)
    }

    async fn pay(&self, lease: LeaseHandle, body: Bytes) -> Response<Body> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        self.entered.notify_one();
        if let Some(gate) = &self.gate {
            let mut open = gate.subscribe();
            let _ = open.wait_for(|open| *open).await;
        }
        if self.wait_for_loss.load(Ordering::SeqCst) {
            lease.lost().await;
        }
        if run <= self.fail_first {
            return Response::builder()
                .status(StatusCode::INTERNAL_SERVER_ERROR)
                .body(Body::from("payment provider down"))
                .unwrap();
        }
        // Bytes that are not UTF-8 too: the replay must be byte-identical.
        let mut payload = format!("{{\"payment\":{run},\"echo\":{}}}", body.len()).into_bytes();
        payload.extend_from_slice(&[0, 0xff, b'\n']);
        Response::builder()
            .status(StatusCode::CREATED)
            .header(CONTENT_TYPE, "application/json")
            .header(LOCATION, format!("/payments/pay_{run}"))
            .header("x-extra", "one")
            .header("x-extra", "two")
            .header("x-private", format!("run {run}"))
            .body(Body::from(payload))
            .unwrap()
    }
}

type ReplayLayer = LockLayer<Replaying<Header>>;

/// Replay on the `Idempotency-Key` header. Waits for the lock: a request sent right
/// after another may find its lock still being released in the background.
fn layer(locker: Redlock, replay: Replay) -> ReplayLayer {
    LockLayer::new(locker, header("Idempotency-Key"))
        .contention(Contention::Wait {
            timeout: RESPONSE_LIMIT,
        })
        .replay(replay)
}

/// [`layer`], cancelling a handler whose client left ([`OnDisconnect::Cancel`]).
fn cancelling_layer(locker: Redlock, replay: Replay) -> ReplayLayer {
    LockLayer::new(locker, header("Idempotency-Key"))
        .contention(Contention::Wait {
            timeout: RESPONSE_LIMIT,
        })
        .on_disconnect(OnDisconnect::Cancel)
        .replay(replay)
}

fn pay(key: &str, body: &'static str) -> Request<Body> {
    Request::post("/payments")
        .header("idempotency-key", key)
        .header(CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap()
}

/// A response, read to the end.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    extensions: http::Extensions,
    body: Bytes,
}

impl Answer {
    async fn read<B>(response: Response<B>) -> Answer
    where
        B: http_body::Body,
        B::Error: std::fmt::Debug,
    {
        let (parts, body) = response.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            extensions: parts.extensions,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn all(&self, name: &str) -> Vec<&str> {
        self.headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect()
    }

    fn replayed(&self) -> bool {
        match self.header("idempotent-replayed") {
            Some("true") => true,
            None => false,
            other => panic!("Idempotent-Replayed: {other:?}"),
        }
    }

    /// Checks the problem envelope and the code; returns the JSON body.
    fn assert_problem(&self, status: StatusCode, code: &str) -> serde_json::Value {
        assert_eq!(self.status, status, "{:?}", self.body);
        assert_eq!(
            self.header(CONTENT_TYPE.as_str()),
            Some("application/problem+json")
        );
        assert_eq!(self.header(CACHE_CONTROL.as_str()), Some("no-store"));
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        let kind = ProblemKind::from_type_uri(json["type"].as_str().unwrap()).unwrap();
        assert_eq!(kind.code(), code, "{json}");
        assert_eq!(json["status"], status.as_u16());
        assert!(!self.replayed(), "a problem is never a replay");
        json
    }

    fn retry_after(&self) -> u64 {
        self.header(RETRY_AFTER.as_str())
            .expect("Retry-After")
            .parse()
            .unwrap()
    }
}

async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = tokio::time::timeout(RESPONSE_LIMIT, app.clone().oneshot(request))
        .await
        .expect("no response")
        .unwrap();
    Answer::read(response).await
}

/// Status, the allowed headers and the body are those of `first`; the handler's other
/// headers are not replayed; the replay says so.
fn assert_replay_of(first: &Answer, replay: &Answer) {
    assert!(!first.replayed());
    assert!(
        replay.replayed(),
        "not a replay: {} {:?} {:?}",
        replay.status,
        replay.headers,
        replay.body
    );
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body, "the body is byte-identical");
    for name in ["content-type", "location", "fencing-token"] {
        assert_eq!(replay.all(name), first.all(name), "header {name}");
    }
    // Replayed only when allowed (`Replay::allow_header`), then every value, in order.
    let extra = replay.all("x-extra");
    assert!(
        extra.is_empty() || extra == first.all("x-extra"),
        "{extra:?}"
    );
    assert_eq!(replay.header("x-private"), None, "not on the allow-list");
}

// ------------------------------------------------------------------------------------
// replay, 422

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_response_is_replayed_byte_identical() {
    for backend in Backend::all() {
        let payments = Payments::default();
        let app = payments.app(layer(
            backend.locker(options()),
            Replay::global().allow_header("x-extra"),
        ));
        let first = send(&app, pay("k-1", r#"{"amount":100}"#)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", backend.name());
        assert!(first.header("fencing-token").is_some());
        assert_eq!(first.all("x-extra"), ["one", "two"]);
        assert!(first.header("x-private").is_some());
        assert!(first.body.ends_with(&[0, 0xff, b'\n']));
        // Recorded on a majority before the answer; on the others soon after.
        let resource = payments_resource("k-1");
        let states = backend.record_states(&resource);
        let done = states
            .iter()
            .filter(|s| s.as_deref() == Some("done"))
            .count();
        assert!(done > states.len() / 2, "{}: {states:?}", backend.name());
        eventually("recorded on every node", PROMPTLY, || {
            backend
                .record_states(&resource)
                .iter()
                .all(|state| state.as_deref() == Some("done"))
        })
        .await;

        for _ in 0..2 {
            let again = send(&app, pay("k-1", r#"{"amount":100}"#)).await;
            assert_replay_of(&first, &again);
            assert_eq!(again.all("x-extra"), ["one", "two"]);
        }
        assert_eq!(
            payments.runs(),
            1,
            "{}: the ledger counts one payment",
            backend.name()
        );

        // Another key is another payment.
        let other = send(&app, pay("k-2", r#"{"amount":100}"#)).await;
        assert_eq!(other.status, StatusCode::CREATED);
        assert!(!other.replayed());
        assert_eq!(payments.runs(), 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_another_body_gets_422() {
    for backend in Backend::all() {
        let payments = Payments::default();
        let app = payments.app(layer(backend.locker(options()), Replay::global()));
        let first = send(&app, pay("k", r#"{"amount":100}"#)).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let changed = send(&app, pay("k", r#"{"amount":999}"#)).await;
        let json =
            changed.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
        assert_eq!(json["resource"], payments_resource("k").as_str());
        assert_eq!(payments.runs(), 1, "{}", backend.name());
        // The original request still replays.
        let again = send(&app, pay("k", r#"{"amount":100}"#)).await;
        assert_replay_of(&first, &again);
    }
}

#[tokio::test]
async fn the_fingerprint_can_cover_selected_fields_or_nothing() {
    let payments = Payments::default();
    let app = payments.app(layer(
        Redlock::in_memory(),
        Replay::global().fingerprint(Fingerprint::json_fields(["/amount"])),
    ));
    let first = send(&app, pay("k", r#"{"amount":100,"note":"a"}"#)).await;
    let other_note = send(&app, pay("k", r#"{"note":"b","amount":100}"#)).await;
    assert_replay_of(&first, &other_note);
    send(&app, pay("k", r#"{"amount":1}"#))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
    send(&app, pay("k", "not json"))
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "body-not-json");

    let payments = Payments::default();
    let app = payments.app(layer(
        Redlock::in_memory(),
        Replay::global().fingerprint(Fingerprint::none()),
    ));
    let first = send(&app, pay("k", "a")).await;
    assert_replay_of(&first, &send(&app, pay("k", "b")).await);
    assert_eq!(payments.runs(), 1);
}

// ------------------------------------------------------------------------------------
// concurrency: 409 in Reject mode, the replay in Wait mode

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_gets_409_request_in_progress() {
    for backend in Backend::all() {
        let payments = Payments::gated();
        let app = payments.app(
            LockLayer::new(backend.locker(options()), header("Idempotency-Key"))
                .contention(Contention::Reject)
                .replay(Replay::global()),
        );
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, pay("k", "{}")).await }
        });
        payments.entered.notified().await;

        let concurrent = send(&app, pay("k", "{}")).await;
        let json = concurrent.assert_problem(StatusCode::CONFLICT, "request-in-progress");
        assert!(concurrent.retry_after() >= 1);
        assert!(json["retry_after_ms"].as_u64().is_some());
        // Even with another body: the first is still in flight.
        send(&app, pay("k", r#"{"other":1}"#))
            .await
            .assert_problem(StatusCode::CONFLICT, "request-in-progress");

        payments.open_gate();
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{}", backend.name());
        assert_replay_of(&first, &send(&app, pay("k", "{}")).await);
        assert_eq!(payments.runs(), 1, "{}", backend.name());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_wait_mode_the_waiter_gets_the_replay() {
    for backend in Backend::all() {
        let payments = Payments::gated();
        let locker = backend.locker(options());
        let app = payments.app(
            LockLayer::new(locker.clone(), header("Idempotency-Key"))
                .contention(Contention::Wait {
                    timeout: RESPONSE_LIMIT,
                })
                .replay(Replay::global()),
        );
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, pay("k", "{}")).await }
        });
        payments.entered.notified().await;
        let waiter = tokio::spawn({
            let app = app.clone();
            async move { send(&app, pay("k", "{}")).await }
        });
        // The waiter found no record and queues for the lock.
        eventually("the second request waits for the lock", PROMPTLY, || {
            locker.metrics().waits >= 1
        })
        .await;
        payments.open_gate();

        let first = first.await.unwrap();
        let waiter = waiter.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{}", backend.name());
        assert_replay_of(&first, &waiter);
        assert_eq!(payments.runs(), 1, "{}", backend.name());
    }
}

// ------------------------------------------------------------------------------------
// what is not recorded

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_not_recorded_and_the_retry_runs_again() {
    for backend in Backend::all() {
        let payments = Payments {
            fail_first: 1,
            ..Payments::default()
        };
        let app = payments.app(layer(backend.locker(options()), Replay::global()));
        let failed = send(&app, pay("k", "{}")).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!failed.replayed());
        let resource = payments_resource("k");
        backend
            .wait_record_gone("no record, no pending marker", &resource)
            .await;

        let retry = send(&app, pay("k", "{}")).await;
        assert_eq!(
            retry.status,
            StatusCode::CREATED,
            "{}: {:?}; now {}",
            backend.name(),
            retry.body,
            backend.dump(&resource)
        );
        assert!(!retry.replayed());
        assert_eq!(payments.runs(), 2);
        assert_replay_of(&retry, &send(&app, pay("k", "{}")).await);
        assert_eq!(payments.runs(), 2);
    }
}

#[tokio::test]
async fn which_statuses_are_recorded_is_configurable() {
    let payments = Payments {
        fail_first: 1,
        ..Payments::default()
    };
    let app = payments.app(layer(
        Redlock::in_memory(),
        Replay::global().store_if(|status| status != StatusCode::CREATED),
    ));
    let failed = send(&app, pay("k", "{}")).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let again = send(&app, pay("k", "{}")).await;
    assert!(again.replayed(), "the 500 was recorded, as Stripe does");
    assert_eq!(again.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(again.body, failed.body);
    assert_eq!(payments.runs(), 1);
}

#[tokio::test]
async fn bodies_over_the_limit_are_sent_but_not_recorded() {
    let node = MemoryNode::new();
    let payments = Payments::default();
    let app = payments.app(layer(
        Redlock::new([node.clone()], options()).unwrap(),
        Replay::global().max_body(8),
    ));
    let first = send(&app, pay("k", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.body.len() > 8, "sent whole");
    assert_eq!(node.get(&record_key(&payments_resource("k"))), None);
    let second = send(&app, pay("k", "{}")).await;
    assert!(!second.replayed());
    assert_eq!(payments.runs(), 2);

    // Request bodies are read for the fingerprint up to their own limit.
    let app = payments.app(layer(
        Redlock::in_memory(),
        Replay::global().max_request_body(4),
    ));
    send(&app, pay("k", "0123456789"))
        .await
        .assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    assert_eq!(payments.runs(), 2);
}

// ------------------------------------------------------------------------------------
// failures: a node down, a lost lease, retention

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_survives_one_node_killed() {
    let mut backend = Backend::redis(3);
    let payments = Payments::default();
    let app = payments.app(layer(backend.locker(options()), Replay::global()));
    let first = send(&app, pay("k", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);

    backend.servers()[0].kill();
    assert_replay_of(&first, &send(&app, pay("k", "{}")).await);
    send(&app, pay("k", r#"{"x":1}"#))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
    assert_eq!(payments.runs(), 1);

    // Restarted empty, the node has no record; the majority still answers.
    backend.servers()[0].restart();
    assert_replay_of(&first, &send(&app, pay("k", "{}")).await);
    assert_eq!(payments.runs(), 1);
}

/// ttl 2 s: a lease whose majority stops answering is lost quickly.
fn short_lease_options() -> LockOptions {
    options().ttl(Duration::from_secs(2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_records_nothing_then_the_key_answers_outcome_unknown_then_runs_again() {
    let mut backend = Backend::redis(3);
    let payments = Payments::default();
    payments.wait_for_loss.store(true, Ordering::SeqCst);
    let unknown_for = Duration::from_millis(300);
    let app = payments.app(
        LockLayer::new(
            backend.locker(short_lease_options()),
            header("Idempotency-Key"),
        )
        .on_lost(OnLost::Continue)
        .contention(Contention::Wait {
            timeout: RESPONSE_LIMIT,
        })
        .replay(Replay::global().unknown_outcome(UnknownOutcome::ReexecuteAfter(unknown_for))),
    );
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay("k", "{}")).await }
    });
    payments.entered.notified().await;
    backend.servers()[0].pause();
    backend.servers()[1].pause();
    let first = first.await.unwrap();
    backend.servers()[0].resume();
    backend.servers()[1].resume();

    // The handler finished after the loss: its response is passed on, marked, and not
    // recorded (a holder without its lease writes nothing).
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.extensions.get::<LeaseLost>().is_some());
    assert!(!first.replayed());
    let resource = payments_resource("k");
    let states = backend.record_states(&resource);
    assert!(
        states.iter().all(|s| s.as_deref() != Some("done")),
        "no record: {states:?}"
    );
    assert!(states.iter().any(|s| s.as_deref() == Some("pending")));

    // The lost lease's key is gone everywhere (released, or expired during the pause).
    let lock_key = format!("redlock:{{{}}}", resource.as_str());
    eventually("the lost lease's lock keys are gone", PROMPTLY, || {
        backend
            .servers()
            .iter()
            .all(|server| !server.exists(&lock_key))
    })
    .await;

    // Whether the payment happened is unknown: the key says so, for a while.
    let unknown = send(&app, pay("k", "{}")).await;
    unknown.assert_problem(StatusCode::CONFLICT, "outcome-unknown");
    assert_eq!(unknown.retry_after(), 1);
    assert_eq!(payments.runs(), 1);

    // Once the interrupted attempt's marker has expired, the request runs again.
    backend
        .wait_record_gone("the orphaned marker expires", &resource)
        .await;
    payments.wait_for_loss.store(false, Ordering::SeqCst);
    let rerun = send(&app, pay("k", "{}")).await;
    assert_eq!(payments.runs(), 2, "the handler ran again");
    assert_eq!(rerun.status, StatusCode::CREATED);
    assert!(!rerun.replayed());
    // Recorded on a majority, as a store counts (a node whose acquire answered after
    // the node timeout on a loaded machine holds neither the lock nor the record).
    eventually("the re-executed outcome is recorded", PROMPTLY, || {
        let states = backend.record_states(&resource);
        states
            .iter()
            .filter(|s| s.as_deref() == Some("done"))
            .count()
            >= 2
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_request_blocks_its_key_until_the_configured_time() {
    // The handler future is dropped mid-way (the client went away, and the layer was
    // told to cancel such handlers): outcome unknown.
    let node = MemoryNode::new();
    let payments = Payments::gated();
    let unknown_for = Duration::from_millis(200);
    let app = payments.app(cancelling_layer(
        Redlock::new([node.clone()], options()).unwrap(),
        Replay::global().unknown_outcome(UnknownOutcome::ReexecuteAfter(unknown_for)),
    ));
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay("k", "{}")).await }
    });
    payments.entered.notified().await;
    first.abort();
    let _ = first.await;
    let resource = payments_resource("k");
    let lock_key = format!("redlock:{{{}}}", resource.as_str());
    eventually("the dropped request's lock is released", PROMPTLY, || {
        node.get(&lock_key).is_none()
    })
    .await;

    let unknown = send(&app, pay("k", "{}")).await;
    unknown.assert_problem(StatusCode::CONFLICT, "outcome-unknown");
    eventually("the orphaned marker expires", PROMPTLY, || {
        node.get(&record_key(&resource)).is_none()
    })
    .await;
    payments.open_gate();
    let rerun = send(&app, pay("k", "{}")).await;
    assert_eq!(rerun.status, StatusCode::CREATED);
    assert_eq!(payments.runs(), 2);

    // With `Refuse`, the key keeps answering until the retention ends.
    let payments = Payments::gated();
    let app = payments.app(cancelling_layer(
        Redlock::new([node.clone()], options()).unwrap(),
        Replay::global().unknown_outcome(UnknownOutcome::Refuse),
    ));
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay("r", "{}")).await }
    });
    payments.entered.notified().await;
    first.abort();
    let _ = first.await;
    let resource = payments_resource("r");
    let lock_key = format!("redlock:{{{}}}", resource.as_str());
    eventually("the dropped request's lock is released", PROMPTLY, || {
        node.get(&lock_key).is_none()
    })
    .await;
    let unknown = send(&app, pay("r", "{}")).await;
    unknown.assert_problem(StatusCode::CONFLICT, "outcome-unknown");
    assert!(unknown.retry_after() > 3600, "until the retention ends");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_retention_the_key_runs_again() {
    for backend in Backend::all() {
        let payments = Payments::default();
        let app = payments.app(layer(
            backend.locker(options()),
            Replay::global().retention(Duration::from_millis(300)),
        ));
        let first = send(&app, pay("k", "{}")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let resource = payments_resource("k");
        eventually("the record expires", PROMPTLY, || {
            backend.record_gone(&resource)
        })
        .await;
        let again = send(&app, pay("k", "{}")).await;
        assert_eq!(again.status, StatusCode::CREATED, "{}", backend.name());
        assert!(!again.replayed());
        assert_eq!(payments.runs(), 2);
    }
}

// ------------------------------------------------------------------------------------
// clients

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_with_the_same_key_get_their_own_records() {
    for backend in Backend::all() {
        let payments = Payments::default();
        let app = payments.app(layer(
            backend.locker(options()),
            Replay::per_client(header("Authorization")),
        ));
        let as_user = |user: &str, body: &'static str| {
            let mut request = pay("same-key", body);
            request
                .headers_mut()
                .insert("authorization", format!("Bearer {user}").parse().unwrap());
            request
        };
        let alice = send(&app, as_user("alice", "{}")).await;
        let bob = send(&app, as_user("bob", r#"{"different":"body"}"#)).await;
        assert_eq!(bob.status, StatusCode::CREATED, "{}", backend.name());
        assert!(!bob.replayed(), "bob's key is not alice's");
        assert_ne!(alice.body, bob.body);
        assert_eq!(payments.runs(), 2);
        assert_replay_of(&alice, &send(&app, as_user("alice", "{}")).await);
        assert_replay_of(
            &bob,
            &send(&app, as_user("bob", r#"{"different":"body"}"#)).await,
        );
        // Without a client: refused, nothing runs, nothing replayed.
        let anonymous = send(&app, pay("same-key", "{}")).await;
        assert_eq!(
            anonymous.status,
            StatusCode::BAD_REQUEST,
            "{}",
            backend.name()
        );
        assert!(!anonymous.replayed());
        assert_eq!(payments.runs(), 2);
        if let Backend::Redis(servers) = &backend {
            let keys = servers[0].keys("*");
            assert!(
                keys.iter()
                    .all(|k| !k.contains("alice") && !k.contains("Bearer")),
                "{keys:?}"
            );
        }
    }
}

// ------------------------------------------------------------------------------------
// the engine: records are written only under a live lock key

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_lock_key_was_taken_cannot_write_the_record() {
    for backend in [Backend::memory(), Backend::redis(3)] {
        let locker = backend.locker(options());
        let resource = Resource::new("engine").join("k");
        let lease = locker.try_acquire(&resource).await.unwrap();
        assert_eq!(
            lease
                .claim_record(b"fp", Duration::from_secs(60), None)
                .await
                .unwrap(),
            Claim::Claimed
        );
        // Someone else owns the lock key now on a majority (it expired and was taken,
        // as after a long pause); the local lease does not know yet.
        let lock_key = format!("redlock:{{{}}}", resource.as_str());
        match &backend {
            Backend::Memory(node) => node.set(&lock_key, "another-owner"),
            Backend::Redis(servers) => {
                for server in &servers[..2] {
                    assert!(server.cmd(&["SET", &lock_key, "another-owner"]).is_ok());
                }
            }
        }
        assert!(lease.is_held(), "the loss is not noticed locally yet");
        let refused = lease
            .store_record(
                b"fp",
                Bytes::from_static(b"late outcome"),
                Duration::from_secs(60),
            )
            .await
            .unwrap_err();
        assert!(matches!(refused, LockError::Lost { .. }), "{refused:?}");
        let done = |states: &[Option<String>]| {
            states
                .iter()
                .filter(|s| s.as_deref() == Some("done"))
                .count()
        };
        let states = backend.record_states(&resource);
        assert!(
            done(&states) < states.len() / 2 + 1,
            "{}: {states:?}",
            backend.name()
        );
        // The refusal comes once a majority refused; the node whose lock key is still
        // the lease's (the third Redis) takes the store, maybe after the answer.
        let still_ours = match &backend {
            Backend::Memory(_) => 0,
            Backend::Redis(servers) => servers.len() - 2,
        };
        eventually(
            "the store lands where the lock key is still ours",
            PROMPTLY,
            || done(&backend.record_states(&resource)) == still_ours,
        )
        .await;
        // Where it did land, it is the outcome of work that ran, and a read finds it
        // (see `tower_redlock::record`).
        let found = locker.read_record(&resource).await.unwrap();
        assert_eq!(found.is_some(), still_ours > 0, "{}", backend.name());
        drop(lease);
    }
}

#[tokio::test]
async fn the_engine_api_stores_and_reads_opaque_records() {
    let locker = Redlock::new(
        [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()],
        LockOptions::default(),
    )
    .unwrap();
    assert_eq!(locker.read_record("job").await.unwrap(), None);
    let lease = locker.try_acquire("job").await.unwrap();
    assert_eq!(
        lease
            .claim_record(b"f", Duration::from_secs(60), None)
            .await
            .unwrap(),
        Claim::Claimed
    );
    lease
        .store_record(
            b"f",
            Bytes::from_static(b"\x00result"),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let token = lease.fencing_token();
    lease.release().await;
    let record = locker.read_record("job").await.unwrap().unwrap();
    assert_eq!(record.data(), &Bytes::from_static(b"\x00result"));
    assert_eq!(record.fingerprint(), &Bytes::from_static(b"f"));
    assert_eq!(record.token(), token);

    // The next holder finds the outcome instead of claiming the work.
    let lease = locker.try_acquire("job").await.unwrap();
    match lease
        .claim_record(b"f", Duration::from_secs(60), None)
        .await
        .unwrap()
    {
        Claim::Completed(found) => assert_eq!(found, record),
        other => panic!("{other:?}"),
    }
}

// ------------------------------------------------------------------------------------
// the orders example

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orders_example_replays_payments() {
    let servers = RedisServer::start_many(3);
    let app = orders::build(&orders::Config {
        redis_urls: servers.iter().map(RedisServer::url).collect(),
        node_timeout: Some(support::PATIENT_NODE_TIMEOUT),
        ..orders::Config::default()
    })
    .unwrap();
    let payment = |body: &'static str| {
        Request::post("/payments?work_ms=0")
            .header("idempotency-key", "pay-1")
            .header("authorization", "Bearer c1")
            .body(Body::from(body))
            .unwrap()
    };
    let first = send(&app, payment("")).await;
    assert_eq!(first.status, StatusCode::OK, "{:?}", first.body);
    let again = send(&app, payment("")).await;
    assert_replay_of(&first, &again);
    send(&app, payment(r#"{"amount":2}"#))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
}

#[tokio::test]
async fn one_key_on_two_paths_of_one_route_is_two_requests() {
    // `/orders/{id}/pay` with the same key: one lock, but order 8 is not order 7.
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/orders/{id}/pay",
            post({
                let runs = runs.clone();
                move || {
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    async move { format!("payment {run}") }
                }
            }),
        )
        .route_layer(layer(Redlock::in_memory(), Replay::global()));
    let order = |id: u32| {
        Request::post(format!("/orders/{id}/pay"))
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap()
    };
    let seven = send(&app, order(7)).await;
    assert_eq!(seven.status, StatusCode::OK);
    send(&app, order(8))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
    assert_replay_of(&seven, &send(&app, order(7)).await);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

// ------------------------------------------------------------------------------------
// which requests and responses replay is for (issue 19, items 3 and 4)

/// A handler counting its runs, answering 404 for id 0 ("no such order") and 200
/// otherwise, on `/orders/{id}` for POST, PUT and PATCH.
fn counting_orders(runs: &Arc<AtomicUsize>) -> axum::routing::MethodRouter {
    let handler = {
        let runs = runs.clone();
        move |axum::extract::Path(id): axum::extract::Path<u32>| {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if id == 0 {
                    (StatusCode::NOT_FOUND, format!("no order 0 (run {run})"))
                } else {
                    (StatusCode::OK, format!("order {id}, run {run}"))
                }
            }
        }
    };
    post(handler.clone()).put(handler.clone()).patch(handler)
}

fn keyed(method: &str, uri: &str, key: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn only_post_and_patch_are_replayed_by_default() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/orders/{id}", counting_orders(&runs))
        .route_layer(layer(Redlock::in_memory(), Replay::global()));
    for method in ["POST", "PATCH"] {
        let key = format!("k-{method}");
        let first = send(&app, keyed(method, "/orders/1", &key)).await;
        let again = send(&app, keyed(method, "/orders/1", &key)).await;
        assert_replay_of(&first, &again);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // PUT is idempotent by definition: locked, but run every time, never replayed.
    for _ in 0..2 {
        let put = send(&app, keyed("PUT", "/orders/1", "k-put")).await;
        assert_eq!(put.status, StatusCode::OK);
        assert!(!put.replayed());
        assert!(put.header("fencing-token").is_some(), "still locked");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4);

    // `Replay::methods` changes the set.
    let app = Router::new()
        .route("/orders/{id}", counting_orders(&runs))
        .route_layer(layer(
            Redlock::in_memory(),
            Replay::global().methods([http::Method::PUT]),
        ));
    let first = send(&app, keyed("PUT", "/orders/1", "k")).await;
    assert_replay_of(&first, &send(&app, keyed("PUT", "/orders/1", "k")).await);
    let post_ = send(&app, keyed("POST", "/orders/1", "k2")).await;
    assert!(!send(&app, keyed("POST", "/orders/1", "k2"))
        .await
        .replayed());
    assert!(!post_.replayed());
}

#[tokio::test]
async fn responses_of_the_router_are_never_recorded() {
    let runs = Arc::new(AtomicUsize::new(0));
    // `Router::layer` and `MethodRouter::layer` wrap the router's own answers too; PUT,
    // PATCH and POST are replayed here, so only the rule keeps 404 and 405 out.
    let replay = || Replay::global().methods([http::Method::POST, http::Method::PUT]);
    let handler = {
        let runs = runs.clone();
        move || {
            runs.fetch_add(1, Ordering::SeqCst);
            async { "paid" }
        }
    };
    // 405 of the method router (PUT on a POST-only route), under `MethodRouter::layer`.
    let method_router = Router::new().route(
        "/orders/{id}",
        post(handler.clone()).layer(layer(Redlock::in_memory(), replay())),
    );
    for _ in 0..2 {
        let answer = send(&method_router, keyed("PUT", "/orders/1", "k-405")).await;
        assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED);
        assert!(!answer.replayed(), "a 405 of the router was recorded");
    }
    // 404 of the router's fallback (no route matched), under `Router::layer`.
    let router = Router::new()
        .route("/orders/{id}", post(handler))
        .layer(layer(Redlock::in_memory(), replay()));
    for _ in 0..2 {
        let answer = send(&router, keyed("POST", "/nowhere", "k-404")).await;
        assert_eq!(answer.status, StatusCode::NOT_FOUND);
        assert!(!answer.replayed(), "a 404 of the router was recorded");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // A handler's own 404 on a matched route is an outcome like any other.
    let app = Router::new()
        .route("/orders/{id}", counting_orders(&runs))
        .route_layer(layer(Redlock::in_memory(), Replay::global()));
    let first = send(&app, keyed("POST", "/orders/0", "k-own-404")).await;
    assert_eq!(first.status, StatusCode::NOT_FOUND);
    assert_replay_of(
        &first,
        &send(&app, keyed("POST", "/orders/0", "k-own-404")).await,
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_orders_example_locks_and_records_only_the_routed_method() {
    let app = orders::build(&orders::Config::default()).unwrap();
    // HEAD, GET and OPTIONS on `/payments`: the router's 405, no key needed, no lock,
    // nothing recorded.
    for method in ["HEAD", "GET", "OPTIONS"] {
        for key in [None, Some("k-1")] {
            let mut request = Request::builder().method(method).uri("/payments");
            if let Some(key) = key {
                request = request.header("idempotency-key", key);
            }
            let answer = send(&app, request.body(Body::empty()).unwrap()).await;
            assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED, "{method}");
            assert!(!answer.replayed(), "{method}");
            assert_eq!(
                answer.header("fencing-token"),
                None,
                "{method} took the lock"
            );
        }
    }
    // GET on a POST route of an order: 405 at once, without the order's lock.
    let answer = send(&app, keyed("GET", "/orders/50/ship", "k")).await;
    assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(answer.header("fencing-token"), None);
}

#[tokio::test]
async fn a_quoted_idempotency_key_is_the_same_key_as_the_bare_one() {
    let payments = Payments::default();
    let app = payments.app(layer(Redlock::in_memory(), Replay::global()));
    // The draft's structured-field String, then the bare token Stripe's clients send.
    let first = send(&app, pay(r#""8e03978e-40d5""#, "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_replay_of(&first, &send(&app, pay("8e03978e-40d5", "{}")).await);
    assert_eq!(payments.runs(), 1);
    send(&app, pay(r#""8e03978e"40d5""#, "{}"))
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-invalid");
}

// ------------------------------------------------------------------------------------
// every node kind: Redis Cluster, Sentinel, and a locker mixing them (issue 15)

/// Per-node timeout for lockers whose nodes wait for a replica (`WAIT`): it bounds
/// calls only when a test fails or a replica is paused on purpose.
fn replicated_options() -> LockOptions {
    LockOptions::default().node_timeout(Duration::from_secs(3))
}

/// `url` with its writes counted only once one replica acknowledged them; the wait's
/// bound is reached only while a test pauses the replica.
fn waiting_for_a_replica(url: &str) -> String {
    format!("{url}?wait_replicas=1&wait_timeout_ms=1000")
}

/// The replay rules every node kind keeps, checked through the HTTP layer over
/// `locker`: the first request runs and is recorded, a retry gets its response byte for
/// byte, another body gets 422, and concurrent duplicates run once. Returns the app,
/// its handler and the first answer for key `k`, for checks after a failover.
async fn replays_on(locker: &Redlock, what: &str) -> (Router, Payments, Answer) {
    let payments = Payments::gated();
    let app = payments.app(layer(
        locker.clone(),
        Replay::global().allow_header("x-extra"),
    ));
    payments.open_gate();
    let first = send(&app, pay("k", r#"{"amount":100}"#)).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "{what}: {:?}",
        first.body
    );
    assert_eq!(first.all("x-extra"), ["one", "two"]);
    for _ in 0..2 {
        let again = send(&app, pay("k", r#"{"amount":100}"#)).await;
        assert_replay_of(&first, &again);
        assert_eq!(again.all("x-extra"), ["one", "two"], "{what}");
    }
    send(&app, pay("k", r#"{"amount":999}"#))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
    assert_eq!(payments.runs(), 1, "{what}: one payment in the ledger");

    // Concurrent duplicates of a new key: one runs, every other gets its response.
    let duplicates = Payments::gated();
    let dup_app = duplicates.app(layer(locker.clone(), Replay::global()));
    let waits = locker.metrics().waits;
    let running = tokio::spawn({
        let app = dup_app.clone();
        async move { send(&app, pay("dup", "{}")).await }
    });
    duplicates.entered.notified().await;
    let others: Vec<_> = (0..4)
        .map(|_| {
            let app = dup_app.clone();
            tokio::spawn(async move { send(&app, pay("dup", "{}")).await })
        })
        .collect();
    eventually("the duplicates to wait for the lock", PROMPTLY, || {
        locker.metrics().waits >= waits + 4
    })
    .await;
    duplicates.open_gate();
    let ran = running.await.unwrap();
    assert_eq!(ran.status, StatusCode::CREATED, "{what}: {:?}", ran.body);
    for other in others {
        assert_replay_of(&ran, &other.await.unwrap());
    }
    assert_eq!(
        duplicates.runs(),
        1,
        "{what}: concurrent duplicates run once"
    );
    (app, payments, first)
}

/// The demo (`cargo run --example orders`) started with `REDIS_URLS=<urls>`: payments
/// replay, and the ledger lives in the first node, whatever its kind.
async fn the_demo_replays_on(urls: &str) {
    let redis_urls = tower_redlock::split_node_urls(urls);
    let app = orders::build(&orders::Config {
        redis_urls,
        node_timeout: Some(support::PATIENT_NODE_TIMEOUT),
        ..orders::Config::default()
    })
    .unwrap();
    let payment = || {
        Request::post("/payments?work_ms=0")
            .header("idempotency-key", "demo-1")
            .header("authorization", "Bearer c1")
            .body(Body::empty())
            .unwrap()
    };
    let first = send(&app, payment()).await;
    assert_eq!(first.status, StatusCode::OK, "{urls}: {:?}", first.body);
    assert_replay_of(&first, &send(&app, payment()).await);
    let ledger = send(
        &app,
        Request::get("/orders/payment:c1:demo-1")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    let ledger: serde_json::Value = serde_json::from_slice(&ledger.body).unwrap();
    assert_eq!(ledger["payments"], 1, "{urls}: {ledger}");
}

/// Blocking set-up work (starting servers) off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// `HGET record state` on one server (`READONLY` first: a cluster replica redirects
/// reads to its master otherwise; other servers accept it as a no-op or refuse it).
fn state_on(server: &RedisServer, key: &str) -> Option<String> {
    let mut conn = server.connect(PROMPTLY).expect("connecting");
    let _ = conn.call_str(&["READONLY"]);
    match conn.call_str(&["HGET", key, "state"]).expect("HGET") {
        support::RespValue::Error(e) => panic!("HGET {key}: {e}"),
        value => value.to_string_lossy(),
    }
}

/// A record write acknowledged by too few replicas does not count: with the replica
/// paused between claim and store, the store fails and says why; once the replica is
/// back, the same store counts (the record already on the master is this very one).
async fn record_writes_wait_for(locker: &Redlock, replica: &mut RedisServer, what: &str) {
    let lease = locker.try_acquire("job").await.unwrap();
    let claimed = lease
        .claim_record(b"f", Duration::from_secs(60), None)
        .await
        .unwrap();
    assert_eq!(claimed, Claim::Claimed, "{what}");
    let data = Bytes::from_static(b"\x00outcome");
    replica.pause();
    let refused = lease
        .store_record(b"f", data.clone(), Duration::from_secs(60))
        .await;
    replica.resume();
    let err = refused.expect_err("a store no replica acknowledged must not count");
    assert!(
        matches!(err, LockError::Unavailable { .. }),
        "{what}: {err}"
    );
    assert!(err.to_string().contains("replica(s)"), "{what}: {err}");
    lease
        .store_record(b"f", data.clone(), Duration::from_secs(60))
        .await
        .unwrap();
    lease.release().await;
    let record = locker.read_record("job").await.unwrap().expect("stored");
    assert_eq!(record.data(), &data, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_on_a_cluster_follows_the_slot_and_survives_a_failover() {
    let mut cluster = blocking(|| support::cluster::RedisCluster::start(3, 1)).await;
    let locker = Redlock::connect(
        [waiting_for_a_replica(&cluster.url())],
        replicated_options(),
    )
    .await
    .unwrap();
    let (app, payments, first) = replays_on(&locker, "cluster").await;
    the_demo_replays_on(&waiting_for_a_replica(&cluster.url())).await;

    // The record is in the lock key's slot, on the shard's master, and (`WAIT`) on its
    // replica before the response is sent.
    let resource = payments_resource("k");
    let key = record_key(&resource);
    let lock = format!("redlock:{{{}}}", resource.as_str());
    assert_eq!(cluster.slot(&key), cluster.slot(&lock));
    let any = cluster.nodes[0].port();
    let master = cluster.master_of_slot(cluster.slot(&key), any);
    let replica = cluster.replicas_of(master)[0];
    assert_eq!(
        state_on(cluster.node(master), &key).as_deref(),
        Some("done")
    );
    assert_eq!(
        state_on(cluster.node(replica), &key).as_deref(),
        Some("done")
    );

    let job_master = cluster.master_of_slot(cluster.slot("redlock:{job}"), any);
    let job_replica = cluster.replicas_of(job_master)[0];
    let server = cluster
        .nodes
        .iter_mut()
        .find(|n| n.port() == job_replica)
        .unwrap();
    record_writes_wait_for(&locker, server, "cluster").await;

    // The shard's replica takes over: the cluster client follows the slot (MOVED) and
    // the record is there.
    tokio::task::block_in_place(|| cluster.failover(replica));
    assert_eq!(cluster.master_of_slot(cluster.slot(&key), any), replica);
    assert_replay_of(&first, &send(&app, pay("k", r#"{"amount":100}"#)).await);
    send(&app, pay("k", r#"{"amount":999}"#))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
    assert_eq!(payments.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_on_sentinel_is_found_on_the_new_master_after_a_failover() {
    let mut group = blocking(support::cluster::SentinelGroup::start).await;
    let old = group.master_port();
    let locker = Redlock::connect([waiting_for_a_replica(&group.url())], replicated_options())
        .await
        .unwrap();
    let (app, payments, first) = replays_on(&locker, "sentinel").await;
    the_demo_replays_on(&group.url()).await;
    let key = record_key(&payments_resource("k"));
    let replica_port = group
        .servers
        .iter()
        .map(RedisServer::port)
        .find(|&p| p != old);
    let replica_port = replica_port.unwrap();
    // `WAIT`: the replica had the record before the response was sent.
    assert_eq!(
        state_on(group.server(replica_port), &key).as_deref(),
        Some("done")
    );
    let replica = group
        .servers
        .iter_mut()
        .find(|s| s.port() == replica_port)
        .unwrap();
    record_writes_wait_for(&locker, replica, "sentinel").await;

    let new = tokio::task::block_in_place(|| group.failover());
    assert_eq!(new, replica_port);
    // With the old master gone, only the new one can answer: the node follows it.
    group
        .servers
        .iter_mut()
        .find(|s| s.port() == old)
        .unwrap()
        .kill();
    eventually_async("the replay from the new master", RESPONSE_LIMIT, || {
        let app = &app;
        let first = &first;
        async move {
            let again = send(app, pay("k", r#"{"amount":100}"#)).await;
            if again.status == StatusCode::SERVICE_UNAVAILABLE {
                return false; // still looking the master up
            }
            assert_replay_of(first, &again);
            true
        }
    })
    .await;
    assert_eq!(state_on(group.server(new), &key).as_deref(), Some("done"));
    assert_eq!(payments.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_over_a_standalone_a_cluster_and_a_sentinel_node() {
    let (standalone, cluster, group) = blocking(|| {
        (
            RedisServer::start(),
            support::cluster::RedisCluster::start(3, 0),
            support::cluster::SentinelGroup::start(),
        )
    })
    .await;
    let locker = Redlock::connect(
        [standalone.url(), cluster.url(), group.url()],
        replicated_options(),
    )
    .await
    .unwrap();
    assert_eq!(locker.quorum(), 2);
    let _ = replays_on(&locker, "mixed").await;
    // `REDIS_URLS` as a user writes it: seeds inside a URL, commas and spaces between.
    the_demo_replays_on(&format!(
        "{}, {} {}",
        cluster.url(),
        group.url(),
        standalone.url()
    ))
    .await;
    // Written to every node, whatever its kind.
    let key = record_key(&payments_resource("k"));
    let shard = cluster.master_of_slot(cluster.slot(&key), cluster.nodes[0].port());
    eventually("recorded on every node", PROMPTLY, || {
        [
            &standalone,
            cluster.node(shard),
            group.server(group.master_port()),
        ]
        .iter()
        .all(|server| state_on(server, &key).as_deref() == Some("done"))
    })
    .await;
}

/// A node that locks (through a `MemoryNode`) but stores no outcome records: the
/// default `Node::records`.
struct LockOnly(MemoryNode);

use tower_redlock::node;

impl tower_redlock::node::Node for LockOnly {
    fn name(&self) -> &str {
        "lock-only"
    }

    fn acquire(&self, request: &node::Acquire<'_>) -> node::NodeFuture<node::Vote> {
        self.0.acquire(request)
    }

    fn extend(
        &self,
        holds: &[node::Hold<'_>],
        ttl: Duration,
    ) -> node::NodeFuture<Vec<Result<bool, tower_redlock::NodeError>>> {
        self.0.extend(holds, ttl)
    }

    fn release(&self, hold: &node::Hold<'_>, how: node::Release<'_>) -> node::NodeFuture<bool> {
        self.0.release(hold, how)
    }

    fn raise_fences(
        &self,
        keys: &[node::ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> node::NodeFuture<()> {
        self.0.raise_fences(keys, tokens, fence_ttl)
    }

    fn subscribe(&self, keys: &node::ResourceKeys) -> node::NodeFuture<node::ReleaseSignal> {
        self.0.subscribe(keys)
    }
}

fn mixed_locker() -> Redlock {
    let nodes: Vec<Arc<dyn tower_redlock::node::Node>> = vec![
        Arc::new(MemoryNode::new()),
        Arc::new(LockOnly(MemoryNode::new())),
        Arc::new(MemoryNode::new()),
    ];
    Redlock::from_nodes(nodes, LockOptions::default()).unwrap()
}

#[tokio::test]
async fn replay_over_a_node_without_records_is_refused_when_the_layer_is_built() {
    let error = LockLayer::new(mixed_locker(), header("idempotency-key"))
        .try_replay(Replay::global())
        .expect_err("a locker with a node lacking records must be refused");
    assert!(error.to_string().contains("lock-only"), "{error}");

    // Nodes that all store records are accepted.
    let locker = Redlock::new(
        [MemoryNode::new(), MemoryNode::new()],
        LockOptions::default(),
    )
    .unwrap();
    assert!(LockLayer::new(locker, header("idempotency-key"))
        .try_replay(Replay::global())
        .is_ok());
}

#[tokio::test]
#[should_panic(expected = "LockLayer::replay")]
async fn replay_over_a_node_without_records_panics_with_the_reason() {
    let _ = LockLayer::new(mixed_locker(), header("idempotency-key")).replay(Replay::global());
}

#[tokio::test]
async fn the_engine_counts_a_node_without_records_as_not_answering() {
    // Used without the layer, the records answer as before: the node's vote is
    // missing (one of three), the majority still decides.
    let locker = mixed_locker();
    let lease = locker.try_acquire("no-records").await.unwrap();
    assert_eq!(
        lease
            .claim_record(b"f", Duration::from_secs(60), None)
            .await
            .unwrap(),
        Claim::Claimed
    );
}
