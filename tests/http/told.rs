//! What a refused client is told: a `Retry-After` from the layer's typical critical
//! section rather than the holder's ttl.

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
    async fn work(Extension(gate): Extension<Arc<Gate>>, headers: axum::http::HeaderMap) -> &'static str {
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
    let secs = refused.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    let body = axum::body::to_bytes(refused.into_body(), 1 << 16).await.unwrap();
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
        let done = app.clone().oneshot(request("b", Some("2500"))).await.unwrap();
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
