//! [`KeyRejection`]: why a request's key could not be read.

use std::fmt;

use crate::http::problem::{Problem, ProblemKind};

/// Why a request's key could not be read: a malformed request. The layer answers with
/// the matching [`Problem`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRejection {
    kind: ProblemKind,
    detail: String,
}

impl KeyRejection {
    /// The key is present but unusable (ambiguous, wrong type, not UTF-8): 400 `key-invalid`.
    pub fn invalid(detail: impl Into<String>) -> Self {
        KeyRejection::with_kind(ProblemKind::KeyInvalid, detail)
    }

    /// A key the request must carry is absent: 400 `key-missing`. The layer answers a
    /// request without any key by its [`MissingKey`](crate::http::MissingKey) policy;
    /// a multi-key extractor that finds some of its keys and not others rejects the
    /// request with this, naming the missing ones.
    pub fn missing(detail: impl Into<String>) -> Self {
        KeyRejection::with_kind(ProblemKind::KeyMissing, detail)
    }

    /// The server is configured to look for a key where the request cannot have one
    /// (a path parameter the matched route does not have): 500 `key-misconfigured`.
    pub fn misconfigured(detail: impl Into<String>) -> Self {
        KeyRejection::with_kind(ProblemKind::KeyMisconfigured, detail)
    }

    /// The body exceeds `limit` bytes: 413 `body-too-large`.
    pub fn body_too_large(limit: usize) -> Self {
        KeyRejection::with_kind(
            ProblemKind::BodyTooLarge,
            format!("the body is larger than {limit} bytes, the limit for finding its lock key"),
        )
    }

    /// The body should be JSON and is not: 400 `body-not-json`.
    pub fn body_not_json(detail: impl Into<String>) -> Self {
        KeyRejection::with_kind(ProblemKind::BodyNotJson, detail)
    }

    /// Reading the body failed: 400 `body-unreadable`.
    pub fn body_unreadable(detail: impl Into<String>) -> Self {
        KeyRejection::with_kind(ProblemKind::BodyUnreadable, detail)
    }

    /// A rejection of `kind` explained by `detail` (for the layer's own body readers).
    pub(crate) fn with_kind(kind: ProblemKind, detail: impl Into<String>) -> Self {
        KeyRejection {
            kind,
            detail: detail.into(),
        }
    }

    /// The problem type this rejection is answered with.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The explanation given to the client.
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

impl fmt::Display for KeyRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.detail)
    }
}

impl std::error::Error for KeyRejection {}

impl From<KeyRejection> for Problem {
    fn from(rejection: KeyRejection) -> Self {
        Problem::new(rejection.kind, rejection.detail)
    }
}
