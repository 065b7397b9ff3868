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
//! [`fencing`]; [`fence`] makes PostgreSQL and Redis refuse it): a lock alone cannot
//! promise that.
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
//! // "redis://10.0.0.3"], LockOptions::default()).await?
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
//! | `redis` | yes | the standalone Redis node ([`RedisNode`]), [`Redlock::connect`] and [`node_from_url`] |
//! | `cluster` | yes | Redis Cluster ([`ClusterNode`], `redis+cluster://`); implies `redis` |
//! | `sentinel` | yes | Sentinel-managed groups ([`SentinelNode`], `redis+sentinel://`); implies `redis` |
//! | `axum` | yes | [`path_param`](http::path_param) keys, axum's matched route in [`Scope::Route`], and the extractors of [`axum`](mod@crate::axum) |
//! | `tls` | no | `rediss://` URLs, through redis-rs's rustls support |
//! | `metrics` | no | records the [`metrics`] listed there through the `metrics` facade, for the exporter the application installs |
//! | `postgres` | no | [`fence::postgres`]: guarded writes to PostgreSQL through sqlx, a stale holder's transaction refused by the database |
//! | `test-util` | no | [`test_util`]: a lock store for tests that drives handlers into every path (held, unavailable, lost, slow) without Redis or sleeps |
//!
//! Without `redis`, only [`MemoryNode`] (one process) is available.
//!
//! # Modules
//!
//! | module | what it holds |
//! |---|---|
//! | [`lock`] | the lock engine: [`Redlock`] over N nodes, [`Lease`], [`LockOptions`], waiting, the watchdog, outcome records ([`lock::record`]), many resources in one lease ([`Redlock::try_acquire_all`]). Knows nothing of HTTP nor Redis. |
//! | [`fencing`] | [`FencingToken`]: how tokens are made across a quorum, why they increase, and the assumptions |
//! | [`fence`] | guarded writes: the storage refuses a stale token ([`fence::postgres`] with `postgres`, [`fence::redis`] with `redis`) |
//! | [`http`] | [`LockLayer`] and [`LockService`]: the tower middleware and its policies |
//! | [`http::key`] | where a request's key comes from: [`KeyFromParts`], [`KeyExtractor`], the built-ins and the webhook presets |
//! | [`http::problem`] | the RFC 9457 problem responses, [`ProblemRenderer`], and [`problem_response`](http::problem::problem_response) for errors of code that locks by hand |
//! | [`http::replay`] | idempotent replay ([`Replay`]): the first response for a key recorded and replayed |
//! | [`axum`](mod@crate::axum) | [`Locked`](crate::axum::Locked), which takes a lease inside a handler, and [`LayerLease`](crate::axum::LayerLease), which reads the layer's |
//! | [`node`] | the lock stores: the [`Node`] trait and what implementing one takes, [`MemoryNode`], the Redis nodes (feature `redis`) |
//! | [`metrics`] | the metric names, what each counts and when to alert |
//! | `test_util` | with `test-util`: [`TestStore`](crate::test_util::TestStore), the test kit for users' handlers |
//!
//! # At the crate root
//!
//! The items most applications use are re-exported here, by what they are for:
//!
//! | for | items |
//! |---|---|
//! | locking | [`Redlock`] (the locker over N nodes), [`LockOptions`] (ttl, timeouts, waiting, fencing), [`Resource`] (the name of a lock), [`RetryPolicy`] and [`Backoff`] (how a waiting acquire retries) |
//! | a held lock | [`Lease`] (owned: released on drop), [`LeaseHandle`] (a cheap view of it: token, validity, lost signal), [`FencingToken`] (the number the storage checks), [`LostCause`] (why a lease ended), [`ReleaseOutcome`] (what an explicit release found) |
//! | nodes | [`MemoryNode`] (in process), [`RedisNode`], [`ClusterNode`] and [`SentinelNode`] (features `redis`, `cluster`, `sentinel`), [`node_from_url`] (one from a URL), the [`Node`] trait |
//! | the HTTP layer | [`LockLayer`] and [`LockService`] (the middleware), [`LeaseBody`] (the response body holding the lease) |
//! | its policies | [`Contention`] (refuse or wait), [`MissingKey`], [`OnLost`], [`Unavailable`], [`Scope`] (which requests share a lock), [`Replay`] (idempotent replay) |
//! | keys | [`KeyFromParts`] (a key from the request head; closures are one), [`KeyExtractor`] (from the whole request, body included), [`KeyRejection`] (a malformed key) |
//! | refusals | [`Problem`], [`ProblemKind`] (one per problem type), [`ProblemRenderer`] (the format); [`LeaseLost`] marks a response whose lease was lost |
//! | errors | [`LockError`] (contention, no quorum, lost), [`NodeError`] and [`NodeFailure`] (one node's failure), [`ConfigError`] (options that cannot work) |
//! | observing | [`MetricsSnapshot`] ([`Redlock::metrics`]); the [`metrics`] names (feature `metrics`) |
//!
//! Four names for a lease, from the inside out: a [`Lease`] is the lock you hold (the
//! engine's); a [`LeaseHandle`] is a clone-able view of it, which the layer puts in the
//! request; [`LayerLease`](crate::axum::LayerLease) is the axum extractor for that
//! handle; [`Locked`](crate::axum::Locked) is the axum extractor that takes a [`Lease`]
//! itself. See CHANGELOG.md for the names reviewed and why they stay.
//!
//! # Observability
//!
//! With the `metrics` feature the engine and the layer record counters, histograms and
//! a gauge through the `metrics` facade: acquisitions by outcome, time to acquire
//! (waiting included), hold time, leases lost, renewals, node errors, waiters, HTTP
//! refusals and replays. The [`metrics`] module lists them, with what each counts and
//! when to alert. [`Redlock::metrics`] keeps per-locker counters without any feature.
//!
//! Spans and events go through `tracing`. These span and field names are stable (a
//! change is a breaking change); messages are not:
//!
//! | span | level | fields | covers | events inside |
//! |---|---|---|---|---|
//! | `redlock` | DEBUG | `resource`, `outcome`, `wait_ms`, `token` | one request through the [`LockLayer`]: `outcome` is `acquired`, `lost`, `bypassed`, `fail-open`, `replayed`, `recorded`, `not-recorded` or the [problem code](crate::http::problem) of a refusal | the spans below, `request refused`, `lease lost while the handler ran` |
//! | `redlock.wait` | DEBUG | `resource` | one [`acquire`](Redlock::acquire) call: queueing in this process, then rounds until acquired or the deadline | `redlock.acquire` spans |
//! | `redlock.acquire` | DEBUG | `resource` | one Redlock round on every node (and the fence write-back) | `lease acquired` (`votes`, `token`, `elapsed`), `resource held` (`held`, `won`, `elapsed`), `no quorum` (WARN: `answered`, `quorum`, `failures`), `majority won too slowly` (WARN: `validity`, `elapsed`) |
//! | `redlock.extend` | DEBUG | `resource`, `token` | one extend round (the watchdog's or [`Lease::extend`]) | `lease extended` (TRACE: `votes`, `elapsed`), `extend round failed` (`votes`, `failures`) |
//! | `redlock.release` | DEBUG | `resource`, `token` | one release round | `lease released` (`outcome`, `held_for`) |
//!
//! `lease lost` (WARN: `resource`, `token`, `cause`) is emitted where the loss is
//! noticed, usually in the watchdog's `redlock.extend` span. `resource` is the encoded
//! [`Resource`]: it may contain request keys, so filter these spans out of logs that
//! must not hold them.
//!
//! # Safety in one paragraph
//!
//! Redlock tolerates `(N−1)/2` of `N` independent nodes failing, as long as the clocks
//! of the nodes run at about the same rate and a node does not lose keys while they
//! should live (persistence with `appendfsync always`, or a restart delayed by one
//! ttl). A process paused longer than its lease (GC, swap, a stopped VM) can still
//! write after another took over: that is what the fencing token is for, once the
//! storage checks it ([`fence`]: PostgreSQL and Redis refuse the stale write). The
//! details are in [`fencing`] and [`lock`].
//!
//! # Layout
//!
//! Imports point down only: [`http`] and [`axum`](mod@crate::axum) use [`lock`], which
//! uses [`node`], which uses only the errors. ARCHITECTURE.md in the repository says
//! what lives where.
#![warn(
    missing_docs,
    rust_2018_idioms,
    unreachable_pub,
    missing_debug_implementations
)]
#![deny(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

#[cfg(feature = "axum")]
pub mod axum;
mod error;
pub mod fence;
pub mod http;
pub mod lock;
pub mod node;
#[cfg(feature = "test-util")]
pub mod test_util;

// The HTTP layer: the middleware, its policies, keys and problems.
pub use crate::http::{
    Contention, KeyExtractor, KeyFromParts, KeyRejection, LeaseBody, LeaseLost, LockLayer,
    LockService, MissingKey, OnDisconnect, OnLost, Problem, ProblemKind, ProblemRenderer, Replay,
    Scope, Unavailable,
};
// Errors, one per level: a node's, the configuration's, the engine's.
pub use error::{ConfigError, NodeError, NodeFailure};
// The engine: the locker, its options and leases, fencing and metrics.
pub use lock::fencing::{self, FencingToken};
pub use lock::metrics;
pub use lock::{
    Backoff, Drained, Lease, LeaseHandle, LockError, LockOptions, LostCause, MetricsSnapshot,
    NodeState, NodeStatus, Redlock, ReleaseOutcome, RetryPolicy, MAX_RESOURCES_PER_LEASE,
};
// The stores.
#[cfg(feature = "cluster")]
pub use node::ClusterNode;
#[cfg(feature = "etcd")]
pub use node::EtcdNode;
#[cfg(feature = "sentinel")]
pub use node::SentinelNode;
#[cfg(feature = "redis")]
pub use node::{node_from_url, RedisNode};
pub use node::{MemoryNode, Node, Resource};

/// The README's Rust snippets, compiled as doc-tests: each compiles as written (the
/// `# ` lines give a fragment its context).
#[cfg(all(doctest, feature = "redis", feature = "axum"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
