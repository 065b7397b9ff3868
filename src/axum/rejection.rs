//! [`LockRejection`], and the axum responses of the crate's problems and errors.

use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;

use ::axum::body::Body;
use ::axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use http::header::HeaderValue;
use http::StatusCode;

use crate::http::problem::{self, DefaultRenderer, Problem, ProblemRenderer};
use crate::http::FENCING_TOKEN;
use crate::FencingToken;
use crate::LockError;

/// Why [`Locked`](super::Locked) or [`LayerLease`](super::LayerLease) refused a request: a [`Problem`], answered as the
/// layer answers it (`application/problem+json` by [`DefaultRenderer`], or by the
/// renderer of the [`LockLayer`](crate::http::LockLayer) the request came through;
/// `Cache-Control: no-store`, `Retry-After` when known).
///
/// Take `Result<Locked<K>, LockRejection>` in the handler to answer in another format:
///
/// ```
/// # use tower_redlock::http::key::{header, Header};
/// # struct Key;
/// # impl tower_redlock::axum::LockKey for Key {
/// #     type Extractor = Header;
/// #     fn extractor() -> Header { header("x-key") }
/// # }
/// use axum::http::StatusCode;
/// use tower_redlock::axum::{LockRejection, Locked};
///
/// async fn handler(lock: Result<Locked<Key>, LockRejection>) -> (StatusCode, String) {
///     match lock {
///         Ok(_lock) => (StatusCode::OK, "done".to_owned()),
///         Err(rejection) => (rejection.status(), rejection.problem().detail().to_owned()),
///     }
/// }
/// ```
#[derive(Clone, Debug)]
pub struct LockRejection {
    pub(super) problem: Problem,
    /// The renderer of the layer the request came through, if it set one.
    pub(super) renderer: Option<Arc<dyn ProblemRenderer>>,
}

/// Two rejections are equal when their problems are.
impl PartialEq for LockRejection {
    fn eq(&self, other: &Self) -> bool {
        self.problem == other.problem
    }
}

impl Eq for LockRejection {}

impl LockRejection {
    /// The problem.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// The problem, by value.
    pub fn into_problem(self) -> Problem {
        self.problem
    }

    /// The HTTP status of the response.
    pub fn status(&self) -> StatusCode {
        self.problem.status()
    }
}

impl From<Problem> for LockRejection {
    fn from(problem: Problem) -> Self {
        LockRejection {
            problem,
            renderer: None,
        }
    }
}

impl fmt::Display for LockRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.problem, f)
    }
}

impl std::error::Error for LockRejection {}

impl IntoResponse for LockRejection {
    fn into_response(self) -> Response {
        let renderer = self.renderer.as_deref().unwrap_or(&DefaultRenderer);
        problem::render(renderer, &self.problem)
            .map(Body::from)
            .into_response()
    }
}

impl IntoResponse for Problem {
    /// The problem as the layer sends it: [`DefaultRenderer`]'s
    /// `application/problem+json`, `Retry-After` when known, `Cache-Control: no-store`.
    fn into_response(self) -> Response {
        LockRejection::from(self).into_response()
    }
}

impl IntoResponse for LockError {
    /// The response the layer sends for this error (see
    /// [`problem_response`](crate::http::problem::problem_response)), so a handler that
    /// locks by hand can use `?`:
    ///
    /// ```
    /// use tower_redlock::{LockError, Redlock, Resource};
    ///
    /// async fn ship(locker: Redlock, order: String) -> Result<String, LockError> {
    ///     let lease = locker.try_acquire(Resource::new("order").join(&order)).await?;
    ///     Ok(format!("shipped under token {}", lease.fencing_token()))
    /// }
    /// ```
    fn into_response(self) -> Response {
        Problem::from(&self).into_response()
    }
}

impl IntoResponseParts for FencingToken {
    type Error = Infallible;

    /// Adds `Fencing-Token: <n>` (the layer's [`FENCING_TOKEN`] header) to the
    /// response; nothing for token 0 (a locker without fencing), as the layer does.
    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Infallible> {
        if self.get() > 0 {
            parts
                .headers_mut()
                .insert(FENCING_TOKEN, HeaderValue::from(self.get()));
        }
        Ok(parts)
    }
}
