//! Several keys per request (issue 17) through the layer and through `Locked`, and
//! per-request reentrancy, over three real `redis-server`s.
//!
//! Nothing is sequenced by sleeping: a held lock is held by a lease the test owns, and
//! "nothing locked" is read from the servers' keys.
use crate::support;

use std::time::Duration;

use axum::body::Body;
use axum::http::request::Parts;
use axum::routing::post;
use axum::{Extension, Router};
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use support::RedisServer;
use tower::ServiceExt;
use tower_redlock::axum::{LockKey, Locked};
use tower_redlock::http::{
    key::{each, header, json_field, json_fields, keys_fn, Header, KeysFn},
    Contention, LockLayer, RequestKeys, RequestLeases, Scope,
};
use tower_redlock::MAX_RESOURCES_PER_LEASE;
use tower_redlock::{LeaseHandle, Redlock, Resource};

/// Bound on one response; only reached when a test fails.
const RESPONSE_LIMIT: Duration = Duration::from_secs(60);

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    json: Value,
}

impl Answer {
    fn code(&self) -> &str {
        self.json["type"]
            .as_str()
            .and_then(|t| t.rsplit_once('#'))
            .map_or("", |(_, code)| code)
    }

    /// The `Fencing-Token` field lines, in order.
    fn fencing_tokens(&self) -> Vec<String> {
        self.headers
            .get_all("fencing-token")
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    }
}

async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = tokio::time::timeout(RESPONSE_LIMIT, app.clone().oneshot(request))
        .await
        .expect("no response")
        .unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Answer {
        status: parts.status,
        headers: parts.headers,
        json,
    }
}

fn post_json(uri: &str, body: Value) -> Request<Body> {
    Request::post(uri)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

async fn three_nodes() -> (Vec<RedisServer>, Redlock) {
    let servers = RedisServer::start_many(3);
    let locker = Redlock::connect(servers.iter().map(RedisServer::url), support::patient())
        .await
        .unwrap();
    (servers, locker)
}

/// The lock keys (not the fence counters) on `servers`.
fn lock_keys(servers: &[RedisServer]) -> Vec<String> {
    servers
        .iter()
        .flat_map(|server| server.keys("redlock:*"))
        .filter(|key| key.ends_with('}'))
        .collect()
}

fn account(id: &str) -> Resource {
    Resource::new("account").join(id)
}

/// A handler that answers with what the layer left in the extensions: each key's
/// resource and token, read by resource.
async fn report(
    Extension(keys): Extension<RequestKeys>,
    Extension(lease): Extension<LeaseHandle>,
) -> axum::Json<Value> {
    let tokens: Vec<Value> = keys
        .iter()
        .map(|(key, resource)| {
            json!({
                "key": key,
                "resource": resource.as_str(),
                "token": lease.fencing_token_of(resource).map(|t| t.get()),
            })
        })
        .collect();
    axum::Json(json!({ "keys": tokens }))
}

fn transfer_app(locker: &Redlock, contention: Contention) -> Router {
    Router::new().route(
        "/transfers",
        post(report).route_layer(
            LockLayer::new(locker.clone(), json_fields(["/from", "/to"]))
                .scope(Scope::shared("account"))
                .contention(contention),
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_fields_lock_two_resources_with_a_token_each() {
    let (servers, locker) = three_nodes().await;
    let app = transfer_app(&locker, Contention::Reject);
    let answer = send(
        &app,
        post_json("/transfers", json!({"from": "b", "to": "a"})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    // The handler read each key's resource and token; in the extractor's order.
    let keys = answer.json["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0]["key"], "b");
    assert_eq!(keys[0]["resource"], "account:b");
    assert_eq!(keys[1]["resource"], "account:a");
    let token = |i: usize| keys[i]["token"].as_u64().expect("a token per resource");
    // One header line per resource, in canonical (sorted) order.
    assert_eq!(
        answer.fencing_tokens(),
        [
            format!("{};resource=\"account:a\"", token(1)),
            format!("{};resource=\"account:b\"", token(0)),
        ]
    );
    // Each resource's token grows with the next lease on it.
    support::eventually("the lease is released", RESPONSE_LIMIT, || {
        lock_keys(&servers).is_empty()
    })
    .await;
    let again = send(
        &app,
        post_json("/transfers", json!({"from": "a", "to": "c"})),
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.json);
    let a_again = again.json["keys"][0]["token"].as_u64().unwrap();
    assert!(a_again > token(1), "{a_again} > {}", token(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_member_is_named_and_nothing_is_locked() {
    let (servers, locker) = three_nodes().await;
    let other = Redlock::connect(servers.iter().map(RedisServer::url), support::patient())
        .await
        .unwrap();
    let held = other.try_acquire(account("b")).await.unwrap();
    let app = transfer_app(&locker, Contention::Reject);
    let answer = send(
        &app,
        post_json("/transfers", json!({"from": "a", "to": "b"})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CONFLICT, "{}", answer.json);
    assert_eq!(answer.code(), "lock-held");
    assert_eq!(answer.json["resource"], "account:b");
    assert!(
        answer.json["detail"]
            .as_str()
            .unwrap()
            .contains("`account:b`"),
        "{}",
        answer.json
    );
    assert!(answer.headers.contains_key("retry-after"));
    // All or nothing: `a`, taken on a node before `b` was found held there, is released
    // again (in the background, after the answer).
    support::eventually("only `b` is locked", RESPONSE_LIMIT, || {
        lock_keys(&servers)
            .iter()
            .all(|key| key.contains("account:b"))
    })
    .await;
    drop(held);
    support::eventually("the other lease is released", RESPONSE_LIMIT, || {
        lock_keys(&servers).is_empty()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_members_are_refused_before_anything_is_locked() {
    let (servers, locker) = three_nodes().await;
    let app = transfer_app(&locker, Contention::Reject);
    let cases = [
        (json!({"from": "a"}), "key-missing", "`/to`"),
        (json!({"to": "a"}), "key-missing", "`/from`"),
        (json!({"amount": 1}), "key-missing", "`/from`"),
        (json!({"from": "a", "to": ""}), "key-invalid", "`/to`"),
        (json!({"from": "a", "to": true}), "key-invalid", "`/to`"),
        (json!({"from": "a\nb", "to": "c"}), "key-invalid", "`/from`"),
    ];
    for (body, code, names) in cases {
        let answer = send(&app, post_json("/transfers", body.clone())).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{body}: {}",
            answer.json
        );
        assert_eq!(answer.code(), code, "{body}: {}", answer.json);
        let detail = answer.json["detail"].as_str().unwrap();
        assert!(detail.contains(names), "{body}: {detail}");
    }
    // More distinct keys than a lease takes: 400, whatever the extractor.
    let many = keys_fn(|_: &Parts| {
        Some(
            (0..=MAX_RESOURCES_PER_LEASE)
                .map(|i| i.to_string())
                .collect(),
        )
    });
    let app = Router::new().route(
        "/bulk",
        post(|| async { "ran" }).route_layer(LockLayer::new(locker.clone(), many)),
    );
    let answer = send(&app, Request::post("/bulk").body(Body::empty()).unwrap()).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.json);
    assert_eq!(answer.code(), "key-invalid");
    assert!(
        servers.iter().all(|s| s.keys("redlock:*").is_empty()),
        "nothing was even tried"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_twice_is_one_resource() {
    let (_servers, locker) = three_nodes().await;
    let app = transfer_app(&locker, Contention::Reject);
    let answer = send(
        &app,
        post_json("/transfers", json!({"from": "a", "to": "a"})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    assert_eq!(answer.json["keys"].as_array().unwrap().len(), 1);
    // One resource: the single-resource header.
    let lines = answer.fencing_tokens();
    assert_eq!(lines.len(), 1);
    assert!(lines[0].parse::<u64>().is_ok(), "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_header_and_a_field_mix_with_each() {
    let (_servers, locker) = three_nodes().await;
    let app = Router::new().route(
        "/transfers",
        post(report).route_layer(
            LockLayer::new(locker.clone(), each((header("x-from"), json_field("/to"))))
                .scope(Scope::shared("account")),
        ),
    );
    let request = Request::post("/transfers")
        .header("x-from", "a")
        .body(Body::from(r#"{"to":"b"}"#))
        .unwrap();
    let answer = send(&app, request).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    assert_eq!(answer.fencing_tokens().len(), 2);
    let missing = Request::post("/transfers")
        .body(Body::from(r#"{"to":"b"}"#))
        .unwrap();
    let answer = send(&app, missing).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.code(), "key-missing");
    assert!(answer.json["detail"].as_str().unwrap().contains("`x-from`"));
}

// ------------------------------------------------------------------------------------
// Locked with several keys, and reentrancy

/// `x-accounts: a,b`: each account a resource of the `account` scope.
struct Accounts;

impl LockKey for Accounts {
    type Extractor = KeysFn;

    fn extractor() -> KeysFn {
        keys_fn(|parts: &Parts| {
            let list = parts.headers.get("x-accounts")?.to_str().ok()?;
            Some(list.split(',').map(str::to_owned).collect())
        })
    }

    fn scope() -> Scope {
        Scope::shared("account")
    }
}

/// `x-account`: one account of the `account` scope.
struct OneAccount;

impl LockKey for OneAccount {
    type Extractor = Header;

    fn extractor() -> Header {
        header("x-account")
    }

    fn scope() -> Scope {
        Scope::shared("account")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_takes_several_keys_and_names_a_held_one() {
    let (servers, locker) = three_nodes().await;
    let app = Router::new()
        .route(
            "/move",
            post(|lock: Locked<Accounts>| async move {
                let tokens: Vec<Option<u64>> = [account("a"), account("b")]
                    .iter()
                    .map(|r| lock.fencing_token_of(r).map(|t| t.get()))
                    .collect();
                axum::Json(json!({ "tokens": tokens, "own": lock.lease().is_some() }))
            }),
        )
        .with_state(locker.clone());
    let request = || {
        Request::post("/move")
            .header("x-accounts", "b,a")
            .body(Body::empty())
            .unwrap()
    };
    let answer = send(&app, request()).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    assert!(answer.json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .all(Value::is_u64));
    assert_eq!(answer.json["own"], true);

    // The lease is released in the background once the handler is done.
    support::eventually("the lease is released", RESPONSE_LIMIT, || {
        lock_keys(&servers).is_empty()
    })
    .await;
    let held = locker.try_acquire(account("a")).await.unwrap();
    let answer = send(&app, request()).await;
    assert_eq!(answer.status, StatusCode::CONFLICT, "{}", answer.json);
    assert_eq!(answer.json["resource"], "account:a");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_and_extractor_on_one_resource_take_one_lease() {
    let (_servers, locker) = three_nodes().await;
    // The layer locks `account:a` from the header; the handler asks for it again.
    let app = Router::new()
        .route(
            "/accounts",
            post(
                |Extension(layer): Extension<LeaseHandle>, lock: Locked<OneAccount>| async move {
                    axum::Json(json!({
                        "reused": lock.lease().is_none(),
                        "same_token": lock.fencing_token() == layer.fencing_token(),
                    }))
                },
            )
            .route_layer(
                LockLayer::new(locker.clone(), header("x-account"))
                    .scope(Scope::shared("account"))
                    // Waiting for itself would answer 409 after the timeout, not at once.
                    .contention(Contention::Wait {
                        timeout: RESPONSE_LIMIT,
                    }),
            ),
        )
        .with_state(locker.clone());
    let before = locker.metrics().acquired;
    let request = Request::post("/accounts")
        .header("x-account", "a")
        .body(Body::empty())
        .unwrap();
    let answer = send(&app, request).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    assert_eq!(answer.json["reused"], true);
    assert_eq!(answer.json["same_token"], true);
    assert_eq!(locker.metrics().acquired - before, 1, "one acquisition");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inside_a_locked_request_another_resource_is_acquired_and_a_held_one_reused() {
    let (_servers, locker) = three_nodes().await;
    // The layer holds `a` and `b`; the handler locks `b` (reused) and `c` (acquired).
    let app = Router::new()
        .route(
            "/transfers",
            post(
                |Extension(leases): Extension<RequestLeases>,
                 one: Locked<OneAccount>,
                 two: Locked<Accounts>| async move {
                    let tokens = ["a", "b", "c"]
                        .map(|id| leases.fencing_token_of(&account(id)).map(|t| t.get()));
                    axum::Json(json!({
                        "one_reused": one.lease().is_none(),
                        "two_own": two.lease().is_some(),
                        "two_reused": two.reused().len(),
                        "tokens": tokens,
                    }))
                },
            )
            .route_layer(
                LockLayer::new(locker.clone(), json_fields(["/from", "/to"]))
                    .scope(Scope::shared("account")),
            ),
        )
        .with_state(locker.clone());
    let before = locker.metrics().acquired;
    let request = Request::post("/transfers")
        .header("x-account", "b")
        .header("x-accounts", "b,c")
        .body(Body::from(r#"{"from":"a","to":"b"}"#))
        .unwrap();
    let answer = send(&app, request).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    assert_eq!(answer.json["one_reused"], true);
    assert_eq!(answer.json["two_own"], true, "`c` is acquired");
    assert_eq!(answer.json["two_reused"], 1, "`b` is the layer's");
    // The extension the handler got was taken before `two` ran: a and b only.
    assert!(answer.json["tokens"][0].is_u64() && answer.json["tokens"][1].is_u64());
    assert_eq!(
        locker.metrics().acquired - before,
        2,
        "the layer's set, and `c`"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_runs_out_names_the_held_member() {
    let (servers, locker) = three_nodes().await;
    let held = locker.try_acquire(account("b")).await.unwrap();
    // A short wait: the holder keeps `b` for the whole test, so it always runs out.
    let app = transfer_app(
        &locker,
        Contention::Wait {
            timeout: Duration::from_millis(50),
        },
    );
    let answer = send(
        &app,
        post_json("/transfers", json!({"from": "a", "to": "b"})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CONFLICT, "{}", answer.json);
    assert_eq!(answer.code(), "lock-wait-timeout");
    assert_eq!(answer.json["resource"], "account:b");
    assert!(answer.json["detail"]
        .as_str()
        .unwrap()
        .contains("`account:b`"));
    assert!(answer.headers.contains_key("retry-after"));
    // All or nothing: `a`, taken on a node before `b` was found held there, is released
    // again (in the background, after the answer).
    support::eventually("only `b` is locked", RESPONSE_LIMIT, || {
        lock_keys(&servers)
            .iter()
            .all(|key| key.contains("account:b"))
    })
    .await;
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_layers_on_one_resource_take_one_lease() {
    let (_servers, locker) = three_nodes().await;
    let layer = || {
        LockLayer::new(locker.clone(), header("x-account"))
            .scope(Scope::shared("account"))
            .contention(Contention::Wait {
                timeout: RESPONSE_LIMIT,
            })
    };
    // The route's layer runs inside the router's: both name `account:a`.
    let app = Router::new()
        .route(
            "/accounts",
            post(|Extension(leases): Extension<RequestLeases>| async move {
                leases.iter().count().to_string()
            })
            .route_layer(layer()),
        )
        .layer(layer());
    let before = locker.metrics().acquired;
    let request = Request::post("/accounts")
        .header("x-account", "a")
        .body(Body::empty())
        .unwrap();
    let answer = send(&app, request).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json);
    assert_eq!(answer.json, 1, "one lease in the request");
    assert_eq!(locker.metrics().acquired - before, 1, "one acquisition");
    // The header is the layer's single-resource form, once.
    assert_eq!(answer.fencing_tokens().len(), 1);
}
