//! axum extractors: take a lease inside a handler ([`Locked`]), or read the lease a
//! [`LockLayer`](crate::http::LockLayer) took for the request ([`LayerLease`]).
//!
//! [`LockLayer`](crate::http::LockLayer) is the usual way to lock a route. [`Locked<K>`]
//! takes the lease as the handler's argument, the key found by the same
//! [`KeyExtractor`](crate::http::key::KeyExtractor)s the layer uses, named by a marker
//! type ([`LockKey`], or [`LockSpec`] for settings from the state); [`LayerLease`] hands
//! the handler the layer's lease, and refuses (500 `lock-layer-missing`) when there is
//! none. Refusals are [`LockRejection`]s: the layer's problem responses.
//!
//! Do not build a guard on `axum::middleware::from_extractor::<Locked<K>>`: it drops the
//! extracted value, and with it the lease, before the handler runs.
//!
//! ```
//! use axum::{extract::State, routing::post, Router};
//! use axum::http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_redlock::axum::{LockKey, Locked};
//! use tower_redlock::http::key::{path_param, PathParam};
//! use tower_redlock::Redlock;
//!
//! /// One lock per invoice id, per route (the default scope).
//! struct InvoiceId;
//!
//! impl LockKey for InvoiceId {
//!     type Extractor = PathParam;
//!
//!     fn extractor() -> PathParam {
//!         path_param("id")
//!     }
//! }
//!
//! async fn send_invoice(invoice: Locked<InvoiceId>) -> String {
//!     // ... write with the fencing token ...
//!     format!("sent under token {}", invoice.fencing_token())
//! } // the lease is released here, in the background
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new()
//!     .route("/invoices/{id}/send", post(send_invoice))
//!     .with_state(Redlock::in_memory());
//!
//! let request = Request::post("/invoices/7/send").body(axum::body::Body::empty()).unwrap();
//! let response = app.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! # }
//! ```

mod layer_lease;
mod locked;
mod rejection;
#[cfg(feature = "postgres")]
mod tx;

pub use layer_lease::LayerLease;
pub use locked::{LockKey, LockSpec, Locked};
pub use rejection::LockRejection;
#[cfg(feature = "postgres")]
pub use tx::Tx;
