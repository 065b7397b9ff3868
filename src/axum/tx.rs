//! [`Tx`]: the request's transaction, which commits with its idempotency record.

use std::ops::{Deref, DerefMut};

use ::axum::extract::FromRequestParts;
use http::request::Parts;
use sqlx::{PgConnection, Postgres, Transaction};

use super::LockRejection;
use crate::fence::FenceError;
use crate::http::problem::{self, Problem, ProblemKind};
use crate::http::replay::handler_tx::{TxSlot, TxState};
use crate::http::replay::postgres::database_problem;
use crate::LeaseHandle;

/// An extractor for the request's PostgreSQL transaction, under a replaying
/// [`LockLayer`](crate::http::LockLayer) whose records are kept in PostgreSQL
/// ([`Replay::records_in`](crate::http::replay::Replay::records_in)), features `axum`
/// and `postgres`.
///
/// Derefs to the transaction's connection: write through it. The layer records the
/// response **in the same transaction** and commits it, after the handler returned and
/// before the response is sent; so the handler's writes and the record commit
/// together, or neither does (a crash before the commit leaves nothing, and the retry
/// runs cleanly). A response that is not recorded rolls the handler's writes back (an
/// over-large body is answered 500 `response-failed` instead); a commit that fails is
/// answered 503 `lock-unavailable`.
///
/// Taking it advances the write fence ([`fence::postgres::advance`](crate::fence::postgres::advance))
/// in the transaction: a holder whose lease a newer one took is refused (503
/// `lock-lost`) before it writes. Without such a layer on the route the handler does
/// not run: 500 `lock-layer-missing`.
///
/// A holder frozen with its transaction open (a stopped process whose connection stays
/// up) keeps the rows it wrote locked until PostgreSQL ends its session; a newer holder
/// touching them waits, and then finds their outcome. Set
/// `idle_in_transaction_session_timeout` for the pool's role (a few ttls) to bound that.
///
/// ```no_run
/// use axum::{routing::post, Router};
/// use tower_redlock::axum::Tx;
/// use tower_redlock::http::replay::{PgRecords, Replay};
/// use tower_redlock::http::{key::header, LockLayer};
/// use tower_redlock::Redlock;
///
/// async fn pay(mut tx: Tx) -> Result<&'static str, axum::http::StatusCode> {
///     sqlx::query("INSERT INTO payments (amount) VALUES (100)")
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok("paid") // recorded in the same transaction, then committed
/// }
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let records = PgRecords::new(pool);
/// records.create().await?;
/// let app: Router = Router::new().route("/payments", post(pay)).route_layer(
///     LockLayer::new(Redlock::in_memory(), header("Idempotency-Key"))
///         .replay(Replay::per_client(header("Authorization")).records_in(records)),
/// );
/// # Ok(()) }
/// ```
pub struct Tx {
    tx: Option<Transaction<'static, Postgres>>,
    slot: TxSlot,
}

impl std::fmt::Debug for Tx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}

impl Deref for Tx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.tx
            .as_ref()
            .expect("a Tx holds its transaction until dropped")
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.tx
            .as_mut()
            .expect("a Tx holds its transaction until dropped")
    }
}

/// The transaction goes back to the layer, which records the response in it and
/// commits (or rolls it back).
impl Drop for Tx {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let mut state = crate::lock_unpoisoned(&self.slot.state);
            *state = TxState::Returned(tx);
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Tx {
    type Rejection = LockRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let (Some(slot), Some(handle)) = (
            parts.extensions.get::<TxSlot>(),
            parts.extensions.get::<LeaseHandle>(),
        ) else {
            let detail = "this handler takes Tx, which needs a replaying LockLayer on its route \
                          with records in PostgreSQL (LockLayer::replay with \
                          Replay::records_in(PgRecords::new(pool))), and the request came \
                          through none, or through one that let it pass unlocked";
            tracing::error!(path = %parts.uri.path(), "{detail}");
            return Err(Problem::new(ProblemKind::LockLayerMissing, detail).into());
        };
        let (slot, handle) = (slot.clone(), handle.clone());
        let begun = {
            let mut state = crate::lock_unpoisoned(&slot.state);
            match std::mem::replace(&mut *state, TxState::Taken) {
                TxState::Free => None,
                TxState::Begun { tx, fenced } => Some((tx, fenced)),
                other => {
                    *state = other;
                    let detail = "a request has one Tx: take it once, in the handler";
                    return Err(Problem::new(ProblemKind::LockLayerMissing, detail).into());
                }
            }
        };
        let resource = handle.resource();
        let mut tx = match begun {
            Some((tx, true)) => return Ok(Tx { tx: Some(tx), slot }),
            Some((tx, false)) => tx,
            None => slot.records.begin_transactional(&handle).await?,
        };
        let failed = |error: sqlx::Error| LockRejection::from(database_problem(&error, resource));
        match crate::fence::postgres::advance(&mut tx, &handle).await {
            Ok(()) => Ok(Tx { tx: Some(tx), slot }),
            Err(FenceError::Store(error)) => Err(failed(error)),
            Err(error) => {
                tracing::warn!(%error, "a newer holder wrote: this request is refused before it writes");
                Err(problem::lock_lost(resource.clone()).into())
            }
        }
    }
}
