//! The HTTP layer: a tower middleware that runs each request under a Redlock lease.
//!
//! [`LockLayer`] finds a key in each request (a header, a path or query parameter, a
//! JSON body field, a closure: see [`key`]), locks the [`Resource`](crate::Resource)
//! named after it, runs the inner service with the lease, and keeps the lease until
//! the response body has been sent. It works with axum ([`Router::route_layer`],
//! [`Router::layer`], [`MethodRouter::layer`]) and any tower stack
//! (`ServiceBuilder`).
//!
//! Prefer `route_layer` — [`Router::route_layer`], or [`MethodRouter::route_layer`] for
//! one route: `post(pay).route_layer(layer)`. It wraps only the handlers of the routed
//! methods, so the router answers a wrong method (405) or an unknown path (404) itself,
//! without a key and without taking a lock. `layer` wraps the router's answers too:
//! with [`MethodRouter::layer`] a `GET` on a `POST` route needs a key, takes (or waits
//! for) the lock and then gets 405; with [`Router::layer`] a request for an unknown path
//! without a key gets 400 rather than 404. Around a whole router (`ServiceBuilder`),
//! routing has not happened yet: `path_param` finds nothing and [`Scope::Route`] uses
//! the URI path instead of the route.
//!
//! ```
//! use axum::{body::Body, routing::post, Extension, Router};
//! use axum::http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_redlock::http::{key::header, Contention, LockLayer};
//! use tower_redlock::{LeaseHandle, Redlock};
//!
//! async fn create_order(Extension(lease): Extension<LeaseHandle>) -> String {
//!     // Pass the fencing token to the storage with every write.
//!     format!("created under token {}", lease.fencing_token())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new()
//!     .route("/orders", post(create_order))
//!     .route_layer(LockLayer::new(Redlock::in_memory(), header("Idempotency-Key")));
//!
//! let request = Request::post("/orders")
//!     .header("Idempotency-Key", "8e03978e")
//!     .body(Body::empty())
//!     .unwrap();
//! let response = app.clone().oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! assert!(response.headers().contains_key("fencing-token"));
//!
//! let no_key = Request::post("/orders").body(Body::empty()).unwrap();
//! let response = app.oneshot(no_key).await.unwrap();
//! assert_eq!(response.status(), StatusCode::BAD_REQUEST); // problem+json, key-missing
//! # }
//! ```
//!
//! # Behaviour
//!
//! | situation | response |
//! |---|---|
//! | no key, [`MissingKey::Reject`] (default) | 400 `key-missing` |
//! | no key, [`MissingKey::Bypass`] | the handler runs without a lock ([`Unlocked::MissingKey`]) |
//! | key empty, too long ([`LockLayer::max_key_len`]), not UTF-8, with a control character, ambiguous | 400 `key-invalid` |
//! | a `path_param` name the matched route does not have (a server mistake, logged as an error) | 500 `key-misconfigured` |
//! | body over the limit of a body key | 413 `body-too-large`, no lock taken |
//! | body key: body not JSON | 400 `body-not-json` |
//! | lock held, [`Contention::Reject`] (default) | 409 `lock-held`, `Retry-After` = the typical length of this layer's critical sections (a moving mean of its handlers' run time in this process), at least 1 s, at most the holder's remaining ttl (the holder's ttl until a section has ended); `retry_after_ms` in the body |
//! | lock held, [`Contention::Wait`], timeout passed | 409 `lock-wait-timeout`, `Retry-After` as for `lock-held` |
//! | a shared lock ([`LockLayer::mode`], [`LockLayer::read_mode`]) with a writer holding it, or a writer waiting for it | 409 `lock-held` (or `lock-wait-timeout`), as for an exclusive lock |
//! | a counted lock ([`LockMode::Counted`](crate::LockMode::Counted)) with every permit taken | 429 `limit-reached` (after the wait under [`Contention::Wait`]), `Retry-After` as for `lock-held`, at most when the earliest permit runs out |
//! | a shared or counted lock on a resource its holders hold in another mode (another `n`: a deploy that changed the limit without draining first) | 503 `lock-unavailable`, `Retry-After: 1`, warning logged naming both modes |
//! | a shared or counted lock on a route whose extractor names several keys | 500 `key-misconfigured`: a lease over several resources is exclusive |
//! | too many waiters ([`LockLayer::queue_limit`]) | 503 `lock-queue-full`, `Retry-After: 1` |
//! | no quorum, [`Unavailable::FailClosed`] (default) | 503 `lock-unavailable`, `Retry-After: 1`; the handler never runs |
//! | no quorum, [`Unavailable::FailOpen`] | the handler runs without a lock ([`Unlocked::StoreUnavailable`]), warning logged |
//! | lease lost mid-handler, [`OnLost::Abort`] (default) | handler future dropped, 503 `lock-lost` |
//! | lease lost mid-handler, [`OnLost::Continue`] | the handler's response with a [`LeaseLost`] extension, warning logged |
//! | acquired | the handler runs with the [`LeaseHandle`](crate::LeaseHandle) and the [`RequestKey`] in the request extensions; `Fencing-Token: <n>` on the response ([`LockLayer::fencing_header`]) |
//! | several keys, one missing (others present) | 400 `key-missing` naming the missing one; nothing locked |
//! | several keys, one invalid | 400 `key-invalid` naming it; nothing locked |
//! | several keys, more than [`MAX_RESOURCES_PER_LEASE`](crate::MAX_RESOURCES_PER_LEASE) distinct ones | 400 `key-invalid`; nothing locked |
//! | several keys, one held | 409 `lock-held` (or `lock-wait-timeout`) naming the held one in `resource` and `detail`; `Retry-After` as for `lock-held`, at most the holders' longest ttl; nothing locked |
//! | several keys, acquired | as for one, with [`RequestKeys`] instead of [`RequestKey`], and one `Fencing-Token` line per resource |
//! | the request holds the resources already (an outer layer, same locker and scope) | the handler runs under that lease: nothing acquired ([`RequestLeases`]) |
//! | the client hangs up while the request waits for its lock | the request is dropped: it never started |
//! | the client hangs up while the handler holds its lease, [`OnDisconnect::Finish`] (default) | the handler runs to its end under its lease; with replay its response is recorded; then the lease is released |
//! | the client hangs up while the handler holds its lease, [`OnDisconnect::Cancel`] | the handler future is dropped, the lease released in the background |
//! | a handler's extractor refuses the request (axum's `text/plain` 400, 415, 422: malformed JSON, no JSON content type, a field of the wrong type), with [`LockLayer::problem_for_rejections`] | the same status as a problem: `bad-request`, `unsupported-media-type`, `unprocessable-content`, the extractor's text as `detail`; the lock was taken (the body is read after it) and is released before the response is sent (`Fencing-Token` present). Without the option: axum's `text/plain` |
//! | the locker is draining ([`Redlock::drain`](crate::Redlock::drain)) | 503 `lock-unavailable`, `Retry-After: 1` |
//! | a streamed body whose lease is lost, [`OnLost::Abort`] | the body ends with a [`LeaseLost`] error: the response is cut short |
//!
//! Refusals are [RFC 9457](https://www.rfc-editor.org/rfc/rfc9457) problems
//! (`application/problem+json`, `Cache-Control: no-store`); see [`problem`] for the
//! `type` URIs and for replacing the renderer. They are responses, not errors: the
//! service's error type is the inner service's, so an `Infallible` service stays
//! `Infallible`.
//!
//! # Several keys per request
//!
//! A transfer debits one account and credits another: with a multi-key extractor —
//! [`json_fields`](key::json_fields), [`each`](key::each) of single-key extractors,
//! [`keys_fn`](key::keys_fn), or your own [`KeyExtractor`](key::KeyExtractor) — every key names a resource of its own (under the layer's
//! [`Scope`]), and the layer locks them all as **one lease**: all or nothing, in a
//! canonical order, so two requests naming the same accounts in opposite orders never
//! deadlock. The same key twice is one resource.
//!
//! ```
//! use axum::{body::Body, routing::post, Extension, Router};
//! use axum::http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_redlock::http::{key::json_fields, LockLayer, RequestKeys, Scope};
//! use tower_redlock::{LeaseHandle, Redlock};
//!
//! async fn transfer(
//!     Extension(keys): Extension<RequestKeys>,
//!     Extension(lease): Extension<LeaseHandle>,
//! ) -> String {
//!     // Each account's fencing token, by the resource its key names.
//!     let from = keys.resource("acct-1").and_then(|r| lease.fencing_token_of(r));
//!     let to = keys.resource("acct-2").and_then(|r| lease.fencing_token_of(r));
//!     format!("debit under {from:?}, credit under {to:?}")
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new().route("/transfers", post(transfer)).route_layer(
//!     LockLayer::new(Redlock::in_memory(), json_fields(["/from", "/to"]))
//!         .scope(Scope::shared("account")),
//! );
//! let request = Request::post("/transfers")
//!     .body(Body::from(r#"{"from": "acct-1", "to": "acct-2", "amount": 5}"#))
//!     .unwrap();
//! let response = app.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! let lines: Vec<_> = response.headers().get_all("fencing-token").iter().collect();
//! assert_eq!(lines.len(), 2); // `<n>;resource="account:acct-1"`, then `account:acct-2`
//! # }
//! ```
//!
//! The **`Fencing-Token` header** of a lease on one resource is the token in decimal,
//! `Fencing-Token: 42`. A lease on several resources gets one field line per resource,
//! in the lease's canonical order, each an [RFC 9651](https://www.rfc-editor.org/rfc/rfc9651)
//! Integer with a `resource` parameter:
//!
//! ```text
//! Fencing-Token: 17;resource="account:acct-1"
//! Fencing-Token: 9;resource="account:acct-2"
//! ```
//!
//! Joined into one line by a proxy (`17;resource="account:acct-1", 9;resource=...`) it is
//! the same RFC 9651 List, which any structured-field parser reads. The parameter is a
//! String (`"` and `\` escaped with `\`) when the resource is printable ASCII, and a
//! Display String (`resource=%"caf%c3%a9"`, UTF-8 percent-encoded) otherwise.
//!
//! # Reentrancy within a request
//!
//! A lock on resources the request already holds — taken by an outer layer or by a
//! `Locked` extractor (feature `axum`), with the same locker (or a clone) and so under
//! the same resource names — reuses that lease: nothing is acquired, nothing waits for
//! itself, and the lease is released with its owner. What the request does not hold yet
//! is acquired as usual. The request's leases are in its extensions, [`RequestLeases`].
//!
//! # Idempotent replay
//!
//! With [`LockLayer::replay`] the first response for a key is recorded in the lock
//! nodes and replayed (`Idempotent-Replayed: true`) to later requests with the same key;
//! the same key with a different request gets 422 `idempotency-key-reused`, and a
//! request whose key is in flight gets 409 `request-in-progress` (or, waiting, the
//! first one's response). See [`replay`] for the full table.
//!
//! # Which lock
//!
//! By default ([`Scope::Route`]) the resource is method, route and key:
//! `Resource::new("POST").join("/orders/{id}").join(key)`, the route being axum's
//! `MatchedPath` when the layer runs after routing, else the URI path. The same key
//! on two routes takes two locks. [`Scope::Shared`] names a lock shared by every route
//! (and by code calling [`Redlock`](crate::Redlock) directly) that uses the same name.
//!
//! # Lease lifetime
//!
//! The lease is released:
//!
//! - before the response is handed on when its body is short and of known length (up
//!   to 1 MiB: the layer reads it under the lease), so head and body leave in one write;
//!   when a longer or streamed body has been produced ([`LeaseBody`]), **before** its end
//!   is handed on — the last frame waits for the nodes to answer the release; either way
//!   a client that read the whole response finds the lock free. Before the response is
//!   sent with [`LockLayer::hold_through_body`]`(false)` or an empty body;
//! - when the handler ends, if the client went away meanwhile ([`OnDisconnect::Finish`]);
//!   at once, in the background, under [`OnDisconnect::Cancel`] or while the request
//!   still waits for its lock;
//! - in the background when the body is dropped before its end (the client left
//!   mid-stream), or when the inner service fails.
//!
//! While it lives, the locker's watchdog renews it. Each locked request runs in a
//! `redlock` tracing span (DEBUG) with the fields `resource`, `outcome`, `wait_ms` and
//! `token`.
//!
//! [`Router::route_layer`]: https://docs.rs/axum/0.8/axum/struct.Router.html#method.route_layer
//! [`Router::layer`]: https://docs.rs/axum/0.8/axum/struct.Router.html#method.layer
//! [`MethodRouter::layer`]: https://docs.rs/axum/0.8/axum/routing/method_routing/struct.MethodRouter.html#method.layer
//! [`MethodRouter::route_layer`]: https://docs.rs/axum/0.8/axum/routing/method_routing/struct.MethodRouter.html#method.route_layer

pub(crate) mod acquire;
pub(crate) mod body;
pub(crate) mod detach;
pub(crate) mod extensions;
mod future;
pub mod key;
mod layer;
mod policy;
pub mod problem;
pub mod replay;
mod section;
mod service;
mod tokens;

pub(crate) use body::BoxError;
pub use body::LeaseBody;
pub use detach::{
    handlers_finishing, FinishOnDisconnect, FinishOnDisconnectLayer, FinishingFuture,
};
pub use extensions::{
    InterruptedAttempt, LeaseLost, RequestKey, RequestKeys, RequestLeases, Unlocked,
};
pub use future::ResponseFuture;
#[cfg(feature = "axum")]
pub(crate) use layer::DEFAULT_MAX_KEY_LEN;
pub use layer::{LockLayer, FENCING_TOKEN};
pub use policy::{Contention, MissingKey, OnDisconnect, OnLost, Scope, Unavailable};
pub use service::LockService;
