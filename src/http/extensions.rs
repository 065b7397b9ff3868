//! The markers the layer leaves in requests and responses.

use std::fmt;
use std::sync::Arc;

use crate::lock::LostCause;

/// A response extension: the lease was lost while the handler ran, and the handler's
/// response was passed on anyway ([`OnLost::Continue`](super::OnLost::Continue), or a
/// handler that finished just as the loss was noticed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLost(pub LostCause);

/// A request extension: the key [`LockLayer`](super::LockLayer) found in this request and locked on, as
/// the extractor read it (for `Idempotency-Key`, without the quotes of the structured
/// form; for a JSON field, a number as its decimal text).
///
/// Handlers should use it rather than read the key again from the request: a second
/// reading can differ from the layer's (a number read as a string, a quoted header),
/// and then the handler acts on another key than the one the lock protects.
///
/// ```
/// use axum::Extension;
/// use tower_redlock::http::RequestKey;
///
/// async fn handler(Extension(key): Extension<RequestKey>) -> String {
///     format!("processing {}", key.as_str())
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestKey(pub Arc<str>);

impl RequestKey {
    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A request extension: the handler runs without a lock, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unlocked {
    /// The request has no key and the layer lets such requests through
    /// ([`MissingKey::Bypass`](super::MissingKey::Bypass)).
    MissingKey,
    /// The lock store could not decide and the layer fails open
    /// ([`Unavailable::FailOpen`](super::Unavailable::FailOpen)).
    StoreUnavailable,
}
