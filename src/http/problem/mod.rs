//! RFC 9457 problem responses of [`LockLayer`](super::LockLayer) (and of the axum
//! extractors, feature `axum`), and the renderer that turns them into HTTP responses.
//!
//! Every request the layer refuses gets an `application/problem+json` body with
//! `Cache-Control: no-store`:
//!
//! ```json
//! {
//!   "type": "https://docs.rs/tower-redlock/latest/tower_redlock/http/problem/#lock-held",
//!   "title": "Lock held",
//!   "status": 409,
//!   "detail": "another request holds the lock on this resource; retry later",
//!   "resource": "POST:/orders:abc-123",
//!   "retry_after_ms": 8412
//! }
//! ```
//!
//! The `type` URI is this page followed by `#` and a short, stable code (see
//! [`ProblemKind::code`]); [`ProblemKind::from_type_uri`] reads it back. `resource`
//! (the locked [`Resource`], as [`Resource::display_name`] spells it: its parts as the
//! layer got them, joined by `:`, so a route template reads `POST:/invoices/{id}/send:7`,
//! not percent-encoded) and `retry_after_ms` are extension members, present where
//! they apply. When a problem has a retry delay the response also carries
//! `Retry-After` in whole seconds, rounded up, at least 1.
//!
//! Replace the renderer with [`LockLayer::problem_renderer`](super::LockLayer::problem_renderer)
//! to change the format (a closure `Fn(&Problem) -> Response<Bytes>` will do). The
//! layer then still adds `Retry-After` and `Cache-Control: no-store` when the renderer
//! did not set them: they are protocol, not presentation.
//!
//! # Problem types
//!
//! When each is sent: the [layer's table](https://crates.io/crates/tower-redlock#what-the-client-hears) and [replay's](crate::guide::replay).
//!
//! ### key-missing
//! 400: no lock key, or one of several, or no client where [`Replay::per_client`](super::replay::Replay::per_client) looks.
//!
//! ### key-invalid
//! 400: the key is empty, too long, not UTF-8, has a control character or is ambiguous;
//! or the request names more resources than a lease takes.
//!
//! ### key-misconfigured
//! 500: the server looks for the key where the request cannot have one, or a shared lock
//! is asked for several keys. Logged.
//!
//! ### body-too-large
//! 413: the body is larger than a body key or replay reads. No lock was taken.
//!
//! ### body-not-json
//! 400: a body key (or a fingerprint of JSON fields) reads JSON, and the body is not.
//!
//! ### body-unreadable
//! 400: reading the body failed (for example, the client went away).
//!
//! ### lock-held
//! 409: another request holds the lock. `Retry-After`: the typical length of the layer's
//! critical sections, at least 1 s, never past the holder's remaining time to live.
//!
//! ### lock-wait-timeout
//! 409: the lock was still held when the wait ran out. `Retry-After` as for `lock-held`.
//!
//! ### limit-reached
//! 429: every permit of a counted lock is taken.
//!
//! ### lock-unavailable
//! 503: too few lock nodes answered, the locker is draining, or the holders hold the
//! resource in another mode. `Retry-After: 1`.
//!
//! ### lock-queue-full
//! 503: too many requests of this process wait for the resource. `Retry-After: 1`.
//!
//! ### lock-lost
//! 503: the lease was lost while the handler ran, and it was stopped. `Retry-After: 1`.
//!
//! ### lock-layer-missing
//! 500: a handler asked for the layer's lease (`LayerLease`) and the request has none.
//!
//! ### request-in-progress
//! 409: a request with the same idempotency key is still being processed.
//!
//! ### outcome-unknown
//! 409: an earlier request with the same key was interrupted before its response was
//! recorded (or its record cannot be read).
//!
//! ### idempotency-key-reused
//! 422: the key was already used for a different request: send a new key.
//!
//! ### response-failed
//! 500: the handler's body failed while it was recorded; nothing was recorded.
//!
//! ### bad-request
//! 400: a handler's extractor refused the request, with
//! [`LockLayer::problem_for_rejections`](super::LockLayer::problem_for_rejections).
//!
//! ### unsupported-media-type
//! 415: as `bad-request`, for a body of the wrong content type.
//!
//! ### unprocessable-content
//! 422: as `bad-request`, for a field of the wrong type.

mod sent;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::Resource;

pub use sent::problem_response;
pub(crate) use sent::{
    acquisition_problem, counted_error_problem, in_progress, key_reused, lock_lost,
    outcome_unknown, record_unreadable, rejection, response_failed, rolled_back,
};

/// A layer's own renderer, in the requests it passes on, for the `Locked` extractor's
/// refusals.
#[derive(Clone)]
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
pub(crate) struct LayerRenderer(pub(crate) Arc<dyn ProblemRenderer>);

/// `Retry-After` of refusals that know no better delay.
pub(crate) const RETRY_SOON: Duration = Duration::from_secs(1);

/// Where the `type` URIs point: this module's documentation, one heading per code.
const TYPE_BASE: &str = "https://docs.rs/tower-redlock/latest/tower_redlock/http/problem/";

/// The media type of problem bodies.
pub const CONTENT_TYPE_PROBLEM: &str = "application/problem+json";

/// One row per problem type: the variant, its code, its status, its title.
macro_rules! problem_kinds {
    ($($kind:ident = $code:literal, $status:ident, $title:literal;)+) => {
        /// What went wrong: one variant per problem type of the layer (see the
        /// [module documentation](self) for each).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ProblemKind {
            $(#[doc = concat!("`", $code, "`: ", $title, ".")] $kind,)+
        }

        impl ProblemKind {
            /// Every kind, in documentation order.
            pub const ALL: [ProblemKind; [$($code),+].len()] = [$(ProblemKind::$kind),+];

            /// The short, stable code, e.g. `lock-held`: the fragment of the `type` URI.
            pub const fn code(self) -> &'static str {
                match self {
                    $(ProblemKind::$kind => $code,)+
                }
            }

            /// The HTTP status of this kind.
            pub const fn status(self) -> StatusCode {
                match self {
                    $(ProblemKind::$kind => StatusCode::$status,)+
                }
            }

            /// A short human-readable summary, the same for every occurrence.
            pub const fn title(self) -> &'static str {
                match self {
                    $(ProblemKind::$kind => $title,)+
                }
            }
        }
    };
}

problem_kinds! {
    KeyMissing = "key-missing", BAD_REQUEST, "Lock key missing";
    KeyInvalid = "key-invalid", BAD_REQUEST, "Lock key invalid";
    KeyMisconfigured = "key-misconfigured", INTERNAL_SERVER_ERROR, "Lock key misconfigured";
    BodyTooLarge = "body-too-large", PAYLOAD_TOO_LARGE, "Body too large";
    BodyNotJson = "body-not-json", BAD_REQUEST, "Body is not JSON";
    BodyUnreadable = "body-unreadable", BAD_REQUEST, "Body unreadable";
    LockHeld = "lock-held", CONFLICT, "Lock held";
    LockWaitTimeout = "lock-wait-timeout", CONFLICT, "Lock wait timed out";
    LimitReached = "limit-reached", TOO_MANY_REQUESTS, "Concurrency limit reached";
    LockUnavailable = "lock-unavailable", SERVICE_UNAVAILABLE, "Lock store unavailable";
    LockQueueFull = "lock-queue-full", SERVICE_UNAVAILABLE, "Lock queue full";
    LockLost = "lock-lost", SERVICE_UNAVAILABLE, "Lock lost";
    LockLayerMissing = "lock-layer-missing", INTERNAL_SERVER_ERROR, "Lock layer missing";
    RequestInProgress = "request-in-progress", CONFLICT, "Request in progress";
    OutcomeUnknown = "outcome-unknown", CONFLICT, "Outcome unknown";
    IdempotencyKeyReused = "idempotency-key-reused", UNPROCESSABLE_ENTITY, "Idempotency key reused";
    ResponseFailed = "response-failed", INTERNAL_SERVER_ERROR, "Response failed";
    BadRequest = "bad-request", BAD_REQUEST, "Bad request";
    UnsupportedMediaType = "unsupported-media-type", UNSUPPORTED_MEDIA_TYPE, "Unsupported media type";
    UnprocessableContent = "unprocessable-content", UNPROCESSABLE_ENTITY, "Unprocessable content";
}

impl ProblemKind {
    /// The `type` URI: this module's documentation, `#` [`code`](ProblemKind::code).
    pub fn type_uri(self) -> String {
        format!("{TYPE_BASE}#{}", self.code())
    }

    /// The kind of a short code, e.g. `lock-held`.
    pub fn from_code(code: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.code() == code)
    }

    /// The kind of a `type` URI made by [`type_uri`](ProblemKind::type_uri). Only the
    /// fragment is compared, so links to other versions of the documentation work too.
    pub fn from_type_uri(uri: &str) -> Option<Self> {
        let (_, code) = uri.rsplit_once('#')?;
        Self::from_code(code)
    }
}

impl fmt::Display for ProblemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// One problem to report to the client: a [`ProblemKind`] plus what is specific to
/// this occurrence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    kind: ProblemKind,
    detail: String,
    resource: Option<Resource>,
    retry_after: Option<Duration>,
}

impl Problem {
    /// A problem of `kind` explained by `detail`.
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Problem {
            kind,
            detail: detail.into(),
            resource: None,
            retry_after: None,
        }
    }

    /// This problem, about `resource`.
    #[must_use]
    pub fn with_resource(mut self, resource: Resource) -> Self {
        self.resource = Some(resource);
        self
    }

    /// This problem, with a delay after which a retry may succeed.
    #[must_use]
    pub fn with_retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// What went wrong.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The HTTP status ([`ProblemKind::status`]).
    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }

    /// An explanation of this occurrence. Never contains infrastructure details such as
    /// node addresses: those go to the logs.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The locked resource, for problems about a lock.
    pub fn resource(&self) -> Option<&Resource> {
        self.resource.as_ref()
    }

    /// The delay after which a retry may succeed, when one is known.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The `Retry-After` value: [`retry_after`](Problem::retry_after) in whole seconds,
    /// rounded up, at least 1.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(|delay| {
            let secs = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
            secs.max(1)
        })
    }

    /// The RFC 9457 JSON object: `type`, `title`, `status`, `detail`, and `resource`
    /// and `retry_after_ms` when present.
    pub fn to_json(&self) -> serde_json::Value {
        let mut object = serde_json::Map::new();
        object.insert("type".into(), self.kind.type_uri().into());
        object.insert("title".into(), self.kind.title().into());
        object.insert("status".into(), self.status().as_u16().into());
        object.insert("detail".into(), self.detail.clone().into());
        if let Some(resource) = &self.resource {
            object.insert("resource".into(), resource.display_name().into());
        }
        if let Some(delay) = self.retry_after {
            let ms = delay.as_nanos().div_ceil(1_000_000);
            object.insert(
                "retry_after_ms".into(),
                u64::try_from(ms).unwrap_or(u64::MAX).into(),
            );
        }
        serde_json::Value::Object(object)
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.kind.title(), self.kind, self.detail)
    }
}

/// Turns a [`Problem`] into a response (the layer adds `Retry-After` and `Cache-Control`
/// unless it set them). Implemented for [`DefaultRenderer`] and for every closure
/// `Fn(&Problem) -> Response<Bytes>`.
pub trait ProblemRenderer: Send + Sync + 'static {
    /// The response for `problem`.
    fn render(&self, problem: &Problem) -> Response<Bytes>;
}

impl fmt::Debug for dyn ProblemRenderer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ProblemRenderer")
    }
}

impl<F> ProblemRenderer for F
where
    F: Fn(&Problem) -> Response<Bytes> + Send + Sync + 'static,
{
    fn render(&self, problem: &Problem) -> Response<Bytes> {
        self(problem)
    }
}

/// The default renderer: `application/problem+json` as described in the
/// [module documentation](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultRenderer;

impl ProblemRenderer for DefaultRenderer {
    fn render(&self, problem: &Problem) -> Response<Bytes> {
        let body = Bytes::from(problem.to_json().to_string());
        let mut response = Response::new(body);
        *response.status_mut() = problem.status();
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE_PROBLEM));
        response
    }
}

/// Renders `problem` and adds the headers every problem response carries.
pub(crate) fn render(renderer: &dyn ProblemRenderer, problem: &Problem) -> Response<Bytes> {
    let mut response = renderer.render(problem);
    let headers = response.headers_mut();
    if let Some(secs) = problem.retry_after_secs()
        && !headers.contains_key(RETRY_AFTER)
    {
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    if !headers.contains_key(CACHE_CONTROL) {
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_docs_have_a_heading_per_code() {
        // The `type` URIs point at these headings.
        let source = include_str!("mod.rs");
        for kind in ProblemKind::ALL {
            let heading = format!("//! ### {}\n", kind.code());
            assert!(source.contains(&heading), "no heading for {kind}");
        }
    }

    /// The headers a renderer sets itself are kept (the layer adding the others, and
    /// leaving out `Retry-After` without a delay, is tested in `tests/http/layer.rs`).
    #[test]
    fn renderers_keep_their_headers_and_problems_their_optional_members_out() {
        let renderer = |_: &Problem| {
            let mut response = Response::new(Bytes::new());
            let private = HeaderValue::from_static("private");
            response.headers_mut().insert(CACHE_CONTROL, private);
            response
        };
        let response = render(&renderer, &Problem::new(ProblemKind::LockUnavailable, ""));
        assert_eq!(response.headers()[CACHE_CONTROL], "private");
        let body = Problem::new(ProblemKind::KeyMissing, "no key").to_json();
        assert!(!body.as_object().unwrap().contains_key("resource"));
    }
}
