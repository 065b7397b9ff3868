//! The problems the crate sends for its errors and for replay's outcomes: every
//! refusal's detail text is written here.

use std::num::NonZeroU32;
use std::time::Duration;

use bytes::Bytes;
use http::Response;

use super::{render, DefaultRenderer, Problem, ProblemKind, RETRY_SOON};
use crate::LockError;
use crate::Resource;

/// The response the layer would send for `error`: the same RFC 9457 problem, status,
/// `Retry-After` and `Cache-Control: no-store`, rendered by [`DefaultRenderer`]. For
/// code that locks by hand ([`Redlock::acquire`](crate::Redlock::acquire)) and wants
/// to answer as the layer does; with the `axum` feature, `LockError` and [`Problem`]
/// also implement axum's `IntoResponse`.
pub fn problem_response(error: &LockError) -> Response<Bytes> {
    render(&DefaultRenderer, &Problem::from(error))
}

impl From<&LockError> for Problem {
    /// The problem the layer answers `error` with (`lock-held`, `lock-wait-timeout`,
    /// `lock-unavailable`, `lock-queue-full` or `lock-lost`), naming the error's
    /// resource. Node addresses and other details go to the log, not to the client.
    fn from(error: &LockError) -> Self {
        acquisition_problem(error, error.resource().clone(), None)
    }
}

/// The problem a failed acquisition of `resource` is answered with, by the layer and by
/// the axum extractors alike. `set` is how many resources the request locks together,
/// for a multi-key extractor: a contention problem then names the member that is held
/// (`resource`, the error's), in its `resource` member and in its detail, and
/// `Retry-After` is the holders' longest time to live (as the engine reports it).
pub(crate) fn acquisition_problem(
    error: &LockError,
    resource: Resource,
    set: Option<usize>,
) -> Problem {
    let (held, nothing_locked) = match set {
        None => ("this resource".to_owned(), ""),
        Some(count) => (
            format!(
                "`{}`, one of the {count} resources this request locks together,",
                resource.display_name()
            ),
            " nothing was locked;",
        ),
    };
    let soon = Some(RETRY_SOON);
    let (kind, detail, retry_after) = match error {
        LockError::Held { holder_ttl, .. } => (
            ProblemKind::LockHeld,
            format!(
                "another request holds the lock on {};{nothing_locked} retry later",
                held.trim_end_matches(',')
            ),
            Some(holder_ttl.unwrap_or(RETRY_SOON)),
        ),
        LockError::WaitTimeout {
            waited, holder_ttl, ..
        } => (
            ProblemKind::LockWaitTimeout,
            format!(
                "the lock on {held} was still held after waiting {} ms;{nothing_locked} retry later",
                waited.as_millis()
            ),
            Some(holder_ttl.unwrap_or(RETRY_SOON)),
        ),
        LockError::Unavailable { .. } | LockError::ValidityExpired { .. } => {
            // The details (node addresses) go to the log, not to the client; the loss
            // of the quorum is logged once by the locker.
            tracing::debug!(%error, "lock store unavailable: request refused");
            let detail = "the lock store could not reach a quorum; the request was not processed";
            (ProblemKind::LockUnavailable, detail.to_owned(), soon)
        }
        // Another version of the service holds the resource with another limit (a
        // rolling deploy that changed it without a drain): an operator's to fix.
        LockError::ModeMismatch { .. } => {
            tracing::warn!(%error, "lock mode differs from the holders': request refused");
            let detail = "the resource is held under another limit; the request was not processed";
            (ProblemKind::LockUnavailable, detail.to_owned(), soon)
        }
        LockError::QueueFull { limit, .. } => {
            let detail = format!("{limit} requests already wait for this resource");
            (ProblemKind::LockQueueFull, detail, soon)
        }
        LockError::Lost { .. } => {
            let detail = "the lock was lost while the request was processed";
            (ProblemKind::LockLost, detail.to_owned(), soon)
        }
        LockError::Draining { .. } => {
            let detail = "this instance is shutting down and takes no new locks; retry";
            (ProblemKind::LockUnavailable, detail.to_owned(), soon)
        }
        // The request named no lockable resource, or too many: the client's to fix.
        LockError::ResourceCount { count, limit, .. } => {
            let detail = format!("a request locks 1 to {limit} resources; it named {count}");
            (ProblemKind::KeyInvalid, detail, None)
        }
    };
    let problem = Problem::new(kind, detail).with_resource(resource);
    Problem {
        retry_after,
        ..problem
    }
}

/// 429 `limit-reached` for a counted lock of `permits` whose acquisition found every
/// permit taken (`Held`, or `WaitTimeout` after a wait); other errors as
/// [`acquisition_problem`]'s.
pub(crate) fn counted_error_problem(
    error: &LockError,
    permits: NonZeroU32,
    resource: Resource,
) -> Problem {
    let holder_ttl = match error {
        LockError::Held { holder_ttl, .. } | LockError::WaitTimeout { holder_ttl, .. } => {
            *holder_ttl
        }
        _ => return acquisition_problem(error, resource, None),
    };
    Problem::new(
        ProblemKind::LimitReached,
        format!("all {permits} permits of this resource are taken; retry later"),
    )
    .with_retry_after(holder_ttl.unwrap_or(RETRY_SOON))
    .with_resource(resource)
}

/// 503 `lock-lost`: the handler was stopped because its lease was lost.
pub(crate) fn lock_lost(resource: Resource) -> Problem {
    Problem::new(
        ProblemKind::LockLost,
        "the lock was lost while the request was processed; it was stopped",
    )
    .with_retry_after(RETRY_SOON)
    .with_resource(resource)
}

/// 409 `request-in-progress`: replay's name for contention on the key.
pub(crate) fn in_progress(error: &LockError, resource: Resource) -> Problem {
    let detail = match error {
        LockError::WaitTimeout { waited, .. } => format!(
            "a request with the same key is still being processed after waiting {} ms; retry later to get its response",
            waited.as_millis()
        ),
        _ => "a request with the same key is being processed; retry later to get its response".to_owned(),
    };
    Problem::new(ProblemKind::RequestInProgress, detail)
        .with_retry_after(error.holder_ttl().unwrap_or(RETRY_SOON))
        .with_resource(resource)
}

/// 409 `outcome-unknown`: an earlier attempt with the key was interrupted.
pub(crate) fn outcome_unknown(retry_after: Option<Duration>, resource: Resource) -> Problem {
    let problem = Problem::new(
        ProblemKind::OutcomeUnknown,
        "an earlier request with this key was interrupted before its response was recorded; whether it took effect is unknown",
    );
    Problem {
        retry_after,
        ..problem.with_resource(resource)
    }
}

/// 409 `outcome-unknown`: the record of the key exists but cannot be decoded.
pub(crate) fn record_unreadable(resource: Resource) -> Problem {
    Problem::new(
        ProblemKind::OutcomeUnknown,
        "the response recorded for this key cannot be read",
    )
    .with_resource(resource)
}

/// 422 `idempotency-key-reused`: the record answers a different request.
pub(crate) fn key_reused(resource: Resource) -> Problem {
    Problem::new(
        ProblemKind::IdempotencyKeyReused,
        "this key was already used for a different request; use a new key for a new request",
    )
    .with_resource(resource)
}

/// 500 `response-failed`: the handler's body failed while it was read to be recorded.
pub(crate) fn response_failed(resource: Resource) -> Problem {
    Problem::new(
        ProblemKind::ResponseFailed,
        "the response body failed before it was sent; nothing was recorded",
    )
    .with_resource(resource)
}

/// 500 `response-failed`: the response could not be recorded, so the handler's
/// transaction was rolled back, and the response, which its writes would have
/// answered, is not sent.
pub(crate) fn rolled_back(resource: Resource) -> Problem {
    Problem::new(
        ProblemKind::ResponseFailed,
        "the response could not be recorded, so the handler's transaction was rolled back; \
         nothing of the request was committed",
    )
    .with_resource(resource)
}

/// The longest `text/plain` refusal of a handler that
/// [`problem_for_rejections`](crate::http::LockLayer::problem_for_rejections) rewrites:
/// axum's extractor rejections are a line or two.
const REJECTION_TEXT_LIMIT: u64 = 4096;

/// A handler's own refusal as a problem: a `text/plain` 400, 415 or 422 of at most
/// [`REJECTION_TEXT_LIMIT`] bytes (axum's extractor rejections: `Json`, `Form`, `Query`,
/// `Path`…), its text the detail; any other response is given back.
pub(crate) async fn rejection<RB: http_body::Body>(
    response: Response<RB>,
) -> Result<Problem, Response<RB>> {
    let kind = match response.status().as_u16() {
        400 => ProblemKind::BadRequest,
        415 => ProblemKind::UnsupportedMediaType,
        422 => ProblemKind::UnprocessableContent,
        _ => return Err(response),
    };
    let plain = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/plain"));
    let small = response
        .body()
        .size_hint()
        .upper()
        .is_some_and(|len| len <= REJECTION_TEXT_LIMIT);
    if !(plain && small) {
        return Err(response);
    }
    let text = match http_body_util::BodyExt::collect(response.into_body()).await {
        Ok(collected) => String::from_utf8_lossy(&collected.to_bytes()).into_owned(),
        Err(_) => String::new(),
    };
    Ok(Problem::new(kind, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replay runs on any key (a Stripe event id, a GitHub delivery id), not only an
    /// `Idempotency-Key` header: its problems call it the key.
    #[test]
    fn replay_problems_name_the_key_whatever_it_is() {
        let event = Resource::new("POST").join("/webhooks/stripe").join("evt_1");
        let held = LockError::Held {
            resource: event.clone(),
            holder_ttl: None,
        };
        let problems = [
            in_progress(&held, event.clone()),
            outcome_unknown(None, event.clone()),
            record_unreadable(event.clone()),
            key_reused(event),
        ];
        for problem in problems {
            assert!(
                !problem.detail().contains("idempotency"),
                "{}",
                problem.detail()
            );
        }
    }
}
