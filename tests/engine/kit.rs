//! The test kit (`test_util::TestStore`): each control drives the layer into its path,
//! through `ServiceExt::oneshot`, without Redis and without sleeps (Tokio's paused
//! clock runs the ttls and delays). Also the README's "Testing your handlers" example,
//! which is the first test here, verbatim.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::{body::Body, routing::post, Extension, Router};
use http::{Request, StatusCode};
use tokio::sync::oneshot;
use tower::ServiceExt;
use tower_redlock::http::{
    key::{path_param, PathParam},
    Contention, LockLayer, OnLost, Unavailable, Unlocked,
};
use tower_redlock::test_util::{TestStore, TestStoreError};
use tower_redlock::{http::LeaseLost, LockOptions, LostCause, Resource};

// README: begin
#[tokio::test(start_paused = true)]
async fn paying_an_order_under_contention_outage_and_loss() {
    use axum::http::{Request, StatusCode};
    use axum::{body::Body, routing::post, Router};
    use tower::ServiceExt;
    use tower_redlock::http::{key::path_param, LockLayer};
    use tower_redlock::test_util::TestStore;
    use tower_redlock::Resource;

    let store = TestStore::new(); // in-process lock nodes and a locker over them
    let app = Router::new()
        .route("/orders/{id}/pay", post(|| async { "paid" }))
        .route_layer(LockLayer::new(store.locker(), path_param("id")));
    let pay = || Request::post("/orders/42/pay").body(Body::empty()).unwrap();
    // The lock the layer takes for that request (method, route, key).
    let order = Resource::new("POST").join("/orders/{id}/pay").join("42");

    // Another instance holds the order: 409, retry when its hold ends.
    store
        .hold(order.clone(), std::time::Duration::from_secs(10))
        .await
        .unwrap();
    let response = app.clone().oneshot(pay()).await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(response.headers()["retry-after"], "10");
    store.release(order).await.unwrap();

    // The lock store is down: fail closed, the handler never runs.
    store.set_available(false);
    let response = app.clone().oneshot(pay()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    store.set_available(true);

    assert_eq!(app.oneshot(pay()).await.unwrap().status(), StatusCode::OK);
}
// README: end

#[test]
fn the_readme_shows_the_first_test_verbatim() {
    let source = include_str!("kit.rs");
    let guide = include_str!("../../docs/testing.md");
    let example = source
        .split("// README: begin\n")
        .nth(1)
        .and_then(|rest| rest.split("// README: end\n").next())
        .expect("markers in tests/engine/kit.rs");
    let block = format!("```rust\n{example}```\n");
    assert!(
        guide.contains(&block),
        "docs/testing.md must show tests/engine/kit.rs's first test verbatim"
    );
}

/// The Rust snippets of the README and the guides import only crates the README's or
/// their own Cargo snippets name (and `std`): rustdoc compiles them (`ReadmeDoctests`
/// in src/lib.rs, the `guide` modules) with every dependency of this crate, so an
/// import of one the docs never name (`http`) would still pass there, and fail in a
/// user's project.
#[test]
fn readme_snippets_import_only_the_crates_it_names() {
    let readme = include_str!("../../README.md");
    let docs = [
        readme,
        include_str!("../../docs/keys.md"),
        include_str!("../../docs/modes.md"),
        include_str!("../../docs/operations.md"),
        include_str!("../../docs/replay.md"),
        include_str!("../../docs/safety.md"),
        include_str!("../../docs/stores.md"),
        include_str!("../../docs/testing.md"),
        include_str!("../../docs/tour.md"),
    ];
    let (readme_named, _) = crates_in(readme);
    let mut imports = Vec::new();
    for doc in docs {
        let (mut named, used) = crates_in(doc);
        named.extend(readme_named.iter().cloned());
        named.extend(["std", "crate", "super"].map(str::to_owned));
        for root in used {
            assert!(
                named.contains(&root),
                "the docs import `{root}`, which none of their Cargo snippets name ({named:?})"
            );
            imports.push(root);
        }
    }
    assert!(imports.len() > 10, "{imports:?}");
}

/// The crates a Markdown text's `toml` blocks name, and the roots its `rust` blocks import.
fn crates_in(doc: &str) -> (Vec<String>, Vec<String>) {
    let (mut named, mut imports) = (Vec::new(), Vec::new());
    let mut block = None;
    for line in doc.lines() {
        match (block.as_deref(), line.strip_prefix("```")) {
            (None, Some(lang)) => block = Some(lang.to_owned()),
            (Some(_), Some(_)) => block = None,
            (Some("toml"), None) => {
                let name = line.split([' ', '=']).next().unwrap_or_default();
                if !name.is_empty() && !name.starts_with('[') {
                    named.push(name.replace('-', "_"));
                }
            }
            (Some(lang), None) if lang.starts_with("rust") => {
                let code = line.trim_start().trim_start_matches("# ");
                if let Some(path) = code.strip_prefix("use ") {
                    let root = path.split("::").next().unwrap_or_default();
                    imports.push(root.trim_start_matches("::").to_owned());
                }
            }
            _ => {}
        }
    }
    (named, imports)
}

/// A route whose handler signals that it runs, then runs until dropped (or, with
/// `finish`, until told to finish).
struct Slow {
    app: Router,
    entered: oneshot::Receiver<()>,
    finish: Option<oneshot::Sender<()>>,
}

fn slow_app(layer: LockLayer<PathParam>) -> Slow {
    let (entered_tx, entered) = oneshot::channel();
    let (finish, finish_rx) = oneshot::channel::<()>();
    let slots = Arc::new(Mutex::new((Some(entered_tx), Some(finish_rx))));
    let handler = move |lease: Option<Extension<tower_redlock::LeaseHandle>>| {
        let slots = slots.clone();
        async move {
            let (entered, finish) = {
                let mut slots = slots.lock().unwrap();
                (slots.0.take(), slots.1.take())
            };
            if let Some(entered) = entered {
                let _ = entered.send(());
            }
            if let Some(finish) = finish {
                let _ = finish.await;
            }
            assert!(lease.is_some());
            "done"
        }
    };
    Slow {
        app: Router::new()
            .route("/jobs/{id}", post(handler))
            .route_layer(layer),
        entered,
        finish: Some(finish),
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

fn job(id: &str) -> Request<Body> {
    Request::post(format!("/jobs/{id}"))
        .body(Body::empty())
        .unwrap()
}

fn job_resource(id: &str) -> Resource {
    Resource::new("POST").join("/jobs/{id}").join(id)
}

async fn problem_code(response: http::Response<Body>) -> String {
    let body = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    json["type"]
        .as_str()
        .and_then(|t| t.rsplit_once('#'))
        .map(|(_, code)| code.to_owned())
        .unwrap_or_default()
}

#[tokio::test(start_paused = true)]
async fn hold_gets_409_with_retry_after_and_release_wakes_a_waiter() {
    let store = TestStore::new();
    let reject = Router::new()
        .route("/jobs/{id}", post(|| async { "done" }))
        .route_layer(LockLayer::new(store.locker(), path_param("id")));
    store
        .hold(job_resource("7"), Duration::from_millis(2500))
        .await
        .unwrap();
    let response = reject.clone().oneshot(job("7")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(response.headers()["retry-after"], "3");
    assert_eq!(problem_code(response).await, "lock-held");
    // Other keys are free.
    assert_eq!(
        reject.oneshot(job("8")).await.unwrap().status(),
        StatusCode::OK
    );

    // Waiting: the request runs once the other owner releases (a wake-up, long
    // before the hold's ttl or the wait's timeout).
    let wait = Router::new()
        .route("/jobs/{id}", post(|| async { "done" }))
        .route_layer(LockLayer::new(store.locker(), path_param("id")).contention(
            Contention::Wait {
                timeout: Duration::from_secs(3600),
            },
        ));
    store.release(job_resource("7")).await.unwrap();
    store
        .hold(job_resource("7"), Duration::from_secs(1800))
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let waiting = tokio::spawn(wait.oneshot(job("7")));
    settle("the request waits", || store.locker().local_resources() > 0).await;
    store.release(job_resource("7")).await.unwrap();
    assert_eq!(waiting.await.unwrap().unwrap().status(), StatusCode::OK);
    assert!(started.elapsed() < Duration::from_secs(1800));
}

#[tokio::test(start_paused = true)]
async fn a_hold_runs_out_with_its_ttl() {
    let store = TestStore::new();
    let locker = store.locker();
    store.hold("r", Duration::from_secs(5)).await.unwrap();
    assert_eq!(store.held(), vec![Resource::from("r")]);
    assert!(locker.try_acquire("r").await.is_err());
    let lease = locker.acquire("r", Duration::from_secs(60)).await.unwrap();
    assert!(lease.is_held());
    lease.release().await;
    // Ran out: no longer listed.
    assert!(store.held().is_empty());
}

#[tokio::test(start_paused = true)]
async fn held_lists_holds_until_released() {
    let store = TestStore::new();
    store.hold("b", Duration::from_secs(5)).await.unwrap();
    let lease = store.locker().try_acquire("a").await.unwrap();
    assert_eq!(store.held(), vec![Resource::from("a"), Resource::from("b")]);
    store.release("b").await.unwrap();
    assert_eq!(store.held(), vec![Resource::from("a")]);
    lease.release().await;
    assert!(store.held().is_empty());
}

#[tokio::test(start_paused = true)]
async fn store_down_gets_503_or_runs_unlocked_with_fail_open() {
    let store = TestStore::new();
    let closed = Router::new()
        .route("/jobs/{id}", post(|| async { "done" }))
        .route_layer(LockLayer::new(store.locker(), path_param("id")));
    let open = Router::new()
        .route(
            "/jobs/{id}",
            post(|unlocked: Option<Extension<Unlocked>>| async move {
                format!("{:?}", unlocked.map(|e| e.0))
            }),
        )
        .route_layer(
            LockLayer::new(store.locker(), path_param("id")).on_unavailable(Unavailable::FailOpen),
        );

    store.set_available(false);
    let response = closed.clone().oneshot(job("1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(problem_code(response).await, "lock-unavailable");
    let response = open.oneshot(job("1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(&body[..], b"Some(StoreUnavailable)");

    store.set_available(true);
    assert_eq!(
        closed.oneshot(job("1")).await.unwrap().status(),
        StatusCode::OK
    );
}

#[tokio::test(start_paused = true)]
async fn a_quorum_survives_one_node_down_and_not_two() {
    let store = TestStore::with_nodes(3, LockOptions::default()).unwrap();
    let app = Router::new()
        .route("/jobs/{id}", post(|| async { "done" }))
        .route_layer(LockLayer::new(store.locker(), path_param("id")));
    // A new key each time: a lease is released in the background once its response
    // is dropped, so the same key at once could still find it held.
    store.node(0).unwrap().set_available(false);
    assert_eq!(
        app.clone().oneshot(job("1")).await.unwrap().status(),
        StatusCode::OK
    );
    store.node(2).unwrap().set_available(false);
    assert_eq!(
        app.clone().oneshot(job("2")).await.unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    store.node(0).unwrap().set_available(true);
    assert_eq!(
        app.oneshot(job("3")).await.unwrap().status(),
        StatusCode::OK
    );
}

#[tokio::test(start_paused = true)]
async fn latency_past_the_node_timeout_on_a_majority_gets_503() {
    let options = LockOptions::default().node_timeout(Duration::from_millis(50));
    let store = TestStore::with_nodes(3, options).unwrap();
    let app = Router::new()
        .route("/jobs/{id}", post(|| async { "done" }))
        .route_layer(LockLayer::new(store.locker(), path_param("id")));

    // Slow but within the timeout: the paused clock moves by the delay.
    store.set_delay(Duration::from_millis(30));
    let started = tokio::time::Instant::now();
    assert_eq!(
        app.clone().oneshot(job("1")).await.unwrap().status(),
        StatusCode::OK
    );
    assert!(started.elapsed() >= Duration::from_millis(30));

    // One node too slow: the other two decide.
    store.set_delay(Duration::ZERO);
    store.node(1).unwrap().set_delay(Duration::from_secs(1));
    assert_eq!(
        app.clone().oneshot(job("2")).await.unwrap().status(),
        StatusCode::OK
    );

    // Two too slow: no quorum in time.
    store.node(2).unwrap().set_delay(Duration::from_secs(1));
    let response = app.oneshot(job("3")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(start_paused = true)]
async fn lose_with_abort_stops_the_handler_and_gets_503() {
    let store = TestStore::new();
    let mut slow = slow_app(LockLayer::new(store.locker(), path_param("id")));
    let running = tokio::spawn(slow.app.clone().oneshot(job("9")));
    (&mut slow.entered).await.unwrap();
    assert_eq!(store.held(), vec![job_resource("9")]);

    store.lose(job_resource("9")).unwrap();
    let response = running.await.unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        response.extensions().get::<LeaseLost>().map(|l| l.0),
        Some(LostCause::KeyLost)
    );
    assert_eq!(problem_code(response).await, "lock-lost");
    assert!(store.held().is_empty());
}

#[tokio::test(start_paused = true)]
async fn lose_with_continue_passes_the_response_marked_lost() {
    let store = TestStore::new();
    let mut slow =
        slow_app(LockLayer::new(store.locker(), path_param("id")).on_lost(OnLost::Continue));
    let running = tokio::spawn(slow.app.clone().oneshot(job("9")));
    (&mut slow.entered).await.unwrap();
    store.lose(job_resource("9")).unwrap();
    let _ = slow.finish.take().unwrap().send(());
    let response = running.await.unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.extensions().get::<LeaseLost>().map(|l| l.0),
        Some(LostCause::KeyLost)
    );
}

#[tokio::test(start_paused = true)]
async fn lose_works_with_the_watchdog_running() {
    let store = TestStore::new();
    let lease = store.locker().try_acquire("w").await.unwrap();
    store.lose("w").unwrap();
    assert_eq!(lease.lost_cause(), Some(LostCause::KeyLost));
    assert_eq!(lease.lost().await, LostCause::KeyLost);
    assert!(!lease.is_held());
    assert!(lease.extend().await.is_err());
    // The next lease gets the resource once the lost one is dropped.
    let token = lease.fencing_token();
    drop(lease);
    let next = store
        .locker()
        .acquire("w", Duration::from_secs(1))
        .await
        .unwrap();
    assert!(next.fencing_token() > token);
}

#[tokio::test(start_paused = true)]
async fn bad_input_is_a_clear_error() {
    let store = TestStore::with_nodes(3, LockOptions::default()).unwrap();
    let lease = store.locker().try_acquire("held-one").await.unwrap();

    match store.node(3) {
        Err(e @ TestStoreError::UnknownNode { index: 3, nodes: 3 }) => {
            assert!(e.to_string().contains("indexes 0 to 2"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    match store.lose("nobody-holds-this") {
        Err(e @ TestStoreError::NotHeld { .. }) => {
            let text = e.to_string();
            assert!(text.contains("nobody-holds-this"), "{text}");
            assert!(text.contains("held-one"), "names what is held: {text}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        store.release("never-held").await,
        Err(TestStoreError::NoHold { .. })
    ));
    assert!(matches!(
        store.hold("x", Duration::ZERO).await,
        Err(TestStoreError::InvalidTtl { .. })
    ));
    // Held by our own lease, or held twice: refused, nothing changed.
    assert!(matches!(
        store.hold("held-one", Duration::from_secs(1)).await,
        Err(TestStoreError::AlreadyHeld { .. })
    ));
    store.hold("y", Duration::from_secs(1)).await.unwrap();
    assert!(matches!(
        store.hold("y", Duration::from_secs(1)).await,
        Err(TestStoreError::AlreadyHeld { .. })
    ));
    store.release("y").await.unwrap();
    assert!(lease.is_held());

    store.set_available(false);
    assert!(matches!(
        store.hold("z", Duration::from_secs(1)).await,
        Err(TestStoreError::Unavailable { .. })
    ));
    assert!(TestStore::with_nodes(0, LockOptions::default()).is_err());
}
