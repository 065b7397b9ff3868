//! The demo's own refusals, in the same RFC 9457 format as the lock layer's.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::LedgerError;

/// A refusal of the demo's handlers, answered as `application/problem+json`.
#[derive(Debug)]
pub struct ApiProblem {
    status: StatusCode,
    code: &'static str,
    title: &'static str,
    detail: String,
    extra: Option<Value>,
}

impl ApiProblem {
    pub(super) fn new(
        status: StatusCode,
        code: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        ApiProblem {
            status,
            code,
            title,
            detail: detail.into(),
            extra: None,
        }
    }
}

impl From<LedgerError> for ApiProblem {
    fn from(error: LedgerError) -> Self {
        match error {
            LedgerError::Stale { token, last } => {
                tracing::warn!(%token, last, "stale write refused by the ledger");
                ApiProblem {
                    extra: Some(json!({
                        "fencing_token": token.to_string(),
                        "last_fencing_token": last.to_string(),
                    })),
                    ..ApiProblem::new(
                        StatusCode::CONFLICT,
                        "stale-fencing-token",
                        "Stale fencing token",
                        format!(
                            "the write with fencing token {token} was refused: the ledger already \
                             accepted token {last} for this order (or account), so this request's lock ended \
                             and another holder wrote since"
                        ),
                    )
                }
            }
            LedgerError::Unavailable(error) => {
                tracing::error!(%error, "ledger unavailable");
                ApiProblem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ledger-unavailable",
                    "Ledger unavailable",
                    "the ledger did not answer; retry later",
                )
            }
        }
    }
}

impl IntoResponse for ApiProblem {
    fn into_response(self) -> Response {
        let mut body = json!({
            // example.com stands for your own documentation of the problem types.
            "type": format!("https://example.com/problems#{}", self.code),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let (Some(Value::Object(extra)), Some(object)) = (self.extra, body.as_object_mut()) {
            object.extend(extra);
        }
        let mut response = (self.status, Json(body)).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        response
    }
}
