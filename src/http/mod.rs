//! The HTTP layer: a tower middleware that runs each request under a Redlock lease.
//!
//! [`LockLayer`] finds a key in each request (a header, a path or query parameter, a
//! JSON body field, a closure: see [`key`]), locks the [`Resource`](crate::Resource)
//! named after it, runs the inner service with the lease, and keeps the lease until
//! the response body has been sent. It works with axum ([`Router::route_layer`],
//! [`Router::layer`], [`MethodRouter::layer`]) and any tower stack
//! (`ServiceBuilder`).
//!
//! Prefer `route_layer` ([`Router::route_layer`], or `post(pay).route_layer(layer)` for
//! one route): the router then answers a wrong method (405) or an unknown path (404)
//! itself, without a key or a lock; see [Where to apply the
//! layer](crate::guide::operations#the-layer). Around a whole router (`ServiceBuilder`),
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
//! What each situation answers (no key, a bad key, the lock held, no quorum, the lease
//! lost, the client gone, …) is the table [*What the client hears*][behaviour] of the
//! README, one row a situation.
//!
//! Refusals are [RFC 9457](https://www.rfc-editor.org/rfc/rfc9457) problems
//! (`application/problem+json`, `Cache-Control: no-store`); see [`problem`] for the
//! `type` URIs and for replacing the renderer. They are responses, not errors: the
//! service's error type is the inner service's, so an `Infallible` service stays
//! `Infallible`.
//!
//! # Several keys per request
//!
//! With a multi-key extractor ([`json_fields`](key::json_fields), [`each`](key::each),
//! [`keys_fn`](key::keys_fn)) every key names a resource of its own, and the layer locks
//! them all as **one lease**, all or nothing ([the guide](crate::guide::keys)).
//!
//! The **`Fencing-Token` header** of a lease on one resource is the token in decimal,
//! `Fencing-Token: 42`; of a lease on several, one field line per resource, in the
//! lease's canonical order, each an [RFC 9651](https://www.rfc-editor.org/rfc/rfc9651)
//! Integer with a `resource` parameter (`Fencing-Token: 17;resource="account:acct-1"`):
//! a String when the resource is printable ASCII, else a Display String
//! (`resource=%"caf%c3%a9"`).
//!
//! # Reentrancy, replay, which lock
//!
//! A lock on resources the request already holds (an outer layer's, a `Locked`
//! extractor's) reuses that lease: see [`RequestLeases`]. [`LockLayer::replay`] records
//! and replays responses: see [`replay`]. Which requests share a lock: [`Scope`].
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
//! [behaviour]: https://crates.io/crates/tower-redlock#what-the-client-hears
//! [`Router::route_layer`]: https://docs.rs/axum/0.8/axum/struct.Router.html#method.route_layer
//! [`Router::layer`]: https://docs.rs/axum/0.8/axum/struct.Router.html#method.layer
//! [`MethodRouter::layer`]: https://docs.rs/axum/0.8/axum/routing/method_routing/struct.MethodRouter.html#method.layer

/// Builder methods that set the setting of their name (in `self`, or in what
/// `self.$via()` gives).
macro_rules! setters {
    ($($via:ident)? {}) => {};
    ($($via:ident)? { $(#[$doc:meta])* $name:ident: $type:ty; $($rest:tt)* }) => {
        $(#[$doc])*
        #[must_use]
        pub fn $name(mut self, $name: $type) -> Self {
            self$(.$via())?.$name = $name;
            self
        }
        setters!($($via)? { $($rest)* });
    };
}

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
pub use detach::{handlers_finishing, FinishOnDisconnectLayer};
pub use extensions::{
    InterruptedAttempt, LeaseLost, RequestKey, RequestKeys, RequestLeases, Unlocked,
};
#[cfg(feature = "axum")]
pub(crate) use layer::DEFAULT_MAX_KEY_LEN;
pub use layer::{LockLayer, FENCING_TOKEN};
pub use policy::{Contention, MissingKey, OnDisconnect, OnLost, Scope, Unavailable};
pub use service::LockService;
