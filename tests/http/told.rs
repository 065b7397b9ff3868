//! What a refused client is told: a `Retry-After` from the layer's typical critical
//! section rather than the holder's ttl, and one error format (the handler's extractor
//! refusals and the `Locked` extractor's, through the layer's renderer).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Extension, Router};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_redlock::http::key::header;
use tower_redlock::http::LockLayer;
use tower_redlock::Redlock;

/// The handlers' signals: one is inside and holds; let it go.
#[derive(Default)]
struct Gate {
    entered: Notify,
    release: Notify,
}

/// `POST /work` locked by `x-key`: `x-work: hold` stays inside until released, a number
/// of ms sleeps that long (tokio's clock), anything else returns at once.
fn worker(locker: Redlock, gate: Arc<Gate>) -> Router {
    async fn work(
        Extension(gate): Extension<Arc<Gate>>,
        headers: axum::http::HeaderMap,
    ) -> &'static str {
        match headers.get("x-work").map(|v| v.to_str().unwrap()) {
            Some("hold") => {
                gate.entered.notify_one();
                gate.release.notified().await
            }
            Some(ms) => tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await,
            None => {}
        }
        "done"
    }
    Router::new()
        .route("/work", post(work))
        .route_layer(LockLayer::new(locker, header("x-key")))
        .layer(Extension(gate))
}

fn request(key: &str, work: Option<&str>) -> Request<Body> {
    let mut request = Request::post("/work").header("x-key", key);
    if let Some(work) = work {
        request = request.header("x-work", work);
    }
    request.body(Body::empty()).unwrap()
}

/// The refusal a request for `key` gets while another holds it, as (`Retry-After`,
/// `retry_after_ms`).
async fn refused_while_held(app: &Router, gate: &Gate, key: &str) -> (u64, u64) {
    let holder = tokio::spawn(app.clone().oneshot(request(key, Some("hold"))));
    gate.entered.notified().await;
    let refused = app.clone().oneshot(request(key, None)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    gate.release.notify_one();
    assert_eq!(holder.await.unwrap().unwrap().status(), StatusCode::OK);
    let secs = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body = axum::body::to_bytes(refused.into_body(), 1 << 16)
        .await
        .unwrap();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    (secs, problem["retry_after_ms"].as_u64().unwrap())
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_the_layers_typical_section_not_the_holders_ttl() {
    let gate = Arc::new(Gate::default());
    let fresh = worker(Redlock::in_memory(), gate.clone());
    // No section has ended: the holder's ttl (10 s) is all the layer knows.
    let (secs, _) = refused_while_held(&fresh, &gate, "a").await;
    assert_eq!(secs, 10);

    let app = worker(Redlock::in_memory(), gate.clone());

    // Sections of 2.5 s (tokio's paused clock): a retry then.
    for _ in 0..3 {
        let done = app
            .clone()
            .oneshot(request("b", Some("2500")))
            .await
            .unwrap();
        assert_eq!(done.status(), StatusCode::OK);
    }
    let (secs, ms) = refused_while_held(&app, &gate, "c").await;
    assert_eq!((secs, ms), (3, 2500));
}

#[tokio::test(start_paused = true)]
async fn sections_that_end_at_once_make_a_retry_after_of_one_second() {
    let gate = Arc::new(Gate::default());
    let app = worker(Redlock::in_memory(), gate.clone());
    for _ in 0..3 {
        let done = app.clone().oneshot(request("a", None)).await.unwrap();
        assert_eq!(done.status(), StatusCode::OK);
    }
    let (secs, ms) = refused_while_held(&app, &gate, "b").await;
    assert_eq!((secs, ms), (1, 1000));
}

/// `POST /orders` locked by `x-key`, its handler taking `Json<Order>`.
fn orders(rejections: bool) -> Router {
    #[derive(serde::Deserialize)]
    struct Order {
        #[allow(dead_code)]
        amount: u64,
    }
    async fn create(axum::Json(_order): axum::Json<Order>) -> &'static str {
        "created"
    }
    Router::new().route("/orders", post(create)).route_layer(
        LockLayer::new(Redlock::in_memory(), header("x-key")).problem_for_rejections(rejections),
    )
}

fn order(content_type: Option<&str>, body: &'static str) -> Request<Body> {
    let mut request = Request::post("/orders").header("x-key", "o1");
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    request.body(Body::from(body)).unwrap()
}

#[tokio::test]
async fn extractor_rejections_behind_the_layer_are_problems_when_asked() {
    let json = Some("application/json");
    let cases = [
        (order(json, "{"), StatusCode::BAD_REQUEST, "bad-request"),
        (
            order(None, r#"{"amount": 1}"#),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
        ),
        (
            order(json, r#"{"amount": "x"}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            "unprocessable-content",
        ),
    ];
    let app = orders(true);
    for (request, status, code) in cases {
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), status);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        // The lock was taken before the body was read.
        assert!(response.headers().contains_key("fencing-token"));
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with(&format!("#{code}")),
            "{problem}"
        );
        assert!(!problem["detail"].as_str().unwrap().is_empty(), "{problem}");
    }
    // Released before the answer: the same key goes in at once.
    let ok = app.oneshot(order(json, r#"{"amount": 1}"#)).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);

    // Not asked: axum's own text.
    let plain = orders(false).oneshot(order(json, "{")).await.unwrap();
    assert_eq!(plain.status(), StatusCode::BAD_REQUEST);
    assert!(plain.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
}

#[tokio::test]
async fn the_layers_renderer_renders_the_locked_extractors_refusals() {
    use tower_redlock::axum::{LockKey, Locked};
    use tower_redlock::http::key::Header;
    use tower_redlock::http::problem::Problem;
    use tower_redlock::http::MissingKey;

    struct Account;
    impl LockKey for Account {
        type Extractor = Header;
        fn extractor() -> Header {
            header("x-account")
        }
    }
    async fn transfer(_lock: Locked<Account>) -> &'static str {
        "moved"
    }
    let locker = Redlock::in_memory();
    let custom = |problem: &Problem| {
        axum::http::Response::builder()
            .status(problem.status())
            .header("content-type", "text/x-custom")
            .body(bytes::Bytes::from(format!("custom {}", problem.kind())))
            .unwrap()
    };
    let app = Router::new()
        .route("/transfer", post(transfer))
        .route_layer(
            LockLayer::new(locker.clone(), header("x-tenant"))
                .missing_key(MissingKey::Bypass)
                .problem_renderer(custom),
        )
        .with_state(locker);
    let request = Request::post("/transfer").body(Body::empty()).unwrap();
    let refused = app.oneshot(request).await.unwrap();
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    assert_eq!(refused.headers()["content-type"], "text/x-custom");
    let body = axum::body::to_bytes(refused.into_body(), 1 << 16)
        .await
        .unwrap();
    assert_eq!(body, "custom key-missing");
}
