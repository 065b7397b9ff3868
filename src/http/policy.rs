//! The layer's policies: what a request does when its lock is held, when it has no
//! key, when the lease is lost, when the lock store cannot decide, and which requests
//! share a lock.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::{Extensions, Method, Request, Uri};

use crate::Resource;

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

/// What happens to a handler that holds its lease when its response future is dropped:
/// the client hung up, the connection closed, or a timeout layer outside the lock layer
/// gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnDisconnect {
    /// The critical section runs whole (the default): the handler goes on in a task of
    /// its own under its lease, renewed as before; with replay its response is recorded,
    /// so the client's retry gets it replayed; then the lease is released. Only the loss
    /// of the lease ([`OnLost::Abort`]) cuts it short. A request still waiting for its
    /// lock when the client leaves is dropped, as it never started. Such handlers are
    /// counted: [`handlers_finishing`](super::handlers_finishing).
    #[default]
    Finish,
    /// Drop the handler with the response future, at its next `.await`, and release the
    /// lease in the background. Only for handlers that are safe to cut anywhere.
    Cancel,
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
    /// One lock per name and key, whatever the route: `Resource::from(name).join(key)`
    /// (the name's `:` separate parts, as in any string naming a resource). Routes that
    /// use the same name share locks on purpose, e.g. `Scope::shared("order")` on every
    /// route that changes an order; code using [`Redlock`](crate::Redlock) directly
    /// takes the same lock as `"order:42"` (see [One spelling](Resource#one-spelling)).
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
        let (method, route) = self.prefix_parts(method, uri, extensions);
        self.prefix(method, route).join(key)
    }

    /// The method and route, or `""` (no route's method) and the shared name.
    fn prefix_parts<'a>(
        &'a self,
        method: &'a Method,
        uri: &'a Uri,
        extensions: &'a Extensions,
    ) -> (&'a str, &'a str) {
        match self {
            Scope::Shared(name) => ("", name),
            Scope::Route => {
                let route = matched_path_in(extensions).unwrap_or_else(|| uri.path());
                (method.as_str(), route)
            }
        }
    }

    fn prefix(&self, method: &str, route: &str) -> Resource {
        match self {
            Scope::Shared(_) => Resource::from(route),
            Scope::Route => Resource::new(method).join(route),
        }
    }

    /// [`resource_of`](Scope::resource_of), the prefix from `cache` when it was made
    /// for the same method and route.
    pub(crate) fn resource_cached(
        &self,
        cache: &ScopePrefix,
        method: &Method,
        uri: &Uri,
        extensions: &Extensions,
        key: &str,
    ) -> Resource {
        let (method, route) = self.prefix_parts(method, uri, extensions);
        let made = || (method.into(), route.into(), self.prefix(method, route));
        match cache.0.get_or_init(made) {
            (m, r, cached) if **m == *method && **r == *route => cached.join(key),
            _ => self.prefix(method, route).join(key),
        }
    }
}

/// The resource of a [`Scope`] without its last part (the key), kept by a
/// [`LockService`](super::LockService) with the method and route it was made for: behind
/// `route_layer` a service serves one method and route, and building the same prefix
/// for each request cost two of the three resource names a request's resource took.
#[derive(Debug, Default)]
pub(crate) struct ScopePrefix(OnceLock<(Box<str>, Box<str>, Resource)>);

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
    fn cached_prefixes_name_the_same_resources() {
        let request = |method: Method, uri: &str| {
            Request::builder().method(method).uri(uri).body(()).unwrap()
        };
        let cached = |scope: &Scope, cache: &ScopePrefix, request: &Request<()>, key: &str| {
            scope.resource_cached(
                cache,
                request.method(),
                request.uri(),
                request.extensions(),
                key,
            )
        };
        // Each request fills a cache of its own; every request then hits it or differs
        // from it by method, by route, or by both.
        let routes = [
            (Method::PUT, "/orders/7", "k:1"),
            (Method::PUT, "/orders/7", "k{2}"),
            (Method::POST, "/orders/7", "k:1"),
            (Method::GET, "/orders/7", "k:1"),
            (Method::PUT, "/orders/8", "k:1"),
            (Method::PUT, "/orders/7:", "k"),
            (Method::PUT, "/orders", "7:k"),
            (Method::DELETE, "/x", "1"),
            (Method::PUT, "/orders/{7}", "k"),
            (Method::PUT, "/orders/{8}", "k"),
            (Method::PUT, "/orders/{7", "k"),
            (Method::PUT, "/orders/7}", "k"),
            (Method::PUT, "/orders%2F7", "k"),
            (Method::PUT, "/orders%7", "k"),
            (Method::PUT, "/o", "rders/7:k"),
        ];
        for (method, uri, key) in &routes {
            let cache = ScopePrefix::default();
            cached(&Scope::Route, &cache, &request(method.clone(), uri), key);
            for (method, uri, key) in &routes {
                let request = request(method.clone(), uri);
                assert_eq!(
                    cached(&Scope::Route, &cache, &request, key),
                    Scope::Route.resource(&request, key),
                    "{request:?} {key}"
                );
            }
        }
        let names = [
            ("order", "7"),
            ("order", "8:1"),
            ("PUT", "/orders/7"),
            ("or:der", "7"),
            ("order:", "7"),
            ("orde", "r:7"),
            ("{order}", "7"),
        ];
        let put = request(Method::PUT, "/orders/7");
        for (name, key) in &names {
            let cache = ScopePrefix::default();
            cached(&Scope::shared(*name), &cache, &put, key);
            for (name, key) in &names {
                let scope = Scope::shared(*name);
                assert_eq!(cached(&scope, &cache, &put, key), scope.resource(&put, key));
            }
        }
        // A cache filled by a route scope never names a shared scope's resource.
        let cache = ScopePrefix::default();
        let put = request(Method::PUT, "/orders/7");
        cached(&Scope::Route, &cache, &put, "");
        assert_eq!(
            cached(&Scope::shared("PUT"), &cache, &put, "/orders/7"),
            Scope::shared("PUT").resource(&put, "/orders/7")
        );
    }
}
