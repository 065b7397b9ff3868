//! The demo on PostgreSQL (`DATABASE_URL`, feature `postgres`): the ledger, replay's
//! records and, unless `LOCK_URLS` names other nodes, the lock itself (one
//! [`PostgresNode`] on the same database), so a team without Redis runs all of it.
//!
//! The ledger keeps one row per order in `orders_example_ledger`, each write in a
//! transaction fenced by the order's fence (`tower_redlock::fence::postgres`, table
//! `redlock_fences`), so a writer whose lease ran out is refused by the database and its
//! transaction commits nothing.
//!
//! `POST /payments` writes its charge through the request's transaction (`Tx`), which
//! the layer commits with the payment's replay record. A crash before the commit leaves
//! neither, and the retry charges as if for the first time; after it, the retry is
//! replayed. No reconciliation code: compare `create_payment` in `main.rs`, which must
//! find out whether an interrupted attempt charged.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Query;
use axum::http::HeaderMap;
use axum::{Extension, Json};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::OnceCell;
use tower_redlock::axum::{LayerLease, Tx};
use tower_redlock::fence::{self, FenceError};
use tower_redlock::http::replay::PgRecords;
use tower_redlock::http::RequestKey;
use tower_redlock::{FencingToken, LockOptions, PostgresNode, Redlock, Resource};

use super::ledger::{Entry, LedgerError, OrderRecord};
use super::{customer, work_of, ApiProblem, BoxError, Config, Ledger, WorkParams};

/// The locker and the ledger with `DATABASE_URL` set: the lock on `LOCK_URLS`, or else
/// on the same database (one node: its own replication is its durability).
pub(super) fn locker_and_ledger(
    config: &Config,
    url: &str,
    mut options: LockOptions,
) -> Result<(Redlock, Ledger), BoxError> {
    let locker = if config.redis_urls.is_empty() {
        // A lock write is a commit (a WAL flush): more than the 50 ms chosen for Redis.
        if config.node_timeout.is_none() {
            options = options.node_timeout(Duration::from_millis(500));
        }
        tracing::info!("LOCK_URLS is not set: locking in DATABASE_URL's PostgreSQL");
        Redlock::new([PostgresNode::from_url(url)?], options)?
    } else {
        Redlock::from_urls(&config.redis_urls, options)?
    };
    tracing::info!(
        "DATABASE_URL is set: orders, payments and replay's records live in PostgreSQL, \
         every write fenced"
    );
    Ok((locker, Ledger::postgres(url)?))
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS orders_example_ledger (
    entry text PRIMARY KEY,
    payments bigint NOT NULL DEFAULT 0,
    shipments bigint NOT NULL DEFAULT 0,
    in_flight bigint NOT NULL DEFAULT 0,
    max_in_flight bigint NOT NULL DEFAULT 0,
    last_token bigint
)";

impl From<sqlx::Error> for LedgerError {
    fn from(error: sqlx::Error) -> Self {
        LedgerError::Unavailable(error.to_string())
    }
}

#[derive(Clone)]
pub(super) struct PgLedger {
    pool: PgPool,
    ready: Arc<OnceCell<()>>,
}

impl PgLedger {
    pub(super) fn connect_lazy(url: &str) -> Result<PgLedger, BoxError> {
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect_lazy(url)
            .map_err(|e| format!("DATABASE_URL {url:?}: {e}"))?;
        Ok(PgLedger {
            pool,
            ready: Arc::default(),
        })
    }

    /// The pool, once the tables exist.
    async fn pool(&self) -> Result<&PgPool, LedgerError> {
        self.ready
            .get_or_try_init(|| async {
                let mut conn = self.pool.acquire().await?;
                sqlx::query(SCHEMA).execute(&mut *conn).await?;
                // The fence table too.
                self.records().create().await?;
                Ok::<(), sqlx::Error>(())
            })
            .await?;
        Ok(&self.pool)
    }

    pub(super) async fn prepare(&self) -> Result<(), LedgerError> {
        self.pool().await.map(drop)
    }

    pub(super) fn records(&self) -> PgRecords {
        PgRecords::new(self.pool.clone())
    }

    /// The fence of a ledger entry: one per entry, as a token orders the writes of
    /// one lock only.
    fn fence(order: &str, token: FencingToken) -> (Resource, FencingToken) {
        (Resource::new("orders-example").join(order), token)
    }

    pub(super) async fn enter(&self, order: &str) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO orders_example_ledger AS l (entry, in_flight, max_in_flight)
             VALUES ($1, 1, 1)
             ON CONFLICT (entry) DO UPDATE SET in_flight = l.in_flight + 1,
                 max_in_flight = greatest(l.max_in_flight, l.in_flight + 1)",
        )
        .bind(order)
        .execute(self.pool().await?)
        .await?;
        Ok(())
    }

    pub(super) async fn order(&self, order: &str) -> Result<OrderRecord, LedgerError> {
        let row: Option<(i64, i64, i64, i64, Option<i64>)> = sqlx::query_as(
            "SELECT payments, shipments, in_flight, max_in_flight, last_token
             FROM orders_example_ledger WHERE entry = $1",
        )
        .bind(order)
        .fetch_optional(self.pool().await?)
        .await?;
        Ok(match row {
            None => OrderRecord::default(),
            Some((payments, shipments, in_flight, max_in_flight, last_token)) => OrderRecord {
                payments: payments.max(0) as u64,
                shipments: shipments.max(0) as u64,
                in_flight,
                max_in_flight,
                last_token: last_token.map(|token| token as u64),
            },
        })
    }

    /// Leaves the in-flight count, then, in one transaction, advances the entry's
    /// fence and counts the entry: both or neither.
    pub(super) async fn record(
        &self,
        order: &str,
        entry: Entry,
        token: FencingToken,
    ) -> Result<u64, LedgerError> {
        let pool = self.pool().await?;
        self.leave(order).await?;
        let mut tx = pool.begin().await?;
        match fence::postgres::advance(&mut tx, &Self::fence(order, token)).await {
            Ok(()) => {}
            // `tx` is dropped: rolled back, nothing counted.
            Err(FenceError::Stale { current, .. }) => {
                return Err(LedgerError::Stale {
                    token,
                    last: current.get(),
                })
            }
            Err(other) => return Err(LedgerError::Unavailable(other.to_string())),
        }
        let column = match entry {
            Entry::Payment => "payments",
            Entry::Shipment => "shipments",
        };
        let count: i64 = sqlx::query_scalar(&format!(
            "UPDATE orders_example_ledger SET {column} = {column} + 1, last_token = $2
             WHERE entry = $1 RETURNING {column}"
        ))
        .bind(order)
        .bind(fence::to_i64(token).map_err(|_| {
            LedgerError::Unavailable(format!("fencing token {token} does not fit bigint"))
        })?)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(count.max(0) as u64)
    }

    async fn leave(&self, order: &str) -> Result<(), LedgerError> {
        sqlx::query("UPDATE orders_example_ledger SET in_flight = in_flight - 1 WHERE entry = $1")
            .bind(order)
            .execute(self.pool().await?)
            .await?;
        Ok(())
    }

    pub(super) fn leave_in_background(&self, order: &str) {
        let (ledger, order) = (self.clone(), order.to_owned());
        tokio::spawn(async move {
            if let Err(error) = ledger.leave(&order).await {
                tracing::warn!(?error, "ledger: leaving the in-flight count failed");
            }
        });
    }
}

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
