//! Webhook receivers for GitHub and Stripe that process each delivery once.
//!
//! ```sh
//! cargo run --example webhooks        # PORT (default 3002), LOCK_URLS as in `orders`
//!
//! # Two copies of one GitHub delivery at once: one is processed, the other gets 409.
//! curl -s -X POST localhost:3002/webhooks/github -H 'X-GitHub-Delivery: 72d3162e' \
//!      -H 'X-GitHub-Event: push' -d '{}' &
//! curl -s -X POST localhost:3002/webhooks/github -H 'X-GitHub-Delivery: 72d3162e' \
//!      -H 'X-GitHub-Event: push' -d '{}'; wait
//! # The same delivery again, later: recognised as a duplicate (200).
//! curl -s -X POST localhost:3002/webhooks/github -H 'X-GitHub-Delivery: 72d3162e' -d '{}'
//!
//! # Stripe: the key is the event id in the body.
//! curl -s -X POST localhost:3002/webhooks/stripe -H 'Content-Type: application/json' \
//!      -d '{"id": "evt_1", "type": "invoice.paid"}'
//! ```
//!
//! Senders deliver at least once: they retry on timeouts and errors, and sometimes send
//! the same event twice. Two layers of defence:
//!
//! 1. **Concurrent duplicates** — a retry that arrives while the first delivery is
//!    still being processed — meet the lock: the [`LockLayer`] keyed by the delivery id
//!    (`webhook::github()`: the `X-GitHub-Delivery` header; `webhook::stripe()`: the
//!    event id, the body field `/id`) refuses them with 409 and `Retry-After`, and the
//!    sender retries later.
//! 2. **Sequential redeliveries** — the same delivery again after the first one
//!    finished — find the lock free. The lock alone cannot recognise them: that takes
//!    a record of what was processed (the processed set below; in production a table
//!    written in the same transaction as the delivery's effects), or idempotent replay
//!    of the first response.
//!
//! The lock is what makes the check-then-insert on the processed set safe: no two
//! handlers for one delivery id ever run at once, on any instance sharing the lock.

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tower_redlock::axum::LayerLease;
use tower_redlock::http::{key::webhook, LockLayer, RequestKey};
use tower_redlock::split_node_urls;
use tower_redlock::{LockOptions, Redlock};
use tracing_subscriber::EnvFilter;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Delivery ids already processed, per sender. In one process only: with several
/// instances it belongs in the shared database.
#[derive(Clone, Default)]
struct Processed(Arc<Mutex<HashSet<String>>>);

impl Processed {
    fn contains(&self, id: &str) -> bool {
        self.0.lock().is_ok_and(|set| set.contains(id))
    }

    fn insert(&self, id: String) {
        if let Ok(mut set) = self.0.lock() {
            set.insert(id);
        }
    }
}

#[derive(Clone, Default)]
struct AppState {
    github: Processed,
    stripe: Processed,
}

#[derive(Deserialize)]
struct Work {
    /// Simulated processing time, to make overlapping deliveries easy to try.
    work_ms: Option<u64>,
}

impl Work {
    fn duration(&self) -> Duration {
        Duration::from_millis(self.work_ms.unwrap_or(500).min(60_000))
    }
}

/// The receivers' router; `tests/http` includes this file and drives it.
pub fn app(locker: Redlock) -> Router {
    Router::new()
        .route(
            "/webhooks/github",
            post(github).route_layer(LockLayer::new(locker.clone(), webhook::github())),
        )
        .route(
            "/webhooks/stripe",
            post(stripe).route_layer(LockLayer::new(locker, webhook::stripe())),
        )
        .with_state(AppState::default())
}

/// `POST /webhooks/github`: runs once at a time per `X-GitHub-Delivery`.
async fn github(
    State(state): State<AppState>,
    Query(work): Query<Work>,
    lease: LayerLease,
    Extension(key): Extension<RequestKey>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Json<Value>) {
    // The delivery id is the key the layer locked: reading the header again could
    // give another one.
    let delivery = key.as_str().to_owned();
    // Verify `X-Hub-Signature-256` over `body` with the webhook secret here.
    if state.github.contains(&delivery) {
        tracing::info!(%delivery, "github: redelivery of a processed delivery, skipped");
        return (
            StatusCode::OK,
            Json(json!({ "delivery": delivery, "status": "duplicate" })),
        );
    }
    tokio::time::sleep(work.duration()).await; // the actual processing
    state.github.insert(delivery.clone());
    let token = lease.fencing_token();
    let event = headers
        .get("x-github-event")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default();
    tracing::info!(%delivery, %event, bytes = body.len(), %token, "github: processed");
    (
        StatusCode::OK,
        Json(json!({
            "delivery": delivery,
            "status": "processed",
            "fencing_token": token.to_string(),
        })),
    )
}

/// `POST /webhooks/stripe`: runs once at a time per event id (`/id` of the body).
async fn stripe(
    State(state): State<AppState>,
    Query(work): Query<Work>,
    lease: LayerLease,
    Extension(key): Extension<RequestKey>,
    body: Bytes,
) -> (StatusCode, Json<Value>) {
    // The layer read the event id from the body and passed the identical bytes on, so
    // `Stripe-Signature` still verifies over `body`: check it here.
    let event: Value = match serde_json::from_slice(&body) {
        Ok(event) => event,
        Err(error) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({ "error": error.to_string() })),
            )
        }
    };
    // The event id is the key the layer locked (a number in `/id` becomes its decimal
    // text): parsing it again as a string would miss numeric ids, and then every such
    // event would look like one and the same.
    let id = key.as_str().to_owned();
    if state.stripe.contains(&id) {
        tracing::info!(%id, "stripe: redelivery of a processed event, skipped");
        return (
            StatusCode::OK,
            Json(json!({ "event": id, "status": "duplicate" })),
        );
    }
    tokio::time::sleep(work.duration()).await; // the actual processing
    state.stripe.insert(id.clone());
    let token = lease.fencing_token();
    tracing::info!(%id, kind = event["type"].as_str(), %token, "stripe: processed");
    (
        StatusCode::OK,
        Json(json!({
            "event": id,
            "status": "processed",
            "fencing_token": token.to_string(),
        })),
    )
}

#[allow(dead_code)] // the binary's entry point; tests/http includes this file
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let port: u16 = match std::env::var("PORT") {
        Ok(port) => port.parse().map_err(|_| format!("PORT: {port:?}"))?,
        // Not 3001: the README starts a second `orders` instance there.
        Err(_) => 3002,
    };
    let urls = split_node_urls(
        &std::env::var("LOCK_URLS")
            .or_else(|_| std::env::var("REDIS_URLS"))
            .unwrap_or_default(),
    );
    let locker = if urls.is_empty() {
        tracing::info!("LOCK_URLS is not set: locking with the in-process MemoryNode");
        Redlock::in_memory()
    } else {
        Redlock::connect(&urls, LockOptions::default()).await?
    };
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app(locker)).await?;
    Ok(())
}
