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
