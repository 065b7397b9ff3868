//! The tower middleware (`tower_redlock::http`) end to end: a real axum `Router`,
//! driven with `ServiceExt::oneshot`, over `MemoryNode`s or real `redis-server`s.
//!
//! No sleeps sequence anything: handlers report with channels and wait on `Notify`s
//! or `watch` gates; effects on Redis are observed with `support::eventually`.
use crate::support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request as AxumRequest;
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use support::{eventually, RedisServer};
use tokio::sync::{mpsc, watch, Notify};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_redlock::http::{
    key::{header, json_field, path_param, query_param, webhook},
    Contention, LockLayer, LockService, MissingKey, OnDisconnect, OnLost, RequestKey, Scope,
    Unavailable, Unlocked,
};
use tower_redlock::{
    http::{
        problem::{Problem, ProblemKind},
        LeaseBody, LeaseLost,
    },
    LeaseHandle, LockOptions, Redlock, Resource,
};

/// Generous bound for things that happen promptly; only reached when a test fails.
const PROMPTLY: Duration = Duration::from_secs(10);
/// Bound on waiting for a response; only reached when a test fails.
const RESPONSE_LIMIT: Duration = Duration::from_secs(60);

// ------------------------------------------------------------------------------------
// helpers

fn redis_locker(servers: &[RedisServer], options: LockOptions) -> Redlock {
    Redlock::from_urls(servers.iter().map(RedisServer::url), options).unwrap()
}

/// The Redis key of a resource's lock under the default prefix.
fn lock_key(resource: &Resource) -> String {
    format!("redlock:{{{}}}", resource.as_str())
}

fn route_resource(method: &str, route: &str, key: &str) -> Resource {
    Resource::new(method).join(route).join(key)
}

fn post_with_key(uri: &str, key: &str) -> Request<Body> {
    Request::post(uri)
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

/// A response, read to the end.
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

    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    /// Checks the problem envelope and returns (code, body).
    fn problem(&self) -> (String, serde_json::Value) {
        assert_eq!(
            self.header(CONTENT_TYPE.as_str()),
            Some("application/problem+json"),
            "status {}: {}",
            self.status,
            self.text()
        );
        assert_eq!(self.header(CACHE_CONTROL.as_str()), Some("no-store"));
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        let type_uri = json["type"].as_str().unwrap();
        let (base, code) = type_uri.rsplit_once('#').unwrap();
        assert_eq!(
            base,
            "https://docs.rs/tower-redlock/latest/tower_redlock/http/problem/"
        );
        assert_eq!(json["status"], self.status.as_u16());
        assert!(json["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(json["detail"].as_str().is_some_and(|d| !d.is_empty()));
        assert_eq!(ProblemKind::from_type_uri(type_uri).unwrap().code(), code);
        (code.to_owned(), json)
    }

    fn assert_problem(&self, status: StatusCode, code: &str) -> serde_json::Value {
        assert_eq!(self.status, status, "{}", self.text());
        let (found, json) = self.problem();
        assert_eq!(found, code, "{json}");
        json
    }

    fn retry_after(&self) -> u64 {
        self.header(RETRY_AFTER.as_str())
            .expect("Retry-After")
            .parse()
            .unwrap()
    }

    fn fencing_token(&self) -> u64 {
        self.header("fencing-token")
            .expect("Fencing-Token")
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

/// A handler that counts its runs and answers with its resource (or `unlocked`).
fn counting_app(runs: &Runs) -> Router {
    let runs = runs.clone();
    Router::new().route(
        "/orders",
        post(move |lease: Option<Extension<LeaseHandle>>| {
            let runs = runs.clone();
            async move {
                runs.hit();
                lease.map_or("unlocked".to_owned(), |Extension(l)| {
                    l.resource().to_string()
                })
            }
        }),
    )
}

/// Sets a flag when dropped: tells whether a handler future was dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

// ------------------------------------------------------------------------------------
// keys: missing, invalid, bypass

#[tokio::test]
async fn missing_key_is_rejected() {
    let runs = Runs::default();
    let app = counting_app(&runs).route_layer(LockLayer::new(
        Redlock::in_memory(),
        header("Idempotency-Key"),
    ));
    let answer = send(&app, Request::post("/orders").body(Body::empty()).unwrap()).await;
    let json = answer.assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    assert!(json["detail"].as_str().unwrap().contains("idempotency-key"));
    assert!(answer.headers.get(RETRY_AFTER).is_none());
    assert!(json.get("retry_after_ms").is_none());
    assert_eq!(runs.get(), 0);
}

#[tokio::test]
async fn missing_key_bypass_runs_without_lock() {
    let seen = Arc::new(std::sync::Mutex::new(None));
    let app = {
        let seen = seen.clone();
        Router::new()
            .route(
                "/orders",
                post(move |request: AxumRequest| {
                    let seen = seen.clone();
                    async move {
                        *seen.lock().unwrap() = Some((
                            request.extensions().get::<LeaseHandle>().is_some(),
                            request.extensions().get::<Unlocked>().copied(),
                        ));
                        "ran"
                    }
                }),
            )
            .route_layer(
                LockLayer::new(Redlock::in_memory(), header("Idempotency-Key"))
                    .missing_key(MissingKey::Bypass),
            )
    };
    let answer = send(&app, Request::post("/orders").body(Body::empty()).unwrap()).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.text(), "ran");
    assert!(answer.headers.get("fencing-token").is_none());
    assert_eq!(
        *seen.lock().unwrap(),
        Some((false, Some(Unlocked::MissingKey)))
    );
}

#[tokio::test]
async fn invalid_keys_are_rejected() {
    let runs = Runs::default();
    let app = counting_app(&runs).route_layer(LockLayer::new(
        Redlock::in_memory(),
        header("Idempotency-Key"),
    ));
    let long = "a".repeat(256);
    let cases: Vec<Vec<&[u8]>> = vec![
        vec![b""],
        vec![long.as_bytes()],
        vec![b"a\tb"],
        vec![b"\xff"],
        vec![b"\"unterminated"],
        vec![b"one", b"two"], // ambiguous
    ];
    for values in cases {
        let mut request = Request::post("/orders");
        for value in &values {
            request = request.header("idempotency-key", *value);
        }
        let answer = send(&app, request.body(Body::empty()).unwrap()).await;
        answer.assert_problem(StatusCode::BAD_REQUEST, "key-invalid");
    }
    // 255 bytes is the default maximum.
    let answer = send(&app, post_with_key("/orders", &"a".repeat(255))).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(runs.get(), 1);

    let short = counting_app(&runs).route_layer(
        LockLayer::new(Redlock::in_memory(), header("Idempotency-Key")).max_key_len(4),
    );
    send(&short, post_with_key("/orders", "12345"))
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-invalid");
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn any_utf8_key_without_control_characters_is_accepted() {
    // A percent-encoded non-ASCII path id, spaces in a quoted header, letters of any
    // script: Redis keys are binary-safe and the resource escapes its parts.
    async fn key_of(Extension(key): Extension<RequestKey>) -> String {
        key.as_str().to_owned()
    }
    let app = Router::new()
        .route("/accounts/{id}/deposit", post(key_of))
        .route_layer(LockLayer::new(Redlock::in_memory(), path_param("id")));
    for (path, key) in [
        ("/accounts/%C3%A9/deposit", "é"),
        ("/accounts/caf%C3%A9%20cr%C3%A8me/deposit", "café crème"),
        ("/accounts/%E6%97%A5%E6%9C%AC/deposit", "日本"),
    ] {
        let answer = send(&app, Request::post(path).body(Body::empty()).unwrap()).await;
        assert_eq!(answer.status, StatusCode::OK, "{path}: {}", answer.text());
        assert_eq!(answer.text(), key);
    }
    // Control characters are still refused, wherever they come from.
    let answer = send(
        &app,
        Request::post("/accounts/a%0Ab/deposit")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    answer.assert_problem(StatusCode::BAD_REQUEST, "key-invalid");
    // The limit counts bytes: 128 × `é` is 256 bytes.
    let long = format!("/accounts/{}/deposit", "%C3%A9".repeat(128));
    send(&app, Request::post(long).body(Body::empty()).unwrap())
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-invalid");

    let runs = Runs::default();
    let app = counting_app(&runs).route_layer(LockLayer::new(
        Redlock::in_memory(),
        header("Idempotency-Key"),
    ));
    for key in [r#""a b""#, "café"] {
        let request = Request::post("/orders")
            .header("idempotency-key", key.as_bytes())
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, request).await.status, StatusCode::OK, "{key}");
    }
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn a_path_parameter_the_route_lacks_is_a_server_error() {
    let runs = Runs::default();
    let app = Router::new()
        .route(
            "/orders/{id}",
            post({
                let runs = runs.clone();
                move || {
                    runs.hit();
                    async { "paid" }
                }
            }),
        )
        .route_layer(LockLayer::new(
            Redlock::in_memory(),
            path_param("order_id"), // the route says `{id}`
        ));
    let answer = send(&app, post_order("7")).await;
    let json = answer.assert_problem(StatusCode::INTERNAL_SERVER_ERROR, "key-misconfigured");
    assert!(
        json["detail"].as_str().unwrap().contains("order_id"),
        "{json}"
    );
    assert_eq!(runs.get(), 0);
}

#[tokio::test]
async fn query_keys_and_composed_keys() {
    let runs = Runs::default();
    let app = counting_app(&runs).route_layer(
        LockLayer::new(
            Redlock::in_memory(),
            (header("x-tenant"), query_param("order")),
        )
        .scope(Scope::shared("order")),
    );
    let request = Request::post("/orders?order=a%3Ab")
        .header("x-tenant", "t1")
        .body(Body::empty())
        .unwrap();
    let answer = send(&app, request).await;
    assert_eq!(answer.status, StatusCode::OK);
    // Parts are escaped, then the key is escaped again as one part of the resource.
    let key = Resource::new("t1").join("a:b");
    assert_eq!(
        answer.text(),
        Resource::new("order").join(key.as_str()).as_str()
    );
    // Any part missing: no key.
    let request = Request::post("/orders?order=1")
        .body(Body::empty())
        .unwrap();
    send(&app, request)
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-missing");
}

#[tokio::test]
async fn webhook_presets() {
    let runs = Runs::default();
    let github = counting_app(&runs).route_layer(
        LockLayer::new(Redlock::in_memory(), webhook::github()).scope(Scope::shared("gh")),
    );
    let request = Request::post("/orders")
        .header("X-GitHub-Delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        send(&github, request).await.text(),
        "gh:72d3162e-cc78-11e3-81ab-4c9367dc0958"
    );

    let shopify = counting_app(&runs).route_layer(
        LockLayer::new(Redlock::in_memory(), webhook::shopify()).scope(Scope::shared("shop")),
    );
    let request = Request::post("/orders")
        .header("X-Shopify-Webhook-Id", "w-1")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&shopify, request).await.text(), "shop:w-1");
    let request = Request::post("/orders")
        .header("X-Shopify-Webhook-Id", "w-1")
        .header("X-Shopify-Event-Id", "e-1")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&shopify, request).await.text(), "shop:e-1");

    let stripe = counting_app(&runs).route_layer(
        LockLayer::new(Redlock::in_memory(), webhook::stripe()).scope(Scope::shared("stripe")),
    );
    let request = Request::post("/orders")
        .body(Body::from(r#"{"id":"evt_1","object":"event"}"#))
        .unwrap();
    assert_eq!(send(&stripe, request).await.text(), "stripe:evt_1");
}

// ------------------------------------------------------------------------------------
// body keys

#[tokio::test]
async fn body_key_passes_the_identical_bytes_on() {
    let locker = Redlock::in_memory();
    let app = Router::new()
        .route(
            "/events",
            post(
                |Extension(lease): Extension<LeaseHandle>, body: Bytes| async move {
                    let mut echoed = lease.resource().to_string().into_bytes();
                    echoed.push(b'\n');
                    echoed.extend_from_slice(&body);
                    echoed
                },
            ),
        )
        .route_layer(LockLayer::new(locker.clone(), json_field("/id")).scope(Scope::shared("evt")));
    let original: &[u8] =
        b"{ \"object\" :\"\xc3\xa9v\xc3\xa9nement\",\n\t\"id\":  \"evt_\\u0041b\" , \"n\": 1.50e2 }  \n";
    let answer = send(
        &app,
        Request::post("/events").body(Body::from(original)).unwrap(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    let (resource, body) = answer
        .body
        .split_at(answer.body.iter().position(|&b| b == b'\n').unwrap());
    assert_eq!(resource, b"evt:evt_Ab");
    assert_eq!(&body[1..], original);

    // A number is its decimal text: the lock for `{"id": 42}` is `evt:42`.
    let held = locker
        .try_acquire(Resource::new("evt").join("42"))
        .await
        .unwrap();
    let request = Request::post("/events")
        .body(Body::from(r#"{"id": 42}"#))
        .unwrap();
    send(&app, request)
        .await
        .assert_problem(StatusCode::CONFLICT, "lock-held");
    held.release().await;
}

#[tokio::test]
async fn body_key_absent_or_not_json() {
    let runs = Runs::default();
    let app =
        counting_app(&runs).route_layer(LockLayer::new(Redlock::in_memory(), json_field("/id")));
    let request = Request::post("/orders")
        .body(Body::from(r#"{"other":1}"#))
        .unwrap();
    send(&app, request)
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    let request = Request::post("/orders").body(Body::from("id=1")).unwrap();
    send(&app, request)
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "body-not-json");
    assert_eq!(runs.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_gets_413_and_takes_no_lock() {
    let server = RedisServer::start();
    let runs = Runs::default();
    let app = counting_app(&runs).route_layer(LockLayer::new(
        redis_locker(std::slice::from_ref(&server), support::patient()),
        json_field("/id"),
    ));
    let mut big = br#"{"id":"big","pad":""#.to_vec();
    big.resize(10 * 1024 * 1024, b'x');
    big.extend_from_slice(b"\"}");
    let big = Bytes::from(big);

    // Length known up front.
    let request = Request::post("/orders")
        .body(Body::from(big.clone()))
        .unwrap();
    let answer = send(&app, request).await;
    let json = answer.assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    assert!(json["detail"].as_str().unwrap().contains("65536"));

    // Length unknown: streamed in chunks.
    let chunks: Vec<Result<Bytes, Infallible>> = big
        .chunks(64 * 1024)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    let request = Request::post("/orders")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    send(&app, request)
        .await
        .assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");

    assert_eq!(runs.get(), 0);
    assert_eq!(server.dbsize(), 0, "keys: {:?}", server.keys("*"));

    // A body within a raised limit goes through.
    let app = counting_app(&runs).route_layer(LockLayer::new(
        redis_locker(std::slice::from_ref(&server), support::patient()),
        json_field("/id").limit(11 * 1024 * 1024),
    ));
    let request = Request::post("/orders").body(Body::from(big)).unwrap();
    assert_eq!(send(&app, request).await.status, StatusCode::OK);
    assert_eq!(runs.get(), 1);
}

// ------------------------------------------------------------------------------------
// contention

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_lock_gets_409_with_retry_after() {
    let server = RedisServer::start();
    let locker = redis_locker(std::slice::from_ref(&server), support::patient());
    let runs = Runs::default();
    let app =
        counting_app(&runs).route_layer(LockLayer::new(locker.clone(), header("Idempotency-Key")));
    let resource = route_resource("POST", "/orders", "k1");
    let held = locker.try_acquire(&resource).await.unwrap();

    let answer = send(&app, post_with_key("/orders", "k1")).await;
    let json = answer.assert_problem(StatusCode::CONFLICT, "lock-held");
    let retry = answer.retry_after();
    assert!((1..=10).contains(&retry), "Retry-After {retry}");
    let ms = json["retry_after_ms"].as_u64().unwrap();
    assert!(
        ms <= 10_000 && retry == ms.div_ceil(1000).max(1),
        "{ms} ms vs {retry} s"
    );
    assert_eq!(json["resource"], resource.display_name());
    assert_eq!(runs.get(), 0);

    // Another key is free.
    assert_eq!(
        send(&app, post_with_key("/orders", "k2")).await.status,
        StatusCode::OK
    );
    held.release().await;
    assert_eq!(
        send(&app, post_with_key("/orders", "k1")).await.status,
        StatusCode::OK
    );
    assert_eq!(runs.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_timeout_gets_409_with_retry_after() {
    let server = RedisServer::start();
    let locker = redis_locker(std::slice::from_ref(&server), support::patient());
    let runs = Runs::default();
    let app = counting_app(&runs).route_layer(
        LockLayer::new(locker.clone(), header("Idempotency-Key")).contention(Contention::Wait {
            timeout: Duration::from_millis(50),
        }),
    );
    let held = locker
        .try_acquire(route_resource("POST", "/orders", "k"))
        .await
        .unwrap();
    let answer = send(&app, post_with_key("/orders", "k")).await;
    let json = answer.assert_problem(StatusCode::CONFLICT, "lock-wait-timeout");
    assert!((1..=10).contains(&answer.retry_after()));
    assert!(json["retry_after_ms"].as_u64().is_some());
    assert_eq!(runs.get(), 0);
    held.release().await;
}

#[tokio::test]
async fn full_wait_queue_gets_503() {
    let locker = Redlock::in_memory();
    let runs = Runs::default();
    let app = counting_app(&runs).route_layer(
        LockLayer::new(locker.clone(), header("Idempotency-Key"))
            .contention(Contention::Wait {
                timeout: Duration::from_secs(60),
            })
            .queue_limit(1),
    );
    let held = locker
        .try_acquire(route_resource("POST", "/orders", "k"))
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_with_key("/orders", "k")).await }
    });
    eventually("the first request waits", PROMPTLY, || {
        locker.metrics().waits >= 1
    })
    .await;
    let answer = send(&app, post_with_key("/orders", "k")).await;
    answer.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "lock-queue-full");
    assert_eq!(answer.retry_after(), 1);
    assert_eq!(runs.get(), 0);

    held.release().await;
    assert_eq!(waiting.await.unwrap().status, StatusCode::OK);
    assert_eq!(runs.get(), 1);
}

/// Runs `n` concurrent requests for one key; the handler fails the test on overlap.
#[derive(Clone, Default)]
struct Exclusive {
    inside: Arc<AtomicUsize>,
    overlapped: Arc<AtomicBool>,
    entered: Arc<AtomicUsize>,
}

impl Exclusive {
    fn enter(&self) {
        if self.inside.fetch_add(1, Ordering::SeqCst) != 0 {
            self.overlapped.store(true, Ordering::SeqCst);
        }
        self.entered.fetch_add(1, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_in_reject_mode_never_overlap() {
    let server = RedisServer::start();
    let exclusive = Exclusive::default();
    let (open_tx, open_rx) = watch::channel(false);
    let app = {
        let exclusive = exclusive.clone();
        Router::new()
            .route(
                "/orders",
                post(move || {
                    let exclusive = exclusive.clone();
                    let mut open = open_rx.clone();
                    async move {
                        exclusive.enter();
                        // Stay inside until every other request was answered.
                        open.wait_for(|open| *open).await.unwrap();
                        exclusive.leave();
                        "done"
                    }
                }),
            )
            .route_layer(LockLayer::new(
                redis_locker(std::slice::from_ref(&server), support::patient()),
                header("Idempotency-Key"),
            ))
    };
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    for _ in 0..100 {
        let app = app.clone();
        let done_tx = done_tx.clone();
        tokio::spawn(async move {
            let answer = send(&app, post_with_key("/orders", "same")).await;
            let _ = done_tx.send(answer);
        });
    }
    for _ in 0..99 {
        let answer = done_rx.recv().await.unwrap();
        answer.assert_problem(StatusCode::CONFLICT, "lock-held");
        assert!(answer.retry_after() >= 1);
    }
    open_tx.send(true).unwrap();
    let last = done_rx.recv().await.unwrap();
    assert_eq!(last.status, StatusCode::OK);
    assert_eq!(exclusive.entered.load(Ordering::SeqCst), 1);
    assert!(
        !exclusive.overlapped.load(Ordering::SeqCst),
        "handlers overlapped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_in_wait_mode_all_run_one_at_a_time() {
    let server = RedisServer::start();
    let exclusive = Exclusive::default();
    let app = {
        let exclusive = exclusive.clone();
        Router::new()
            .route(
                "/orders",
                post(move |Extension(lease): Extension<LeaseHandle>| {
                    let exclusive = exclusive.clone();
                    async move {
                        exclusive.enter();
                        for _ in 0..3 {
                            tokio::task::yield_now().await;
                        }
                        exclusive.leave();
                        lease.fencing_token().to_string()
                    }
                }),
            )
            .route_layer(
                LockLayer::new(
                    redis_locker(std::slice::from_ref(&server), support::patient()),
                    header("Idempotency-Key"),
                )
                .contention(Contention::Wait {
                    timeout: Duration::from_secs(120),
                }),
            )
    };
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, post_with_key("/orders", "same")).await })
        })
        .collect();
    let mut tokens = Vec::new();
    for task in tasks {
        let answer = task.await.unwrap();
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        assert_eq!(answer.text(), answer.fencing_token().to_string());
        tokens.push(answer.fencing_token());
    }
    assert_eq!(exclusive.entered.load(Ordering::SeqCst), 100);
    assert!(
        !exclusive.overlapped.load(Ordering::SeqCst),
        "handlers overlapped"
    );
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 100, "every holder has its own token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_across_requests() {
    let servers = RedisServer::start_many(3);
    let app = Router::new()
        .route("/orders", post(|| async { "ok" }))
        .route_layer(
            LockLayer::new(
                redis_locker(&servers, support::patient()),
                header("Idempotency-Key"),
            )
            .contention(Contention::Wait {
                timeout: Duration::from_secs(30),
            }),
        );
    let mut last = 0;
    for _ in 0..10 {
        let answer = send(&app, post_with_key("/orders", "k")).await;
        assert_eq!(answer.status, StatusCode::OK);
        let token = answer.fencing_token();
        assert!(token > last, "{token} after {last}");
        last = token;
    }
}

#[tokio::test]
async fn fencing_header_can_be_renamed_or_removed() {
    let runs = Runs::default();
    let renamed = counting_app(&runs).route_layer(
        LockLayer::new(Redlock::in_memory(), header("Idempotency-Key"))
            .fencing_header(Some(http::HeaderName::from_static("x-fence"))),
    );
    let answer = send(&renamed, post_with_key("/orders", "k")).await;
    assert!(answer.header("x-fence").unwrap().parse::<u64>().is_ok());
    assert!(answer.header("fencing-token").is_none());

    let none = counting_app(&runs).route_layer(
        LockLayer::new(Redlock::in_memory(), header("Idempotency-Key")).fencing_header(None),
    );
    let answer = send(&none, post_with_key("/orders", "k")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(answer.header("fencing-token").is_none());
    // The handler still had the lease.
    assert_eq!(
        answer.text(),
        route_resource("POST", "/orders", "k").as_str()
    );
}

#[tokio::test]
async fn without_fencing_no_token_header_is_sent() {
    let runs = Runs::default();
    let locker = Redlock::new(
        [tower_redlock::MemoryNode::new()],
        tower_redlock::LockOptions::default().fencing(false),
    )
    .unwrap();
    let app = counting_app(&runs).route_layer(LockLayer::new(locker, header("Idempotency-Key")));
    let answer = send(&app, post_with_key("/orders", "k")).await;
    assert_eq!(answer.status, StatusCode::OK);
    // Every token is 0 without fencing: the layer does not pass one off as real.
    assert!(answer.header("fencing-token").is_none());
    assert_eq!(
        answer.text(),
        route_resource("POST", "/orders", "k").as_str()
    );
}

#[tokio::test]
async fn scopes_decide_which_routes_share_a_lock() {
    let locker = Redlock::in_memory();
    let runs = Runs::default();
    let app = |scope: Scope| {
        let runs = runs.clone();
        Router::new()
            .route(
                "/a",
                post(move || {
                    let runs = runs.clone();
                    async move {
                        runs.hit();
                        "a"
                    }
                }),
            )
            .route("/b", post(|| async { "b" }))
            .route_layer(LockLayer::new(locker.clone(), header("Idempotency-Key")).scope(scope))
    };
    // Route scope: the same key on another route is another lock.
    let held = locker
        .try_acquire(route_resource("POST", "/a", "k"))
        .await
        .unwrap();
    let by_route = app(Scope::Route);
    send(&by_route, post_with_key("/a", "k"))
        .await
        .assert_problem(StatusCode::CONFLICT, "lock-held");
    assert_eq!(
        send(&by_route, post_with_key("/b", "k")).await.status,
        StatusCode::OK
    );
    held.release().await;

    // Shared scope: every route, and direct users of the locker, share `order:<key>`.
    let held = locker
        .try_acquire(Resource::new("order").join("k"))
        .await
        .unwrap();
    let shared = app(Scope::shared("order"));
    for uri in ["/a", "/b"] {
        let answer = send(&shared, post_with_key(uri, "k")).await;
        let json = answer.assert_problem(StatusCode::CONFLICT, "lock-held");
        assert_eq!(json["resource"], "order:k");
    }
    held.release().await;
    assert_eq!(runs.get(), 0);
}

// ------------------------------------------------------------------------------------
// store unavailable

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_gets_503_and_the_handler_never_runs() {
    let mut servers = RedisServer::start_many(3);
    let locker = redis_locker(&servers, support::patient());
    let runs = Runs::default();
    let app = counting_app(&runs).route_layer(LockLayer::new(locker, header("Idempotency-Key")));
    assert_eq!(
        send(&app, post_with_key("/orders", "warm")).await.status,
        StatusCode::OK
    );
    assert_eq!(runs.get(), 1);
    for server in &mut servers {
        server.kill();
    }
    let answer = send(&app, post_with_key("/orders", "k")).await;
    let json = answer.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "lock-unavailable");
    assert_eq!(answer.retry_after(), 1);
    assert_eq!(json["retry_after_ms"], 1000);
    // Node addresses stay in the logs.
    assert!(!answer.text().contains("127.0.0.1"), "{}", answer.text());
    assert_eq!(runs.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_with_fail_open_runs_unlocked() {
    let mut server = RedisServer::start();
    let locker = redis_locker(std::slice::from_ref(&server), LockOptions::default());
    server.kill();
    let seen = Arc::new(std::sync::Mutex::new(None));
    let app = {
        let seen = seen.clone();
        Router::new()
            .route(
                "/orders",
                post(move |request: AxumRequest| {
                    let seen = seen.clone();
                    async move {
                        *seen.lock().unwrap() = Some((
                            request.extensions().get::<LeaseHandle>().is_some(),
                            request.extensions().get::<Unlocked>().copied(),
                        ));
                        "ran"
                    }
                }),
            )
            .route_layer(
                LockLayer::new(locker, header("Idempotency-Key"))
                    .on_unavailable(Unavailable::FailOpen),
            )
    };
    let answer = send(&app, post_with_key("/orders", "k")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(answer.header("fencing-token").is_none());
    assert_eq!(
        *seen.lock().unwrap(),
        Some((false, Some(Unlocked::StoreUnavailable)))
    );
}

// ------------------------------------------------------------------------------------
// lost leases

/// ttl 1 s, node timeout 50 ms: a lease whose majority stops answering is lost quickly.
fn short_lease_options() -> LockOptions {
    LockOptions::default()
        .ttl(Duration::from_secs(1))
        .node_timeout(Duration::from_millis(50))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lease_with_abort_stops_the_handler_and_gets_503() {
    let mut servers = RedisServer::start_many(3);
    let entered = Arc::new(Notify::new());
    let never = Arc::new(Notify::new());
    let completed = Arc::new(AtomicBool::new(false));
    let dropped = Arc::new(AtomicBool::new(false));
    let app = {
        let (entered, never, completed, dropped) = (
            entered.clone(),
            never.clone(),
            completed.clone(),
            dropped.clone(),
        );
        Router::new()
            .route(
                "/jobs",
                post(move || {
                    let (entered, never, completed) =
                        (entered.clone(), never.clone(), completed.clone());
                    let guard = DropFlag(dropped.clone());
                    async move {
                        let _guard = guard;
                        entered.notify_one();
                        never.notified().await; // never notified
                        completed.store(true, Ordering::SeqCst);
                        "side effect done"
                    }
                }),
            )
            .route_layer(LockLayer::new(
                redis_locker(&servers, short_lease_options()),
                header("Idempotency-Key"),
            ))
    };
    let request = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_with_key("/jobs", "job-1")).await }
    });
    entered.notified().await;
    servers[0].pause();
    servers[1].pause();
    let answer = request.await.unwrap();
    servers[0].resume();
    servers[1].resume();

    let json = answer.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "lock-lost");
    assert_eq!(
        json["resource"],
        route_resource("POST", "/jobs", "job-1").display_name()
    );
    assert!(answer.extensions.get::<LeaseLost>().is_some());
    assert!(
        !completed.load(Ordering::SeqCst),
        "the side effect completed"
    );
    assert!(
        dropped.load(Ordering::SeqCst),
        "the handler future was not dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lease_with_continue_passes_the_response_with_a_marker() {
    let mut servers = RedisServer::start_many(3);
    let entered = Arc::new(Notify::new());
    let app = {
        let entered = entered.clone();
        Router::new()
            .route(
                "/jobs",
                post(move |Extension(lease): Extension<LeaseHandle>| {
                    let entered = entered.clone();
                    async move {
                        entered.notify_one();
                        let cause = lease.lost().await;
                        format!("finished after loss: {cause:?}")
                    }
                }),
            )
            .route_layer(
                LockLayer::new(
                    redis_locker(&servers, short_lease_options()),
                    header("Idempotency-Key"),
                )
                .on_lost(OnLost::Continue),
            )
    };
    let request = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_with_key("/jobs", "job-2")).await }
    });
    entered.notified().await;
    servers[0].pause();
    servers[1].pause();
    let answer = request.await.unwrap();
    servers[0].resume();
    servers[1].resume();

    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        answer.text().starts_with("finished after loss"),
        "{}",
        answer.text()
    );
    let LeaseLost(cause) = *answer
        .extensions
        .get::<LeaseLost>()
        .expect("LeaseLost marker");
    assert!(answer.text().ends_with(&format!("{cause:?}")));
    assert!(answer.header("fencing-token").is_some());
}

// ------------------------------------------------------------------------------------
// release: body end, body drop, client disconnect

/// A router whose `/stream` handler answers with a body fed from the returned channel.
fn streaming_app(
    locker: Redlock,
    hold_through_body: bool,
) -> (Router, mpsc::Receiver<mpsc::Sender<Bytes>>) {
    let (senders_tx, senders_rx) = mpsc::channel(1);
    let app = Router::new()
        .route(
            "/stream",
            get(move || {
                let senders_tx = senders_tx.clone();
                async move {
                    let (tx, rx) = mpsc::channel::<Bytes>(1);
                    senders_tx.send(tx).await.unwrap();
                    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
                    });
                    Body::from_stream(stream)
                }
            }),
        )
        .route_layer(
            LockLayer::new(locker, header("Idempotency-Key")).hold_through_body(hold_through_body),
        );
    (app, senders_rx)
}

fn get_with_key(uri: &str, key: &str) -> Request<Body> {
    Request::get(uri)
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_response_holds_the_lock_until_the_last_frame() {
    let server = RedisServer::start();
    let locker = redis_locker(std::slice::from_ref(&server), support::patient());
    let (app, mut senders) = streaming_app(locker, true);
    let key = lock_key(&route_resource("GET", "/stream", "s1"));

    let response = app
        .clone()
        .oneshot(get_with_key("/stream", "s1"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let tx = senders.recv().await.unwrap();
    let mut body = response.into_body();
    assert!(server.exists(&key), "held while the body streams");

    for chunk in ["first", "second"] {
        tx.send(Bytes::from(chunk)).await.unwrap();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), chunk);
        assert!(server.exists(&key), "held while the body streams");
    }
    // Another request for the key meanwhile: refused.
    send(&app, get_with_key("/stream", "s1"))
        .await
        .assert_problem(StatusCode::CONFLICT, "lock-held");

    drop(tx);
    assert!(body.frame().await.is_none());
    eventually("released after the last frame", PROMPTLY, || {
        !server.exists(&key)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_streaming_response_releases_the_lock() {
    let server = RedisServer::start();
    let locker = redis_locker(std::slice::from_ref(&server), support::patient());
    let (app, mut senders) = streaming_app(locker, true);
    let key = lock_key(&route_resource("GET", "/stream", "s2"));

    let response = app.oneshot(get_with_key("/stream", "s2")).await.unwrap();
    let tx = senders.recv().await.unwrap();
    let mut body = response.into_body();
    tx.send(Bytes::from("part")).await.unwrap();
    assert!(body.frame().await.unwrap().is_ok());
    assert!(server.exists(&key));

    drop(body); // the client went away mid-stream
    eventually("released after the body was dropped", PROMPTLY, || {
        !server.exists(&key)
    })
    .await;
    drop(tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_hold_through_body_the_lock_is_released_when_the_handler_returns() {
    let server = RedisServer::start();
    let locker = redis_locker(std::slice::from_ref(&server), support::patient());
    let (app, mut senders) = streaming_app(locker, false);
    let key = lock_key(&route_resource("GET", "/stream", "s3"));

    let response = app.oneshot(get_with_key("/stream", "s3")).await.unwrap();
    assert!(response.headers().contains_key("fencing-token"));
    let tx = senders.recv().await.unwrap();
    eventually("released while the body is still open", PROMPTLY, || {
        !server.exists(&key)
    })
    .await;
    let mut body = response.into_body();
    tx.send(Bytes::from("late")).await.unwrap();
    assert_eq!(
        body.frame().await.unwrap().unwrap().into_data().unwrap(),
        "late"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_handler_under_cancel_releases_the_lock() {
    let server = RedisServer::start();
    let locker = redis_locker(std::slice::from_ref(&server), support::patient());
    let entered = Arc::new(Notify::new());
    let dropped = Arc::new(AtomicBool::new(false));
    let app = {
        let (entered, dropped) = (entered.clone(), dropped.clone());
        Router::new()
            .route(
                "/jobs",
                post(move || {
                    let entered = entered.clone();
                    let guard = DropFlag(dropped.clone());
                    async move {
                        let _guard = guard;
                        entered.notify_one();
                        std::future::pending::<()>().await;
                        "unreachable"
                    }
                }),
            )
            .route_layer(
                LockLayer::new(locker.clone(), header("Idempotency-Key"))
                    .on_disconnect(OnDisconnect::Cancel),
            )
    };
    let key = lock_key(&route_resource("POST", "/jobs", "d1"));
    let request = tokio::spawn(app.oneshot(post_with_key("/jobs", "d1")));
    entered.notified().await;
    assert!(server.exists(&key));

    request.abort(); // drops the response future
    assert!(request.await.unwrap_err().is_cancelled());
    assert!(dropped.load(Ordering::SeqCst), "handler future dropped");
    eventually("released after the disconnect", PROMPTLY, || {
        !server.exists(&key)
    })
    .await;
    eventually("nothing left locally", PROMPTLY, || {
        locker.local_resources() == 0
    })
    .await;
}

// ------------------------------------------------------------------------------------
// placement: Router::layer, route_layer, MethodRouter::layer, ServiceBuilder

async fn resource_of(lease: Extension<LeaseHandle>) -> String {
    lease.resource().to_string()
}

fn post_order(id: &str) -> Request<Body> {
    Request::post(format!("/orders/{id}"))
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn works_with_router_layer() {
    let app = Router::new()
        .route("/orders/{id}", post(resource_of))
        .layer(LockLayer::new(Redlock::in_memory(), path_param("id")));
    let answer = send(&app, post_order("42")).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(
        answer.text(),
        route_resource("POST", "/orders/{id}", "42").as_str()
    );
    assert!(answer.header("fencing-token").is_some());
}

#[tokio::test]
async fn works_with_route_layer() {
    let app = Router::new()
        .route("/orders/{id}", post(resource_of))
        .route_layer(LockLayer::new(Redlock::in_memory(), path_param("id")));
    // Decoded: "a b" is a valid key, "a\nb" (a control character) is not.
    let answer = send(&app, post_order("a%20b")).await;
    assert_eq!(
        answer.text(),
        route_resource("POST", "/orders/{id}", "a b").as_str()
    );
    let answer = send(&app, post_order("a%0Ab")).await;
    answer.assert_problem(StatusCode::BAD_REQUEST, "key-invalid");
    let answer = send(&app, post_order("a-b")).await;
    assert_eq!(
        answer.text(),
        route_resource("POST", "/orders/{id}", "a-b").as_str()
    );
    // Unmatched routes are not locked under route_layer.
    let answer = send(&app, Request::post("/nowhere").body(Body::empty()).unwrap()).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn works_with_method_router_layer() {
    let app = Router::new().route(
        "/orders/{id}",
        post(resource_of)
            .layer(LockLayer::new(Redlock::in_memory(), path_param("id")))
            .get(|| async { "not locked" }),
    );
    let answer = send(&app, post_order("7")).await;
    assert_eq!(
        answer.text(),
        route_resource("POST", "/orders/{id}", "7").as_str()
    );
    let answer = send(&app, Request::get("/orders/7").body(Body::empty()).unwrap()).await;
    assert_eq!(answer.text(), "not locked");
}

fn assert_infallible<S, B>(_: &S)
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
{
}

#[tokio::test]
async fn works_with_service_builder() {
    // Around a whole router: no routing yet, so the scope uses the URI path.
    let router = Router::new().route("/orders/{id}", post(resource_of));
    let service: LockService<Router, _> = ServiceBuilder::new()
        .layer(LockLayer::new(
            Redlock::in_memory(),
            header("Idempotency-Key"),
        ))
        .service(router);
    assert_infallible(&service);
    let response = service
        .clone()
        .oneshot(post_with_key("/orders/9", "k"))
        .await
        .unwrap();
    let answer = Answer::read(response).await;
    assert_eq!(
        answer.text(),
        route_resource("POST", "/orders/9", "k").as_str()
    );

    // Around a plain service_fn with its own body type.
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(
            Redlock::in_memory(),
            header("Idempotency-Key"),
        ))
        .service_fn(|request: Request<Body>| async move {
            let token = request
                .extensions()
                .get::<LeaseHandle>()
                .unwrap()
                .fencing_token();
            Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::from(
                token.to_string(),
            ))))
        });
    assert_infallible(&service);
    let response: Response<LeaseBody<http_body_util::Full<Bytes>>> = service
        .clone()
        .oneshot(post_with_key("/", "k"))
        .await
        .unwrap();
    let answer = Answer::read(response).await;
    assert_eq!(answer.text(), answer.fencing_token().to_string());
    let response = service
        .oneshot(Request::post("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    Answer::read(response)
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-missing");

    // Without a builder.
    let service = LockService::new(
        tower::service_fn(|_: Request<Body>| async {
            Ok::<_, Infallible>(Response::new(Body::from("direct")))
        }),
        Redlock::in_memory(),
        header("Idempotency-Key"),
    );
    assert_infallible(&service);
    let response = service.oneshot(post_with_key("/", "k")).await.unwrap();
    assert_eq!(Answer::read(response).await.text(), "direct");
}

#[tokio::test]
async fn router_layer_also_wraps_the_fallback() {
    let app = Router::new()
        .route("/orders", post(|| async { "ok" }))
        .layer(LockLayer::new(
            Redlock::in_memory(),
            header("Idempotency-Key"),
        ));
    let answer = send(&app, Request::post("/nowhere").body(Body::empty()).unwrap()).await;
    answer.assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    let answer = send(&app, post_with_key("/nowhere", "k")).await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
}

// ------------------------------------------------------------------------------------
// rendering

#[tokio::test]
async fn problem_renderer_can_be_replaced() {
    let locker = Redlock::in_memory();
    let runs = Runs::default();
    let app = counting_app(&runs).route_layer(
        LockLayer::new(locker.clone(), header("Idempotency-Key")).problem_renderer(
            |problem: &Problem| {
                Response::builder()
                    .status(problem.status())
                    .header(CONTENT_TYPE, "text/plain")
                    .body(Bytes::from(format!("nope: {}", problem.kind())))
                    .unwrap()
            },
        ),
    );
    let held = locker
        .try_acquire(route_resource("POST", "/orders", "k"))
        .await
        .unwrap();
    let answer = send(&app, post_with_key("/orders", "k")).await;
    assert_eq!(answer.status, StatusCode::CONFLICT);
    assert_eq!(answer.text(), "nope: lock-held");
    assert_eq!(answer.header("content-type"), Some("text/plain"));
    assert_eq!(answer.header("cache-control"), Some("no-store"));
    assert!(answer.retry_after() >= 1);
    held.release().await;
}
