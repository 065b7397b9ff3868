//! A Redlock distributed lock around HTTP handlers.
//!
//! Some requests must not run twice at the same time: two clicks on "Pay", a client
//! that retries a timed-out `POST`, a webhook delivered again while the first delivery
//! is still processed. Once a service runs on several machines, a mutex in one process
//! no longer prevents that. `tower-redlock` puts a distributed lock around the handler:
//! a [`LockLayer`] (a tower middleware, for axum or any tower stack) finds a key in each
//! request — a path parameter, a header such as `Idempotency-Key`, a JSON field, a
//! webhook's delivery id — and runs the handler only while holding the lock on that key.
//! A second request with the same key gets `409 Conflict` (or waits its turn), as an
//! [RFC 9457](https://www.rfc-editor.org/rfc/rfc9457) problem with `Retry-After`.
//!
//! Every lease carries a [`FencingToken`] that grows from one holder to the next, so
//! the storage can refuse a late write from a holder whose lease ran out (see
//! [`fencing`]): a lock alone cannot promise that.
//!
//! ```
//! use axum::{routing::post, Router};
//! use tower_redlock::axum::LayerLease;
//! use tower_redlock::http::{path_param, LockLayer};
//! use tower_redlock::Redlock;
//!
//! async fn pay(lease: LayerLease) -> String {
//!     // Runs once at a time per order id, on every instance sharing the lock store.
//!     // Pass the token to the storage with the write; it refuses smaller ones.
//!     format!("paid under fencing token {}", lease.fencing_token())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // In production: Redlock::connect(["redis://10.0.0.1", "redis://10.0.0.2",
//! // "redis://10.0.0.3"], LockOptions::default())?
//! let locker = Redlock::in_memory();
//! let app: Router = Router::new()
//!     .route("/orders/{id}/pay", post(pay))
//!     .route_layer(LockLayer::new(locker, path_param("id")));
//! # use tower::ServiceExt;
//! # let request = http::Request::post("/orders/42/pay").body(axum::body::Body::empty()).unwrap();
//! # let response = app.oneshot(request).await.unwrap();
//! # assert_eq!(response.status(), http::StatusCode::OK);
//! # assert!(response.headers().contains_key("fencing-token"));
//! # }
//! ```
//!
//! The [`http`] module documents what the client hears in each situation (lock held,
//! key missing, store down, lease lost), [`LockOptions`] how leases are taken and
//! renewed, and [`fencing`] what the tokens guarantee and under which assumptions.
//!
//! # Features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `redis` | yes | the Redis nodes ([`RedisNode`], [`ClusterNode`], [`SentinelNode`]), [`Redlock::connect`] and [`node_from_url`] |
//! | `axum` | yes | [`path_param`](http::path_param) keys, axum's matched route in [`Scope::Route`], and the extractors of [`axum`](mod@crate::axum) |
//! | `tls` | no | `rediss://` URLs, through redis-rs's rustls support |
//!
//! Without `redis`, only [`MemoryNode`] (one process) is available.
//!
//! # Modules
//!
//! | module | what it holds |
//! |---|---|
//! | [`lock`] | the lock engine: [`Redlock`] over N nodes, [`Lease`], [`LockOptions`], the [`Node`] trait, [`MemoryNode`], the Redis nodes. Knows nothing of HTTP. |
//! | [`fencing`] | [`FencingToken`]: how tokens are made across a quorum, why they increase, and the assumptions |
//! | [`http`] | [`LockLayer`] and [`LockService`]: the tower middleware and its policies |
//! | [`http::key`] | where a request's key comes from: [`KeyFromParts`], [`KeyExtractor`], the built-ins and the webhook presets |
//! | [`http::problem`] | the RFC 9457 problem responses and [`ProblemRenderer`] |
//! | [`axum`](mod@crate::axum) | [`Locked`](crate::axum::Locked), which takes a lease inside a handler, and [`LayerLease`](crate::axum::LayerLease), which reads the layer's |
//!
//! The most used items are re-exported at the crate root.
//!
//! # Safety in one paragraph
//!
//! Redlock tolerates `(N−1)/2` of `N` independent nodes failing, as long as the clocks
//! of the nodes run at about the same rate and a node does not lose keys while they
//! should live (persistence with `appendfsync always`, or a restart delayed by one
//! ttl). A process paused longer than its lease (GC, swap, a stopped VM) can still
//! write after another took over: that is what the fencing token is for. The details
//! are in [`fencing`] and [`lock`].
#![warn(missing_docs, rust_2018_idioms)]
#![deny(unsafe_code)]

#[cfg(feature = "axum")]
pub mod axum;
mod error;
pub mod http;
pub mod lock;

pub use crate::http::{
    Contention, KeyExtractor, KeyFromParts, KeyRejection, LeaseBody, LeaseLost, LockLayer,
    LockService, MissingKey, OnLost, Problem, ProblemKind, ProblemRenderer, Replay, Scope,
    Unavailable,
};
pub use error::{ConfigError, LockError, NodeError, NodeFailure};
pub use lock::fencing::{self, FencingToken};
#[cfg(feature = "redis")]
pub use lock::{node_from_url, ClusterNode, RedisNode, SentinelNode};
pub use lock::{
    Backoff, Lease, LeaseHandle, LockOptions, LostCause, MemoryNode, MetricsSnapshot, Node,
    NodeState, NodeStatus, Redlock, ReleaseOutcome, Resource, RetryPolicy,
};
