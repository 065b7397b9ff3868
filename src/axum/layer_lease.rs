//! [`LayerLease`]: the lease a [`LockLayer`](crate::http::LockLayer) took, for the
//! handler.

use std::convert::Infallible;
use std::ops::Deref;

use ::axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;

use super::LockRejection;
use crate::http::problem::{Problem, ProblemKind};
use crate::http::Unlocked;
use crate::LeaseHandle;

/// An extractor for the lease that [`LockLayer`](crate::http::LockLayer) took for this
/// request.
///
/// Derefs to the [`LeaseHandle`]. The same as `Extension<LeaseHandle>`, with a rejection
/// that says what is wrong: without a lease in the request (no layer, or one that let
/// the request through unlocked) the handler does not run and the client gets 500
/// `lock-layer-missing`. Handlers that may run unlocked
/// take `Option<LayerLease>`.
#[derive(Debug, Clone)]
pub struct LayerLease(pub LeaseHandle);

impl Deref for LayerLease {
    type Target = LeaseHandle;

    fn deref(&self) -> &LeaseHandle {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for LayerLease {
    type Rejection = LockRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        if let Some(handle) = parts.extensions.get::<LeaseHandle>() {
            return Ok(LayerLease(handle.clone()));
        }
        let detail = match parts.extensions.get::<Unlocked>() {
            None => {
                "this route has no LockLayer, but its handler needs the lease one takes \
                 (LayerLease): add the layer to the route (route_layer), or take the lease \
                 in the handler with Locked"
            }
            Some(Unlocked::MissingKey) => {
                "the LockLayer of this route let the request through without a lock \
                 (no key, MissingKey::Bypass), but its handler needs the lease (LayerLease): \
                 take Option<LayerLease> in handlers that may run unlocked"
            }
            Some(Unlocked::StoreUnavailable) => {
                "the LockLayer of this route let the request through without a lock \
                 (lock store unavailable, Unavailable::FailOpen), but its handler needs \
                 the lease (LayerLease): take Option<LayerLease> in handlers that may run \
                 unlocked"
            }
        };
        tracing::error!(path = %parts.uri.path(), "{detail}");
        Err(LockRejection::from(Problem::new(
            ProblemKind::LockLayerMissing,
            detail,
        )))
    }
}

/// `Option<LayerLease>`: `None` when the request carries no lease, for handlers that
/// also run unlocked.
impl<S: Send + Sync> OptionalFromRequestParts<S> for LayerLease {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<LeaseHandle>()
            .cloned()
            .map(LayerLease))
    }
}

/// The layer's lease: every resource it holds with its token.
impl crate::fence::Fenced for LayerLease {
    fn tokens(&self) -> Vec<(crate::Resource, crate::FencingToken)> {
        self.0.tokens()
    }

    fn mode(&self) -> crate::LockMode {
        self.0.mode()
    }
}
