//! A Redlock distributed lock around HTTP handlers.
//!
//! Some requests must not run twice at the same time: two clicks on "Pay", a client
//! that retries a timed-out `POST`, a webhook delivered again while the first delivery
//! is still processed. Once a service runs on several machines, a mutex in one process
//! no longer prevents that. `tower-redlock` puts a distributed lock around the handler:
//! a [`LockLayer`](http::LockLayer) (a tower middleware, for axum or any tower stack) finds a key in each
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
//! use tower_redlock::http::{key::path_param, LockLayer};
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
//! | `redis` | yes | the standalone Redis node ([`RedisNode`], `redis://`) |
//! | `cluster` | yes | Redis Cluster ([`ClusterNode`], `redis+cluster://`); implies `redis` |
//! | `sentinel` | yes | Sentinel-managed groups ([`SentinelNode`], `redis+sentinel://`); implies `redis` |
//! | `axum` | yes | [`path_param`](http::key::path_param) keys, axum's matched route in [`Scope::Route`](http::Scope::Route), and the extractors of [`axum`](mod@crate::axum) |
//! | `tls` | no | `rediss://` URLs, through redis-rs's rustls support |
//! | `metrics` | no | records the [`metrics`] listed there through the `metrics` facade, for the exporter the application installs |
//! | `postgres` | no | [`fence::postgres`]: guarded writes to PostgreSQL through sqlx, a stale holder's transaction refused by the database; replay's records in PostgreSQL and the `Tx` extractor; `PostgresNode` (`postgres://`) |
//! | `etcd` | no | `EtcdNode` (`etcd://`): one etcd cluster as a locker's only node |
//! | `test-util` | no | [`test_util`]: a lock store for tests that drives handlers into every path (held, unavailable, lost, slow) without Redis or sleeps |
//!
//! [`Redlock::connect`] and [`node_from_url`] take the URLs of every node kind whose
//! feature is on; without `redis`, `postgres` or `etcd`, only [`MemoryNode`] (one
//! process) is available.
//!
//! # Modules
//!
//! Every public item has one path. The crate root holds what an application uses
//! outside HTTP; the modules hold the rest:
//!
//! | module | what it holds |
//! |---|---|
//! | the root | the engine: [`Redlock`] over N nodes, [`Lease`], [`LockOptions`], [`FencingToken`], the stores ([`MemoryNode`], [`RedisNode`] …), the errors. Knows nothing of HTTP. |
//! | [`fencing`] | how tokens are made across a quorum, why they increase, and the assumptions |
//! | [`fence`] | guarded writes: the storage refuses a stale token ([`fence::postgres`] with `postgres`, [`fence::redis`] with `redis`) |
//! | [`http`] | [`LockLayer`](http::LockLayer) and [`LockService`](http::LockService): the tower middleware, its policies and what it puts in the request |
//! | [`http::key`] | where a request's keys come from: [`KeyExtractor`](http::key::KeyExtractor), the built-ins and the webhook presets |
//! | [`http::problem`] | the RFC 9457 problem responses, [`ProblemRenderer`](http::problem::ProblemRenderer), and [`problem_response`](http::problem::problem_response) for errors of code that locks by hand |
//! | [`http::replay`] | idempotent replay ([`Replay`](http::replay::Replay)): the first response for a key recorded and replayed |
//! | [`axum`](mod@crate::axum) | [`Locked`](crate::axum::Locked), which takes a lease inside a handler, and [`LayerLease`](crate::axum::LayerLease), which reads the layer's |
//! | [`node`] | what implementing a lock store takes: the [`Node`](node::Node) trait, its requests and replies |
//! | [`metrics`] | the metric names, what each counts and when to alert |
//! | `test_util` | with `test-util`: [`TestStore`](crate::test_util::TestStore), the test kit for users' handlers |
//!
//! # Which type do I use
//!
//! | I want to … | use |
//! |---|---|
//! | lock a route by a key of each request | [`http::LockLayer`] with a key from [`http::key`] (`header`, `path_param`, `json_field`, a closure) |
//! | replay the first response to a retried request | [`LockLayer::replay`](http::LockLayer::replay) with [`http::replay::Replay`] |
//! | read the layer's lease (its token) in the handler | [`axum::LayerLease`] (without axum: the [`LeaseHandle`] in the request's extensions) |
//! | take a lock inside a handler, on a name the handler computes | [`axum::Locked`] with a [`LockKey`](crate::axum::LockKey) type |
//! | lock by hand, outside HTTP | [`Redlock::try_acquire`] (refuse when held) or [`Redlock::acquire`] (wait), which give a [`Lease`] |
//! | lock several resources at once | [`Redlock::try_acquire_all`] / [`Redlock::acquire_all`] |
//! | hand the lease's token to a task or a log | [`Lease::handle`] gives a [`LeaseHandle`]: clone-able, token, validity, lost signal |
//! | make the database refuse a stale holder | [`fence::postgres::advance`] or [`fence::redis::set`] with the (exclusive) lease |
//! | choose the stores | [`Redlock::connect`] with URLs; [`MemoryNode`] for one process; [`RedisNode`], [`ClusterNode`], [`SentinelNode`] to build them by hand |
//! | test handlers without Redis | `test_util::TestStore` (feature `test-util`) |
//! | write a store of my own | the [`node`] module |
//!
//! Four names for a lease, from the inside out: a [`Lease`] is the lock you hold (the
//! engine's, released on drop); a [`LeaseHandle`] is a clone-able view of it, which the
//! layer puts in the request; [`LayerLease`](crate::axum::LayerLease) is the axum
//! extractor for that handle; [`Locked`](crate::axum::Locked) is the axum extractor that
//! takes a [`Lease`] itself.
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
//! | `redlock` | DEBUG | `resource`, `outcome`, `wait_ms`, `token` | one request through the [`LockLayer`](http::LockLayer): `outcome` is `acquired`, `lost`, `bypassed`, `fail-open`, `replayed`, `recorded`, `not-recorded` or the [problem code](crate::http::problem) of a refusal | the spans below, `request refused`, `lease lost while the handler ran` |
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
//! details are in [`fencing`] and [`Redlock`].
//!
//! # Layout
//!
//! Imports point down only: [`http`] and [`axum`](mod@crate::axum) use the engine, which
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
#[cfg(all(feature = "redis", feature = "axum"))]
pub mod guide;
pub mod http;
mod lock;
pub mod node;
#[cfg(feature = "test-util")]
pub mod test_util;

/// Appends `bytes` as lowercase hex digits, without a `String` per byte (hashes are
/// written out on every release and every replayed request).
pub(crate) fn push_hex(to: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    to.reserve(2 * bytes.len());
    for b in bytes {
        to.push(DIGITS[usize::from(b >> 4)].into());
        to.push(DIGITS[usize::from(b & 15)].into());
    }
}

/// Locks `mutex` whether or not a panic poisoned it: every mutex of the crate guards
/// state that is whole between statements (a value copied in or out, one insert or
/// remove), so what a panicking holder left behind is still valid.
pub(crate) fn lock_unpoisoned<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

// Each public item has one path. Here: what an application uses outside HTTP. The HTTP
// layer is `http` (its keys `http::key`, replay `http::replay`, problems
// `http::problem`), the extractors `axum`, guarded writes `fence`, and what implementing
// a store takes `node`.
pub use error::{ConfigError, NodeError, NodeFailure};
pub use lock::{fencing, metrics, record};
pub use lock::{
    Backoff, Drained, Lease, LeaseHandle, LockError, LockMode, LockOptions, LostCause,
    MetricsSnapshot, NodeState, NodeStatus, Redlock, ReleaseOutcome, RetryPolicy,
    MAX_RESOURCES_PER_LEASE,
};
#[cfg(feature = "etcd")]
pub use node::etcd::EtcdNode;
pub use node::memory::MemoryNode;
#[cfg(feature = "postgres")]
pub use node::postgres::PostgresNode;
#[cfg(feature = "cluster")]
pub use node::redis::ClusterNode;
#[cfg(feature = "redis")]
pub use node::redis::RedisNode;
#[cfg(feature = "sentinel")]
pub use node::redis::SentinelNode;
pub use node::resource::Resource;
pub use node::token::FencingToken;
pub use node::url::{node_from_url, split_node_urls};

/// The README's Rust snippets, compiled as doc-tests: each compiles as written (the
/// `# ` lines give a fragment its context).
#[cfg(all(doctest, feature = "redis", feature = "axum"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

#[cfg(test)]
mod tests {
    /// Names already stored (replay's per-client scope, the PostgreSQL node's release
    /// channels) were written with `format!("{:02x}")`: a rolling deploy must find them.
    #[test]
    fn push_hex_writes_what_format_wrote() {
        let bytes: Vec<u8> = (0..=255).collect();
        let mut hex = String::from("kept:");
        super::push_hex(&mut hex, &bytes);
        let formatted: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, format!("kept:{formatted}"));
    }
}
