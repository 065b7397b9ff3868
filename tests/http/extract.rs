//! The axum extractors (`tower_redlock::axum`): `Locked<K>`, which takes a lease in the
//! handler, and `LayerLease`, which reads the lease a `LockLayer` took. Driven with
//! `ServiceExt::oneshot` over `MemoryNode`s or real `redis-server`s.
//!
//! No sleeps sequence anything: handlers report on channels and wait on `Notify`s;
//! effects on Redis are observed with `support::eventually`.
use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRef, State};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use support::{eventually, RedisServer};
use tokio::sync::{mpsc, Notify};
use tower::ServiceExt;
use tower_redlock::axum::{LayerLease, LockKey, LockRejection, Locked};
use tower_redlock::http::{
    key::{header, path_param, Header, PathParam},
    Contention, LockLayer, MissingKey, Scope,
};
use tower_redlock::{http::problem::ProblemKind, LockOptions, Redlock, ReleaseOutcome, Resource};

/// Bound on things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(10);
/// Bound on one response; only reached when a test fails.
const RESPONSE_LIMIT: Duration = Duration::from_secs(60);

// ------------------------------------------------------------------------------------
// lock keys

/// `/orders/{id}`, one lock per route and id (the default scope).
struct OrderId;

impl LockKey for OrderId {
    type Extractor = PathParam;

    fn extractor() -> PathParam {
        path_param("id")
    }
}

/// `/orders/{id}`, shared with every route of the `order` scope.
struct SharedOrder;

impl LockKey for SharedOrder {
    type Extractor = PathParam;

    fn extractor() -> PathParam {
        path_param("id")
    }

    fn scope() -> Scope {
        Scope::shared("order")
    }
}

/// `Idempotency-Key`, shared scope, keys of at most 8 bytes.
struct ShortKey;

impl LockKey for ShortKey {
    type Extractor = Header;

    fn extractor() -> Header {
        header("Idempotency-Key")
    }

    fn scope() -> Scope {
        Scope::shared("k")
    }

    fn max_key_len() -> usize {
        8
    }
}

/// Like [`SharedOrder`], but waits for the lock.
struct WaitingOrder;

impl LockKey for WaitingOrder {
    type Extractor = PathParam;

    fn extractor() -> PathParam {
        path_param("id")
    }

    fn scope() -> Scope {
        Scope::shared("order")
    }

    fn contention() -> Contention {
        Contention::Wait {
            timeout: RESPONSE_LIMIT,
        }
    }
}

/// Like [`SharedOrder`], but gives up waiting at once.
struct ImpatientOrder;

impl LockKey for ImpatientOrder {
    type Extractor = PathParam;

    fn extractor() -> PathParam {
        path_param("id")
    }

    fn scope() -> Scope {
        Scope::shared("order")
    }

    fn contention() -> Contention {
        Contention::Wait {
            timeout: Duration::ZERO,
        }
    }
}

// ------------------------------------------------------------------------------------
// helpers

/// A response, read to the end.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }

    /// Checks the problem envelope, status and code; returns the JSON body.
    fn assert_problem(&self, kind: ProblemKind) -> serde_json::Value {
        assert_eq!(self.status, kind.status(), "{}", self.text());
        assert_eq!(
            self.headers[CONTENT_TYPE],
            "application/problem+json",
            "{}",
            self.text()
        );
        assert_eq!(self.headers[CACHE_CONTROL], "no-store");
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(json["type"], kind.type_uri());
        assert_eq!(json["title"], kind.title());
        assert_eq!(json["status"], kind.status().as_u16());
        assert!(json["detail"].as_str().is_some_and(|d| !d.is_empty()));
        json
    }
}

async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = tokio::time::timeout(RESPONSE_LIMIT, app.clone().oneshot(request))
        .await
        .expect("no response")
        .unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

fn post_to(uri: &str) -> Request<Body> {
    Request::post(uri).body(Body::empty()).unwrap()
}

fn post_with_key(uri: &str, key: &str) -> Request<Body> {
    Request::post(uri)
        .header("Idempotency-Key", key)
        .body(Body::empty())
        .unwrap()
}

/// Counts handler runs.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

impl Runs {
    fn hit(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The router's state: the extractors find the locker through `FromRef`.
#[derive(Clone, FromRef)]
struct AppState {
    locker: Redlock,
    runs: Runs,
}

/// The fencing token of a `Locked<K>`, as the response body.
async fn token_of<K: LockKey>(State(runs): State<Runs>, lock: Locked<K>) -> String {
    runs.hit();
    assert!(lock.is_held());
    lock.fencing_token().to_string()
}

/// Routes taking the lock in the handler, plus one under a `LockLayer` sharing the
/// `order` scope.
fn app(locker: &Redlock, runs: &Runs) -> Router {
    Router::new()
        .route("/orders/{id}/send", post(token_of::<OrderId>))
        .route("/shared/{id}", post(token_of::<SharedOrder>))
        .route("/wait/{id}", post(token_of::<WaitingOrder>))
        .route("/impatient/{id}", post(token_of::<ImpatientOrder>))
        .route("/keys", post(token_of::<ShortKey>))
        .route(
            "/layered/{id}",
            post(|| async { "layered" }).layer(
                LockLayer::new(locker.clone(), path_param("id")).scope(Scope::shared("order")),
            ),
        )
        .route(
            "/layered-keys",
            post(|| async { "layered" }).layer(
                LockLayer::new(locker.clone(), header("Idempotency-Key"))
                    .scope(Scope::shared("k"))
                    .max_key_len(8),
            ),
        )
        .with_state(AppState {
            locker: locker.clone(),
            runs: runs.clone(),
        })
}

fn lock_key(resource: &Resource) -> String {
    format!("redlock:{{{}}}", resource.as_str())
}

fn without_retry_after(mut json: serde_json::Value) -> serde_json::Value {
    json.as_object_mut().unwrap().remove("retry_after_ms");
    json
}

// ------------------------------------------------------------------------------------
// Locked<K>

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_holds_the_lease_while_the_handler_runs_and_releases_it_after() {
    let servers = RedisServer::start_many(3);
    let locker = Redlock::connect(servers.iter().map(RedisServer::url), support::patient())
        .await
        .unwrap();
    let (entered_tx, mut entered) = mpsc::unbounded_channel::<u64>();
    let gate = Arc::new(Notify::new());
    let handler_gate = gate.clone();
    let app = Router::new()
        .route(
            "/orders/{id}/send",
            post(move |lock: Locked<OrderId>| {
                let (entered_tx, gate) = (entered_tx.clone(), handler_gate.clone());
                async move {
                    entered_tx.send(lock.fencing_token().get()).unwrap();
                    gate.notified().await;
                    lock.fencing_token().to_string()
                }
            }),
        )
        .with_state(locker.clone());
    let resource = Resource::new("POST").join("/orders/{id}/send").join("7");
    let key = lock_key(&resource);

    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_to("/orders/7/send")).await }
    });
    let token = tokio::time::timeout(PROMPTLY, entered.recv())
        .await
        .expect("the handler runs")
        .unwrap();
    assert!(token > 0);
    // While the handler runs, a majority of the nodes holds the lock key.
    let holding = servers.iter().filter(|s| s.exists(&key)).count();
    assert!(holding >= 2, "{holding} of 3 nodes hold {key}");

    gate.notify_one();
    let answer = running.await.unwrap();
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    assert_eq!(answer.text(), token.to_string());

    // The handler's future ended, so did the lease: gone from every node, nothing left
    // in the process.
    eventually("the lock key is deleted on every node", PROMPTLY, || {
        servers.iter().all(|s| !s.exists(&key))
    })
    .await;
    eventually("the locker holds nothing", PROMPTLY, || {
        locker.local_resources() == 0
    })
    .await;

    // The next request gets the lock, with a larger token.
    let next = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_to("/orders/7/send")).await }
    });
    let next_token = tokio::time::timeout(PROMPTLY, entered.recv())
        .await
        .expect("the next handler runs")
        .unwrap();
    assert!(next_token > token);
    gate.notify_one();
    assert_eq!(next.await.unwrap().status, StatusCode::OK);
}

#[tokio::test]
async fn locked_rejects_with_409_when_held_like_the_layer() {
    let locker = Redlock::in_memory();
    let runs = Runs::default();
    let app = app(&locker, &runs);

    // Route scope: the same resource a LockLayer on this route would lock.
    let resource = Resource::new("POST").join("/orders/{id}/send").join("7");
    let held = locker.try_acquire(resource.clone()).await.unwrap();
    let answer = send(&app, post_to("/orders/7/send")).await;
    let json = answer.assert_problem(ProblemKind::LockHeld);
    // The route template as written, not escaped as in the lock's keys.
    assert_eq!(json["resource"], "POST:/orders/{id}/send:7");
    assert_eq!(json["resource"], resource.display_name());
    assert!(json["retry_after_ms"].as_u64().is_some());
    assert!(answer.headers.contains_key(RETRY_AFTER));
    // Another id, or the same id on another route, is another lock.
    assert_eq!(
        send(&app, post_to("/orders/8/send")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(&app, post_to("/shared/7")).await.status,
        StatusCode::OK
    );
    held.release().await;
    // The handlers' leases are released in the background once they end.
    eventually("every lease is released", PROMPTLY, || {
        locker.local_resources() == 0
    })
    .await;

    // Shared scope: the extractor and the layer lock `order:7`, and answer alike.
    let held = locker
        .try_acquire(Resource::new("order").join("7"))
        .await
        .unwrap();
    let runs_before = runs.get();
    let by_extractor = send(&app, post_to("/shared/7")).await;
    let by_layer = send(&app, post_to("/layered/7")).await;
    let extractor_json = by_extractor.assert_problem(ProblemKind::LockHeld);
    let layer_json = by_layer.assert_problem(ProblemKind::LockHeld);
    assert_eq!(
        without_retry_after(extractor_json),
        without_retry_after(layer_json)
    );
    assert_eq!(runs.get(), runs_before, "the handler never ran");
    held.release().await;
    assert_eq!(
        send(&app, post_to("/shared/7")).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn locked_answers_bad_keys_like_the_layer() {
    let locker = Redlock::in_memory();
    let runs = Runs::default();
    let app = app(&locker, &runs);

    let cases: [(Request<Body>, Request<Body>, ProblemKind); 3] = [
        (
            post_to("/keys"),
            post_to("/layered-keys"),
            ProblemKind::KeyMissing,
        ),
        (
            post_with_key("/keys", "far-too-long"),
            post_with_key("/layered-keys", "far-too-long"),
            ProblemKind::KeyInvalid,
        ),
        (
            Request::post("/keys")
                .header("Idempotency-Key", "a")
                .header("Idempotency-Key", "b")
                .body(Body::empty())
                .unwrap(),
            Request::post("/layered-keys")
                .header("Idempotency-Key", "a")
                .header("Idempotency-Key", "b")
                .body(Body::empty())
                .unwrap(),
            ProblemKind::KeyInvalid,
        ),
    ];
    for (to_extractor, to_layer, kind) in cases {
        let by_extractor = send(&app, to_extractor).await.assert_problem(kind);
        let by_layer = send(&app, to_layer).await.assert_problem(kind);
        assert_eq!(by_extractor, by_layer);
    }
    assert_eq!(runs.get(), 0);
    assert_eq!(
        send(&app, post_with_key("/keys", "short")).await.status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_waits_for_the_lock_when_asked_to() {
    let locker = Redlock::in_memory();
    let runs = Runs::default();
    let app = app(&locker, &runs);
    let held = locker
        .try_acquire(Resource::new("order").join("3"))
        .await
        .unwrap();

    // Gives up at once.
    let answer = send(&app, post_to("/impatient/3")).await;
    answer.assert_problem(ProblemKind::LockWaitTimeout);

    // Waits until the holder releases.
    let waits_before = locker.metrics().waits;
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_to("/wait/3")).await }
    });
    eventually("the request waits for the lock", PROMPTLY, || {
        locker.metrics().waits > waits_before
    })
    .await;
    assert_eq!(runs.get(), 0);
    let token = held.fencing_token();
    assert_eq!(held.release().await, ReleaseOutcome::Released);
    let answer = waiting.await.unwrap();
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    assert!(answer.text().parse::<u64>().unwrap() > token.get());
    assert_eq!(runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_gets_503_when_the_store_is_down() {
    let mut servers = RedisServer::start_many(3);
    let locker = Redlock::connect(servers.iter().map(RedisServer::url), LockOptions::default())
        .await
        .unwrap();
    let runs = Runs::default();
    let app = app(&locker, &runs);
    servers[0].kill();
    servers[1].kill();
    let answer = send(&app, post_to("/shared/1")).await;
    let json = answer.assert_problem(ProblemKind::LockUnavailable);
    assert_eq!(json["resource"], "order:1");
    assert_eq!(answer.headers[RETRY_AFTER], "1");
    assert_eq!(runs.get(), 0);
}

#[tokio::test]
async fn locked_lease_can_be_released_early() {
    let locker = Redlock::in_memory();
    let app = Router::new()
        .route(
            "/orders/{id}/send",
            post(|lock: Locked<OrderId>| async move {
                let outcome = lock.into_lease().expect("acquired").release().await;
                format!("{outcome:?}")
            }),
        )
        .with_state(locker.clone());
    let answer = send(&app, post_to("/orders/1/send")).await;
    assert_eq!(answer.text(), "Released");
    assert_eq!(locker.local_resources(), 0, "released before the response");
    assert_eq!(
        send(&app, post_to("/orders/1/send")).await.text(),
        "Released"
    );
}

#[tokio::test]
async fn locked_rejection_can_be_handled_by_the_handler() {
    let locker = Redlock::in_memory();
    let app = Router::new()
        .route(
            "/orders/{id}/send",
            post(|lock: Result<Locked<OrderId>, LockRejection>| async move {
                match lock {
                    Ok(_) => "locked".to_owned(),
                    Err(rejection) => format!("{}", rejection.problem().kind()),
                }
            }),
        )
        .with_state(locker.clone());
    let _held = locker
        .try_acquire(Resource::new("POST").join("/orders/{id}/send").join("1"))
        .await
        .unwrap();
    let answer = send(&app, post_to("/orders/1/send")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.text(), "lock-held");
}

// ------------------------------------------------------------------------------------
// LayerLease

async fn layer_token(lease: LayerLease) -> String {
    assert!(lease.is_held());
    lease.fencing_token().to_string()
}

#[tokio::test]
async fn layer_lease_without_a_layer_is_a_500_problem() {
    let runs = Runs::default();
    let handler_runs = runs.clone();
    let app: Router = Router::new().route(
        "/pay",
        post(move |_lease: LayerLease| {
            let runs = handler_runs.clone();
            async move {
                runs.hit();
                "ran"
            }
        }),
    );
    let answer = send(&app, post_with_key("/pay", "k")).await;
    let json = answer.assert_problem(ProblemKind::LockLayerMissing);
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    let detail = json["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("this route has no LockLayer"),
        "{detail}"
    );
    assert_eq!(runs.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_lease_sees_the_token_of_the_fencing_header() {
    let servers = RedisServer::start_many(3);
    let locker = Redlock::connect(servers.iter().map(RedisServer::url), support::patient())
        .await
        .unwrap();
    let app = Router::new()
        .route("/pay", post(layer_token))
        .route_layer(LockLayer::new(locker, header("Idempotency-Key")));
    for key in ["a", "b", "c"] {
        let answer = send(&app, post_with_key("/pay", key)).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        assert_eq!(answer.text(), answer.headers["fencing-token"]);
    }
}

#[tokio::test]
async fn layer_lease_of_a_request_the_layer_let_through_unlocked() {
    let locker = Redlock::in_memory();
    let bypass = || {
        LockLayer::new(locker.clone(), header("Idempotency-Key")).missing_key(MissingKey::Bypass)
    };
    let app = Router::new()
        .route("/required", post(layer_token).layer(bypass()))
        .route(
            "/optional",
            post(|lease: Option<LayerLease>| async move {
                lease.map_or("unlocked".to_owned(), |l| l.fencing_token().to_string())
            })
            .layer(bypass()),
        );

    let answer = send(&app, post_to("/required")).await;
    let json = answer.assert_problem(ProblemKind::LockLayerMissing);
    assert!(
        json["detail"]
            .as_str()
            .unwrap()
            .contains("MissingKey::Bypass"),
        "{json}"
    );

    assert_eq!(send(&app, post_to("/optional")).await.text(), "unlocked");
    let locked = send(&app, post_with_key("/optional", "k")).await;
    assert_eq!(locked.text(), locked.headers["fencing-token"]);
}

// ------------------------------------------------------------------------------------
// issue 19, items 9 to 11: the crate's errors as responses, the token header, run-time
// settings

#[tokio::test]
async fn lock_errors_answer_like_the_layer() {
    let locker = Redlock::in_memory();
    let runs = Runs::default();
    // A handler that locks by hand and answers errors with `?`.
    async fn by_hand(
        State(locker): State<Redlock>,
        axum::extract::Path(id): axum::extract::Path<String>,
    ) -> Result<String, tower_redlock::LockError> {
        let lease = locker.try_acquire(Resource::new("order").join(&id)).await?;
        Ok(lease.fencing_token().to_string())
    }
    let manual: Router = Router::new()
        .route("/manual/{id}", post(by_hand))
        .with_state(locker.clone());
    let layered = app(&locker, &runs);

    let held = locker
        .try_acquire(Resource::new("order").join("7"))
        .await
        .unwrap();
    let by_hand = send(&manual, post_to("/manual/7")).await;
    let by_layer = send(&layered, post_to("/layered/7")).await;
    let hand_json = by_hand.assert_problem(ProblemKind::LockHeld);
    let layer_json = by_layer.assert_problem(ProblemKind::LockHeld);
    assert_eq!(
        without_retry_after(hand_json),
        without_retry_after(layer_json)
    );
    assert!(by_hand.headers.contains_key(RETRY_AFTER));

    // The same response without axum's trait.
    let error = locker
        .try_acquire(Resource::new("order").join("7"))
        .await
        .unwrap_err();
    let response = tower_redlock::http::problem::problem_response(&error);
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(response.headers()[CACHE_CONTROL], "no-store");
    held.release().await;
}

#[tokio::test]
async fn locked_handlers_can_send_the_fencing_token_header() {
    async fn with_header(lock: Locked<OrderId>) -> (tower_redlock::FencingToken, String) {
        (lock.fencing_token(), "sent".to_owned())
    }
    let locker = Redlock::in_memory();
    let app: Router = Router::new()
        .route("/orders/{id}/send", post(with_header))
        .with_state(locker.clone());
    let answer = send(&app, post_to("/orders/7/send")).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    let token: u64 = answer.headers["fencing-token"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(token > 0);

    // Without fencing there is no token, and no header, as with the layer.
    let unfenced = Redlock::new(
        [tower_redlock::MemoryNode::new()],
        LockOptions::default().fencing(false),
    )
    .unwrap();
    let app: Router = Router::new()
        .route("/orders/{id}/send", post(with_header))
        .with_state(unfenced);
    let answer = send(&app, post_to("/orders/7/send")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(!answer.headers.contains_key("fencing-token"));
}

/// Settings read at start, from the environment say, kept in the state.
#[derive(Clone)]
struct Configured {
    locker: Redlock,
    scope: &'static str,
    wait: Duration,
}

impl FromRef<Configured> for Redlock {
    fn from_ref(state: &Configured) -> Redlock {
        state.locker.clone()
    }
}

/// A lock whose scope and wait come from the state.
struct ConfiguredOrder;

impl tower_redlock::axum::LockSpec<Configured> for ConfiguredOrder {
    type Extractor = PathParam;

    fn extractor(_state: &Configured) -> PathParam {
        path_param("id")
    }

    fn scope(state: &Configured) -> Scope {
        Scope::shared(state.scope)
    }

    fn contention(state: &Configured) -> Contention {
        Contention::Wait {
            timeout: state.wait,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_takes_its_scope_and_wait_from_the_state() {
    async fn handler(lock: Locked<ConfiguredOrder>) -> String {
        lock.resource().to_string()
    }
    let locker = Redlock::in_memory();
    let app = |scope: &'static str, wait: Duration| -> Router {
        Router::new()
            .route("/orders/{id}", post(handler))
            .with_state(Configured {
                locker: locker.clone(),
                scope,
                wait,
            })
    };
    // The scope: the state names the resource.
    let answer = send(&app("billing", RESPONSE_LIMIT), post_to("/orders/7")).await;
    assert_eq!(answer.text(), Resource::new("billing").join("7").as_str());

    // The wait: with the lock held, a zero wait times out, a long one gets the lock
    // once it is released.
    // (The first request's lease is released in the background: wait for it.)
    let held = locker
        .acquire(Resource::new("billing").join("7"), RESPONSE_LIMIT)
        .await
        .unwrap();
    send(&app("billing", Duration::ZERO), post_to("/orders/7"))
        .await
        .assert_problem(ProblemKind::LockWaitTimeout);
    let waits = locker.metrics().waits;
    let patient = app("billing", RESPONSE_LIMIT);
    let waiting = tokio::spawn(async move { send(&patient, post_to("/orders/7")).await });
    eventually("the request waits for the lock", PROMPTLY, || {
        locker.metrics().waits > waits
    })
    .await;
    held.release().await;
    assert_eq!(waiting.await.unwrap().status, StatusCode::OK);
}
