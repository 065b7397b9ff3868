//! `POST /payments` with the ledger in PostgreSQL (`DATABASE_URL`, feature `postgres`):
//! the charge is written through the request's transaction (`Tx`), which the layer
//! commits with the payment's replay record. A crash before the commit leaves neither,
//! and the retry charges as if for the first time; after it, the retry is replayed. No
//! reconciliation code: compare `create_payment` in `main.rs`, which must find out
//! whether an interrupted attempt charged.

use axum::extract::Query;
use axum::http::HeaderMap;
use axum::{Extension, Json};
use serde_json::{json, Value};
use tower_redlock::axum::{LayerLease, Tx};
use tower_redlock::fence;
use tower_redlock::http::RequestKey;

use super::ledger::LedgerError;
use super::{customer, work_of, ApiProblem, WorkParams};

/// The charge: the payment counted on the customer's ledger entry. The write fence was
/// advanced by `Tx`, in the same transaction, with the lease's token.
const CHARGE: &str = "INSERT INTO orders_example_ledger AS l (entry, payments, last_token)
     VALUES ($1, 1, $2)
     ON CONFLICT (entry) DO UPDATE SET payments = l.payments + 1, last_token = $2
     RETURNING payments";

pub(super) async fn create_payment(
    Extension(key): Extension<RequestKey>,
    Query(params): Query<WorkParams>,
    headers: HeaderMap,
    lease: LayerLease,
    mut tx: Tx,
) -> Result<Json<Value>, ApiProblem> {
    let work = work_of(&params)?;
    let key = key.as_str();
    let entry = format!("payment:{}:{key}", customer(&headers).unwrap_or_default());
    let token = lease.fencing_token();
    let bigint = fence::to_i64(token).map_err(|e| LedgerError::Unavailable(e.to_string()))?;
    let payment: i64 = sqlx::query_scalar(CHARGE)
        .bind(&entry)
        .bind(bigint)
        .fetch_one(&mut *tx)
        .await
        .map_err(LedgerError::from)?;
    // The slow part (the provider's confirmation): a crash here commits nothing.
    tokio::time::sleep(work).await;
    tracing::info!(idempotency_key = key, payment, %token, "payment written; committed with its record");
    Ok(Json(json!({
        "idempotency_key": key,
        "payment": payment,
        "fencing_token": token.to_string(),
    })))
}
