//! The layer's policies: what a request does when its lock is held, when it has no
//! key, when the lease is lost, when the lock store cannot decide, and which requests
//! share a lock.

use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, Method, Request, Uri};

use crate::lock::Resource;

/// What a request does when another holds its lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Contention {
    /// Answer at once with 409 `lock-held` and `Retry-After` (the default).
    #[default]
    Reject,
    /// Queue for the lock, up to `timeout`; then 409 `lock-wait-timeout`. Requests of
    /// one process queue first-in first-out (see [`Redlock::acquire`](crate::Redlock::acquire)).
    Wait {
        /// How long a request may wait for the lock.
        timeout: Duration,
    },
}

/// What a request without a key does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingKey {
    /// Answer with 400 `key-missing` (the default).
    #[default]
    Reject,
    /// Run the handler without a lock. The request carries [`Unlocked::MissingKey`].
    ///
    /// [`Unlocked::MissingKey`]: super::Unlocked::MissingKey
    Bypass,
}

/// What happens when the lease is lost while the handler runs (renewals failed on a
/// majority of nodes, or the key expired or was taken over).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnLost {
    /// Drop the handler future (stopping it at its next `.await`) and answer 503
    /// `lock-lost` (the default). A handler that has already finished keeps its
    /// response, marked as for [`Continue`](OnLost::Continue).
    #[default]
    Abort,
    /// Let the handler finish; its response carries a [`LeaseLost`] extension and a
    /// warning is logged.
    ///
    /// [`LeaseLost`]: super::LeaseLost
    Continue,
}

/// What a request does when the lock store cannot decide (too few nodes answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unavailable {
    /// Answer 503 `lock-unavailable` with `Retry-After: 1`; the handler does not run
    /// (the default).
    #[default]
    FailClosed,
    /// Run the handler without a lock and log a warning. The request carries
    /// [`Unlocked::StoreUnavailable`]. Only for handlers that are safe without the lock.
    ///
    /// [`Unlocked::StoreUnavailable`]: super::Unlocked::StoreUnavailable
    FailOpen,
}

/// Which requests share a lock: the [`Resource`] locked for a key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Scope {
    /// One lock per route and key (the default):
    /// `Resource::new(method).join(route).join(key)`, where the route is axum's
    /// `MatchedPath` (e.g. `/orders/{id}`) when present (feature `axum`), else the URI
    /// path. The same key on two routes takes two different locks.
    #[default]
    Route,
    /// One lock per name and key, whatever the route: `Resource::new(name).join(key)`.
    /// Routes (and code using [`Redlock`](crate::Redlock) directly) that use the same name share locks
    /// on purpose, e.g. `Scope::shared("order")` on every route that changes an order.
    Shared(Arc<str>),
}

impl Scope {
    /// [`Scope::Shared`] with `name`.
    pub fn shared(name: impl Into<Arc<str>>) -> Self {
        Scope::Shared(name.into())
    }

    /// The resource locked for `key` on `request`.
    pub fn resource<B>(&self, request: &Request<B>, key: &str) -> Resource {
        self.resource_of(request.method(), request.uri(), request.extensions(), key)
    }

    /// [`resource`](Scope::resource) from the parts of a request head: the layer and
    /// the axum extractors name their locks here, so the same request locks the same
    /// resource through either.
    pub(crate) fn resource_of(
        &self,
        method: &Method,
        uri: &Uri,
        extensions: &Extensions,
        key: &str,
    ) -> Resource {
        match self {
            Scope::Route => {
                let route = matched_path_in(extensions).unwrap_or_else(|| uri.path());
                Resource::new(method.as_str()).join(route).join(key)
            }
            Scope::Shared(name) => Resource::new(&**name).join(key),
        }
    }
}

/// The route axum matched (`MatchedPath`), when the layer runs after routing.
#[cfg(feature = "axum")]
pub(crate) fn matched_path_in(extensions: &Extensions) -> Option<&str> {
    extensions
        .get::<axum::extract::MatchedPath>()
        .map(axum::extract::MatchedPath::as_str)
}

/// Without axum there is no router to have matched a route.
#[cfg(not(feature = "axum"))]
pub(crate) fn matched_path_in(_extensions: &Extensions) -> Option<&str> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;

    #[test]
    fn scopes_name_resources() {
        let request = Request::builder()
            .method(Method::PUT)
            .uri("/orders/7?x=1")
            .body(())
            .unwrap();
        assert_eq!(
            Scope::Route.resource(&request, "k:1"),
            Resource::new("PUT").join("/orders/7").join("k:1")
        );
        assert_eq!(
            Scope::shared("order").resource(&request, "7"),
            Resource::new("order").join("7")
        );
        // A shared scope never collides with a route scope: different part counts.
        assert_ne!(
            Scope::shared("PUT").resource(&request, "/orders/7"),
            Scope::Route.resource(&request, "")
        );
    }
}
