//! Replay's records kept in PostgreSQL ([`Replay::records_in`](super::Replay::records_in),
//! feature `postgres`), whatever node holds the lock, so that a handler's writes and its
//! record can commit in one transaction ([`Tx`](crate::axum::Tx), feature `axum`).
//!
//! See [`PgRecords`].

use std::time::Duration;

use sqlx::{PgConnection, PgPool, Postgres, Row, Transaction};

use super::handler_tx::TxState;
use crate::http::problem::{self, Problem, ProblemKind, RETRY_SOON};
use crate::node::Record;
use crate::record::Claim;
use crate::{FencingToken, LeaseHandle, LostCause, Resource};

/// The records table, as a migration (see [`PgRecords`]).
const CREATE_RECORDS_TABLE: &str = include_str!("records.sql");

/// A completed record, not expired.
const READ: &str = "SELECT token, fingerprint, data FROM redlock_records \
     WHERE resource = $1 AND data IS NOT NULL AND expires_at > now()";

/// This lease's pending marker (`$5`: flagged transactional), over an expired row, its
/// own marker, or an earlier attempt's that left nothing behind (transactional) or whose
/// time as unknown is over; returns that interrupted attempt's token in the last case.
const CLAIM: &str = "WITH old AS (SELECT * FROM redlock_records WHERE resource = $1) \
     INSERT INTO redlock_records AS r \
     (resource, token, fingerprint, data, transactional, orphaned_until, expires_at) \
     VALUES ($1, $2, $3, NULL, $5, NULL, now() + $4 * interval '1 second') \
     ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token, \
     fingerprint = EXCLUDED.fingerprint, data = NULL, transactional = EXCLUDED.transactional, \
     orphaned_until = NULL, expires_at = EXCLUDED.expires_at \
     WHERE r.expires_at <= now() \
     OR (r.data IS NULL AND r.token = EXCLUDED.token) \
     OR (r.data IS NULL AND r.token < EXCLUDED.token \
         AND (r.transactional OR r.orphaned_until <= now())) \
     RETURNING (SELECT token FROM old WHERE old.data IS NULL AND old.token < $2 \
         AND NOT old.transactional AND old.orphaned_until IS NOT NULL \
         AND old.expires_at > now())";

/// [`CLAIM`] with the lease's fence advanced in the same statement (one resource, the
/// default fence table): its second column says whether the fence holds the lease's
/// token. For a claim in the handler's transaction, which `Tx` then need not fence.
fn claim_fenced() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        let (fenced, holds) = crate::fence::postgres::default_table().advance_one_as("fenced");
        format!(
            "{}, {holds}",
            CLAIM.replacen("WITH ", &format!("WITH {fenced}, "), 1)
        )
    })
}

/// What a claim that could not write found.
const FIND: &str = "SELECT token, fingerprint, data, \
     EXTRACT(EPOCH FROM orphaned_until - now())::float8 AS orphan_left, \
     EXTRACT(EPOCH FROM expires_at - now())::float8 AS left \
     FROM redlock_records WHERE resource = $1";
type Found = (i64, Vec<u8>, Option<Vec<u8>>, Option<f64>, Option<f64>);

/// An earlier attempt's marker stamped as interrupted: outcome unknown for `$3` seconds
/// (NULL: as long as the marker lives).
const ORPHAN: &str = "UPDATE redlock_records \
     SET orphaned_until = COALESCE(now() + $3 * interval '1 second', expires_at) \
     WHERE resource = $1 AND token = $2 AND data IS NULL AND orphaned_until IS NULL \
     RETURNING EXTRACT(EPOCH FROM orphaned_until - now())::float8";

/// The completed record, over this lease's marker or anything older.
const STORE: &str = "INSERT INTO redlock_records AS r \
     (resource, token, fingerprint, data, transactional, orphaned_until, expires_at) \
     VALUES ($1, $2, $3, $4, $5, NULL, now() + $6 * interval '1 second') \
     ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token, \
     fingerprint = EXCLUDED.fingerprint, data = EXCLUDED.data, \
     transactional = EXCLUDED.transactional, orphaned_until = NULL, \
     expires_at = EXCLUDED.expires_at \
     WHERE r.token < EXCLUDED.token OR (r.token = EXCLUDED.token AND r.data IS NULL)";

/// A [`Tx`](crate::axum::Tx)'s start, in one message (the simple query protocol, `$1`
/// and `$2` written in): this lease's marker flagged `transactional` and committed
/// before the handler writes, then the handler's transaction begun. The flag's commit
/// does not wait for its flush: lost in a crash of the server, the marker reads as an
/// attempt without a transaction (outcome unknown), the safe side; and the handler's
/// commit, which waits, flushes it first. A marker that is no longer this lease's is
/// left as it is, and the record's guarded write refuses the commit.
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
const BEGIN_TRANSACTIONAL: &str = "BEGIN; SET LOCAL synchronous_commit TO off; \
     UPDATE redlock_records SET transactional = true \
     WHERE resource = $1 AND token = $2 AND data IS NULL; COMMIT; BEGIN";

const DISCARD: &str =
    "DELETE FROM redlock_records WHERE resource = $1 AND token = $2 AND data IS NULL";

/// Replay's records in a PostgreSQL database: the option of
/// [`Replay::records_in`](super::Replay::records_in), and the pool a
/// [`Tx`](crate::axum::Tx) begins its transaction on.
///
/// The protocol is the nodes' one (see [`record`](crate::record)), on one row per key:
/// looked up before the lock (expired rows ignored), claimed under the lease with a
/// pending marker in a statement of its own (committed at once), completed after the
/// handler with a statement guarded by the lease's token
/// (`ON CONFLICT … WHERE token < the lease's`, or this lease's own marker), so a holder
/// that lost its lease never writes over a newer holder's marker or record.
///
/// What the marker of an earlier attempt means depends on how that attempt wrote:
///
/// - without a transaction (the handler did not take [`Tx`](crate::axum::Tx)): its effects
///   may have happened, the outcome is unknown, as with the nodes' records (409
///   `outcome-unknown`, then [`InterruptedAttempt`](crate::http::InterruptedAttempt));
/// - through [`Tx`](crate::axum::Tx): the marker was flagged `transactional` (committed
///   before the handler's first write), and the handler's writes commit only with the
///   record. A transactional marker without a record means nothing of that attempt
///   committed, so the next claim runs the handler cleanly.
///
/// # The table
///
/// [`PgRecords::create`] runs this statement (idempotent), and creates the
/// fence table [`Tx`](crate::axum::Tx) advances; as a migration:
///
/// ```sql
#[doc = include_str!("records.sql")]
/// ```
///
/// Expired rows are ignored and overwritten by the next claim of their key; delete the
/// others from time to time (`DELETE FROM redlock_records WHERE expires_at < now()`).
///
/// # Example
///
/// ```no_run
/// use tower_redlock::http::replay::{PgRecords, Replay};
/// use tower_redlock::http::{key::header, LockLayer};
/// use tower_redlock::Redlock;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// let records = PgRecords::new(pool);
/// records.create().await?; // or the table above as a migration
/// let layer = LockLayer::new(Redlock::in_memory(), header("Idempotency-Key"))
///     .replay(Replay::per_client(header("Authorization")).records_in(records));
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgRecords {
    pool: PgPool,
    pub(crate) claim_in_tx: bool,
}

impl PgRecords {
    /// Records in the database of `pool` (the application's own, for [`Tx`](crate::axum::Tx)).
    pub fn new(pool: PgPool) -> Self {
        PgRecords {
            pool,
            claim_in_tx: false,
        }
    }

    /// For a layer whose handlers all take [`Tx`](crate::axum::Tx): the pending marker
    /// is written in the handler's transaction, begun under the lease, instead of
    /// committed before the handler runs. A request then commits once (the marker, the
    /// handler's writes and the record together) instead of twice, and an attempt that
    /// dies leaves nothing behind, not even a marker. Without it, an attempt that dies
    /// after its claim and before its handler took `Tx` (the layer learns that a handler
    /// takes `Tx` only when it does) leaves an unflagged marker, and the key answers
    /// `outcome-unknown` for a while although nothing was written (s17 in FAULTS.md
    /// counts how often). The record is first looked up by
    /// that claim, under the lock (one read fewer for a new key; a retry of a completed
    /// request takes the lock for a moment), and without the lock only when it is not
    /// taken (held, or unavailable).
    ///
    /// A handler that does not take `Tx` under this setting still has its response
    /// recorded, but while it ran no marker was committed: had its process died, the
    /// retry would have run it again instead of answering `outcome-unknown`. The layer
    /// logs an error for each such request; keep such handlers under a layer without it.
    ///
    /// The marker's row stays locked by the handler's transaction until it commits: a
    /// holder frozen with it open (see [`Tx`](crate::axum::Tx)) makes the next holder's
    /// claim wait until PostgreSQL ends that session (`idle_in_transaction_session_timeout`).
    #[must_use]
    pub fn handlers_take_tx(mut self) -> Self {
        self.claim_in_tx = true;
        self
    }

    /// Creates the table if it does not exist ([the table](PgRecords#the-table)), and the fence
    /// table [`Tx`](crate::axum::Tx) advances ([`FenceTable::create_sql`](crate::fence::postgres::FenceTable::create_sql)).
    pub async fn create(&self) -> Result<(), sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        sqlx::query(CREATE_RECORDS_TABLE)
            .execute(&mut *conn)
            .await?;
        crate::fence::postgres::FenceTable::default()
            .create(&mut conn)
            .await
    }

    /// The pool the records and the handlers' transactions use.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The completed record of `resource`, if any and not expired.
    pub(crate) async fn read(&self, resource: &Resource) -> Result<Option<Record>, sqlx::Error> {
        let row: Option<(i64, Vec<u8>, Vec<u8>)> = sqlx::query_as(READ)
            .bind(resource.as_str())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|(token, fingerprint, data)| record_of(token, fingerprint, data)))
    }

    /// Under the lease: this lease's pending marker written, or what stops it (see
    /// [`Claim`]); a newer holder's marker is 503 `lock-lost`. With
    /// [`handlers_take_tx`](Self::handlers_take_tx), a claimed marker is in the
    /// transaction returned, for the handler, with the fence advanced in it where it could
    /// be in the same statement.
    pub(crate) async fn claim(
        &self,
        handle: &LeaseHandle,
        fingerprint: &[u8],
        pending_ttl: Duration,
        unknown_for: Option<Duration>,
    ) -> Result<(Claim, Option<TxState>), Problem> {
        let resource = handle.resource();
        let failed = |error: sqlx::Error| database_problem(&error, resource);
        let claim =
            |conn, fence| self.claim_on(conn, handle, fingerprint, pending_ttl, unknown_for, fence);
        if !self.claim_in_tx {
            let mut conn = self.pool.acquire().await.map_err(failed)?;
            return Ok((claim(&mut conn, false).await?, None));
        }
        // The fence of a one-resource lease is advanced by the claim itself.
        let tokens = crate::fence::writer_tokens::<()>(handle);
        let fence = matches!(&tokens, Ok(tokens) if tokens.len() == 1 && tokens[0].0 == *resource);
        let mut tx = self.pool.begin().await.map_err(failed)?;
        match claim(&mut tx, fence).await? {
            claimed @ (Claim::Claimed | Claim::Reclaimed { .. }) => {
                Ok((claimed, Some(TxState::Begun { tx, fenced: fence })))
            }
            // Nothing claimed; an earlier attempt may have been stamped interrupted.
            other => {
                tx.commit().await.map_err(failed)?;
                Ok((other, None))
            }
        }
    }

    async fn claim_on(
        &self,
        conn: &mut PgConnection,
        handle: &LeaseHandle,
        fingerprint: &[u8],
        pending_ttl: Duration,
        unknown_for: Option<Duration>,
        fence: bool,
    ) -> Result<Claim, Problem> {
        let (resource, token) = (handle.resource(), token_of(handle)?);
        let failed = |error: sqlx::Error| database_problem(&error, resource);
        // Twice at most: a row that changed between the two statements (expired,
        // discarded) is claimed by the second round.
        for _ in 0..2 {
            let claimed = sqlx::query(if fence { claim_fenced() } else { CLAIM })
                .bind(resource.as_str())
                .bind(token)
                .bind(fingerprint)
                .bind(pending_ttl.as_secs_f64())
                .bind(self.claim_in_tx)
                .fetch_optional(&mut *conn)
                .await
                .map_err(failed)?;
            if let Some(row) = claimed {
                if fence && !row.try_get::<bool, _>(1).map_err(failed)? {
                    tracing::warn!("a newer holder wrote: this request is refused before it runs");
                    return Err(problem::lock_lost(resource.clone()));
                }
                let interrupted: Option<i64> = row.try_get(0).map_err(failed)?;
                return Ok(match interrupted {
                    Some(token) => Claim::Reclaimed {
                        interrupted: FencingToken::new(token as u64),
                    },
                    None => Claim::Claimed,
                });
            }
            let found: Option<Found> = sqlx::query_as(FIND)
                .bind(resource.as_str())
                .fetch_optional(&mut *conn)
                .await
                .map_err(failed)?;
            let Some((theirs, fingerprint, data, orphan_left, left)) = found else {
                continue;
            };
            if left.is_none_or(|left| left <= 0.0) {
                continue;
            }
            if let Some(data) = data {
                return Ok(Claim::Completed(record_of(theirs, fingerprint, data)));
            }
            if theirs > token {
                return Err(problem::lock_lost(resource.clone()));
            }
            let orphan_left = match orphan_left {
                Some(left) => Some(left),
                None => sqlx::query_scalar(ORPHAN)
                    .bind(resource.as_str())
                    .bind(theirs)
                    .bind(unknown_for.map(|d| d.as_secs_f64()))
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(failed)?,
            };
            if let Some(left) = orphan_left.filter(|left| *left > 0.0) {
                let retry_after = Duration::from_secs_f64(left);
                return Ok(Claim::Unknown {
                    retry_after: Some(retry_after),
                });
            }
        }
        Err(database_problem(
            &"the record row changed under two claims in a row",
            resource,
        ))
    }

    /// The response recorded after the handler, guarded by the lease's token: in the
    /// handler's transaction (flagged `transactional`), then committed, when it took one
    /// (see [`Tx`](crate::axum::Tx)); else on its own. Answers as `ReplayStep::store`
    /// (a newer holder's marker or record there: nothing written, lost).
    pub(crate) async fn record(
        &self,
        tx: Option<TxState>,
        handle: &LeaseHandle,
        fingerprint: &[u8],
        data: &[u8],
        retention: Duration,
    ) -> Result<Result<(), Option<LostCause>>, Problem> {
        let resource = handle.resource();
        let mut tx = match tx {
            Some(TxState::Returned(tx)) => Some(tx),
            Some(TxState::Begun { tx, .. }) => {
                tracing::error!(
                    "PgRecords::handlers_take_tx, but the handler did not take Tx: it ran \
                     without a committed pending marker (a crash would have run it again)"
                );
                Some(tx)
            }
            // Still held by the handler (moved into a task): never committed.
            Some(_) => return Err(problem::rolled_back(resource.clone())),
            None => None,
        };
        let stored: Result<bool, Problem> = async {
            let query = sqlx::query(STORE)
                .bind(resource.as_str())
                .bind(token_of(handle)?)
                .bind(fingerprint)
                .bind(data)
                .bind(tx.is_some())
                .bind(retention.as_secs_f64());
            let done = match &mut tx {
                Some(tx) => query.execute(&mut **tx).await,
                None => query.execute(&self.pool).await,
            };
            let done = done.map_err(|error| database_problem(&error, resource))?;
            Ok(done.rows_affected() == 1)
        }
        .await;
        let Some(tx) = tx else {
            return Ok(match stored {
                Ok(true) => Ok(()),
                Ok(false) => Err(Some(handle.lost_cause().unwrap_or(LostCause::KeyLost))),
                Err(_) => Err(None),
            });
        };
        // A newer holder's marker, or the lease lost meanwhile: `tx` rolls back when
        // dropped. Once the record row is written, a newer holder's claim waits for
        // this commit and finds the record.
        if !stored? || !handle.is_held() {
            tracing::warn!(
                "lease lost before the commit: the handler's transaction is rolled back"
            );
            return Err(problem::lock_lost(resource.clone()));
        }
        (tx.commit().await.map(Ok)).map_err(|error| database_problem(&error, resource))
    }

    /// Flags this lease's marker (its writes go through a transaction that commits with
    /// the record) and begins that transaction, in one round trip.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) async fn begin_transactional(
        &self,
        handle: &LeaseHandle,
    ) -> Result<Transaction<'static, Postgres>, Problem> {
        let begin = crate::node::postgres::Sql::new(BEGIN_TRANSACTIONAL)
            .text(handle.resource().as_str())
            .number(token_of(handle)?)
            .done();
        self.pool
            .begin_with(begin)
            .await
            .map_err(|error| database_problem(&error, handle.resource()))
    }

    /// Removes this lease's marker: nothing recorded, the next request runs again. The
    /// handler's transaction, if any, rolls back first (a marker claimed in it goes with it).
    pub(crate) async fn discard(
        &self,
        tx: Option<TxState>,
        handle: &LeaseHandle,
    ) -> Result<(), Problem> {
        if let Some(TxState::Begun { tx, .. } | TxState::Returned(tx)) = tx {
            let _ = tx.rollback().await;
        }
        if self.claim_in_tx {
            return Ok(());
        }
        sqlx::query(DISCARD)
            .bind(handle.resource().as_str())
            .bind(token_of(handle)?)
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|error| database_problem(&error, handle.resource()))
    }
}

fn record_of(token: i64, fingerprint: Vec<u8>, data: Vec<u8>) -> Record {
    Record::new(
        FencingToken::new(token as u64),
        fingerprint.into(),
        data.into(),
    )
}

fn token_of(handle: &LeaseHandle) -> Result<i64, Problem> {
    crate::fence::to_i64(handle.fencing_token())
        .map_err(|error| database_problem(&error, handle.resource()))
}

/// 503: the records' database failed; nothing of the request was committed.
pub(crate) fn database_problem(error: &dyn std::fmt::Display, resource: &Resource) -> Problem {
    tracing::warn!(%error, "idempotency records' database failed");
    Problem::new(
        ProblemKind::LockUnavailable,
        "the idempotency records' database failed; nothing of the request was committed",
    )
    .with_retry_after(RETRY_SOON)
    .with_resource(resource.clone())
}
