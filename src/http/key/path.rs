//! [`PathParam`]: the key is a parameter of the matched axum route.

use std::sync::Arc;

use http::request::Parts;

use super::{KeyFromParts, KeyRejection};

#[cfg(feature = "axum")]
/// The key is a path parameter of the matched axum route; see [`path_param`].
#[derive(Debug, Clone)]
pub struct PathParam {
    name: Arc<str>,
}

/// The key is the path parameter `name` of the matched axum route, percent-decoded
/// (e.g. `id` in `/orders/{id}`). A matched route without a parameter of that name
/// is a server mistake: 500 `key-misconfigured`, logged as an error.
///
/// Path parameters exist only after routing: apply the layer with
/// [`Router::route_layer`](axum::Router::route_layer), [`Router::layer`](axum::Router::layer)
/// or [`MethodRouter::layer`](axum::routing::MethodRouter::layer), not around the whole
/// router. Outside a router no key is found (and a warning is logged).
///
/// Lock the key as the handler reads it: a `Path<u64>` handler sees `/orders/007` and
/// `/orders/7` as one order, so lock `path_param("id").parse::<u64>()` (see
/// [`KeyFromParts::parse`]), and normalise other spellings (a UUID's case) with
/// [`KeyFromParts::normalize`]; otherwise two requests for one order take two locks.
#[cfg(feature = "axum")]
pub fn path_param(name: impl Into<Arc<str>>) -> PathParam {
    PathParam { name: name.into() }
}

#[cfg(feature = "axum")]
impl KeyFromParts for PathParam {
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        use axum::extract::rejection::RawPathParamsRejection;
        use axum::extract::{FromRequestParts, RawPathParams};
        use futures_util::FutureExt;

        // axum's extractor reads the parameters routing left in the extensions; its
        // future is ready at once.
        match RawPathParams::from_request_parts(parts, &()).now_or_never() {
            Some(Ok(params)) => {
                let found = params
                    .iter()
                    .find(|(name, _)| *name == &*self.name)
                    .map(|(_, value)| value.to_owned());
                // A matched route without the parameter is the server's mistake (a
                // typo, or the layer on the wrong route), never the client's: 500, not
                // 400. Without a matched route (the router's fallback under
                // `Router::layer`) there is simply no key.
                match (found, parts.extensions.get::<axum::extract::MatchedPath>()) {
                    (None, Some(route)) => {
                        let detail = format!(
                            "the route `{}` has no path parameter `{}` to take the lock key from",
                            route.as_str(),
                            self.name
                        );
                        tracing::error!("lock key misconfigured: {detail}");
                        Err(KeyRejection::misconfigured(detail))
                    }
                    (found, _) => Ok(found),
                }
            }
            Some(Err(RawPathParamsRejection::InvalidUtf8InPathParam(_))) => Err(
                KeyRejection::invalid(format!("the `{}` path parameter is not UTF-8", self.name)),
            ),
            Some(Err(_)) | None => {
                tracing::warn!(
                    param = %self.name,
                    "no path parameters: apply the lock layer inside the axum router (route_layer or layer)"
                );
                Ok(None)
            }
        }
    }

    fn describe(&self) -> String {
        format!("the `{}` path parameter", self.name)
    }
}
