//! The webhooks example, tested: `examples/webhooks.rs` is included as a module (by
//! `main.rs`), so these tests drive the router the demo serves, with `oneshot`.

use crate::webhooks_example as webhooks;

use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;
use tower_redlock::{Redlock, Resource};

/// Bound on one response; only reached when a test fails.
const RESPONSE_LIMIT: Duration = Duration::from_secs(60);

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, Value) {
    let response = tokio::time::timeout(RESPONSE_LIMIT, app.clone().oneshot(request))
        .await
        .expect("no response")
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// Waits until the lock of `key` on `route` is free: the layer releases a lease in the
/// background once the response is sent, and the next delivery must not meet it.
async fn until_free(locker: &Redlock, route: &str, key: &str) {
    let resource = Resource::new("POST").join(route).join(key);
    let lease = locker.acquire(resource, RESPONSE_LIMIT).await.unwrap();
    lease.release().await;
}

fn stripe(body: &'static str) -> Request<Body> {
    Request::post("/webhooks/stripe?work_ms=0")
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap()
}

#[tokio::test]
async fn stripe_events_with_numeric_ids_are_told_apart() {
    let locker = Redlock::in_memory();
    let app = webhooks::app(locker.clone());
    let (status, first) = send(&app, stripe(r#"{"id":12345,"type":"invoice.paid"}"#)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(first["event"], "12345");
    assert_eq!(first["status"], "processed");
    // Another event: processed, not taken for a duplicate of the first.
    let (_, other) = send(&app, stripe(r#"{"id":999,"type":"invoice.paid"}"#)).await;
    assert_eq!(other["event"], "999");
    assert_eq!(other["status"], "processed");
    // The first again: a duplicate.
    until_free(&locker, "/webhooks/stripe", "12345").await;
    let (_, again) = send(&app, stripe(r#"{"id":12345,"type":"invoice.paid"}"#)).await;
    assert_eq!(again["status"], "duplicate");
}

#[tokio::test]
async fn github_deliveries_are_processed_once() {
    let locker = Redlock::in_memory();
    let app = webhooks::app(locker.clone());
    let delivery = || {
        Request::post("/webhooks/github?work_ms=0")
            .header("x-github-delivery", "72d3162e")
            .header("x-github-event", "push")
            .body(Body::from("{}"))
            .unwrap()
    };
    let (_, first) = send(&app, delivery()).await;
    assert_eq!(first["delivery"], "72d3162e");
    assert_eq!(first["status"], "processed");
    until_free(&locker, "/webhooks/github", "72d3162e").await;
    let (_, again) = send(&app, delivery()).await;
    assert_eq!(again["status"], "duplicate");
}
