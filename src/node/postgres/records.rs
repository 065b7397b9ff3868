//! [`PostgresNode`]'s outcome records (idempotent replay): rows of `redlock_node_records`,
//! each operation one statement (a claim and a store call functions of the node's
//! schema, which take a transaction-scoped advisory lock on the record first, so two of
//! them never interleave their read and their write; it ends with the call, so poolers
//! are no matter).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::PgRow;
use sqlx::{Executor, Row};

use super::sql::{bigint, millis, node_error};
use super::statement::Sql;
use super::PostgresNode;
use crate::error::NodeError;
use crate::node::{
    ClaimReply, ClaimRequest, FencingToken, NodeFuture, Record, RecordStore, ResourceKeys,
    StoreReply, StoreRequest,
};

/// `$1` record key.
const READ: &str = "SELECT token, fingerprint, data FROM redlock_node_records
    WHERE key = $1 AND data IS NOT NULL AND expires_at > clock_timestamp()";

/// `redlock_claim_record` of the node's schema: `$1` record key, `$2` lock key, `$3`
/// owner, `$4` token, `$5` fingerprint, `$6` pending ttl ms, `$7` orphan ttl ms or NULL,
/// `$8` interrupted key, `$9` remember ms or NULL. Answers the case, the record's
/// columns, its pttl and the interrupted token.
const CLAIM: &str = "SELECT * FROM redlock_claim_record($1::text, $2::text, $3::text, \
     $4::int8, $5::bytea, $6::float8, $7::float8, $8::text, $9::float8)";

/// `redlock_store_record`: `$1` record key, `$2` lock key, `$3` owner, `$4` token, `$5`
/// fingerprint, `$6` data, `$7` retention ms. Answers the case.
const STORE: &str = "SELECT redlock_store_record($1::text, $2::text, $3::text, $4::int8, \
     $5::bytea, $6::bytea, $7::float8)";

/// `$1` record key, `$2` token: deletes that token's pending marker.
const DISCARD: &str = "DELETE FROM redlock_node_records
    WHERE key = $1 AND token = $2 AND data IS NULL AND expires_at > clock_timestamp()
    RETURNING key";

/// A record from its columns as read.
fn record(
    token: sqlx::Result<i64>,
    fingerprint: sqlx::Result<Vec<u8>>,
    data: sqlx::Result<Vec<u8>>,
) -> sqlx::Result<Record> {
    Ok(Record::new(
        FencingToken::new(token? as u64),
        Bytes::from(fingerprint?),
        Bytes::from(data?),
    ))
}

impl PostgresNode {
    /// Runs `query` once the tables exist: its last row, the answer (after the lock's).
    fn answer(
        &self,
        query: Result<String, NodeError>,
    ) -> impl Future<Output = Result<Option<PgRow>, NodeError>> + Send + 'static {
        let inner = self.inner.clone();
        async move {
            let query = query?;
            inner.tables().await?;
            let mut rows = inner
                .pool
                .fetch_all(query.as_str())
                .await
                .map_err(node_error)?;
            Ok(rows.pop())
        }
    }
}

fn protocol(what: &str) -> NodeError {
    NodeError::Protocol(format!("unexpected {what} reply").into())
}

impl RecordStore for PostgresNode {
    fn read_record(&self, keys: &ResourceKeys) -> NodeFuture<Option<Record>> {
        let answer = self.answer(Ok(Sql::new(READ).text(&keys.record()).done()));
        Box::pin(async move {
            let Some(row) = answer.await? else {
                return Ok(None);
            };
            let record = record(row.try_get(0), row.try_get(1), row.try_get(2));
            record.map(Some).map_err(node_error)
        })
    }

    fn claim_record(&self, request: &ClaimRequest<'_>) -> NodeFuture<ClaimReply> {
        let key = request.keys.record();
        let answer = self.answer(bigint(request.token).map(|token| {
            Sql::new(CLAIM)
                .text(&key)
                .text(&request.keys.lock)
                .text(request.owner.as_str())
                .number(token)
                .bytes(request.fingerprint)
                .number(millis(request.pending_ttl))
                .maybe(request.orphan_ttl.map(millis))
                .text(&request.keys.interrupted())
                .maybe(request.remember_interrupted.map(millis))
                .done()
        }));
        Box::pin(async move {
            let row = answer.await?.ok_or_else(|| protocol("claim"))?;
            let state: String = row.try_get(0).map_err(node_error)?;
            let pttl: Option<i64> = row.try_get(4).map_err(node_error)?;
            let interrupted: Option<i64> = row.try_get(5).map_err(node_error)?;
            Ok(match state.as_str() {
                "completed" => {
                    let record = record(row.try_get(1), row.try_get(2), row.try_get(3));
                    ClaimReply::Completed(record.map_err(node_error)?)
                }
                "not_owner" => ClaimReply::NotOwner,
                "orphaned" => ClaimReply::Orphaned {
                    pttl: pttl
                        .and_then(|ms| u64::try_from(ms).ok())
                        .map(Duration::from_millis),
                },
                "claimed" | "claim" => match interrupted {
                    Some(token) => ClaimReply::ClaimedAfter {
                        interrupted: token as u64,
                    },
                    None => ClaimReply::Claimed,
                },
                _ => return Err(protocol("claim")),
            })
        })
    }

    fn store_record(&self, request: &StoreRequest<'_>) -> NodeFuture<StoreReply> {
        let key = request.keys.record();
        let record = request.record;
        let answer = self.answer(bigint(record.token().get()).map(|token| {
            Sql::new(STORE)
                .text(&key)
                .text(&request.keys.lock)
                .text(request.owner.as_str())
                .number(token)
                .bytes(record.fingerprint())
                .bytes(record.data())
                .number(millis(request.retention))
                .done()
        }));
        Box::pin(async move {
            let row = answer.await?.ok_or_else(|| protocol("store"))?;
            let state: String = row.try_get(0).map_err(node_error)?;
            match state.as_str() {
                "store" | "stored" => Ok(StoreReply::Stored),
                "superseded" => Ok(StoreReply::Superseded),
                "not_owner" => Ok(StoreReply::NotOwner),
                _ => Err(protocol("store")),
            }
        })
    }

    fn discard_record(&self, keys: &ResourceKeys, token: u64) -> NodeFuture<bool> {
        let query = bigint(token).map(|t| Sql::new(DISCARD).text(&keys.record()).number(t).done());
        let answer = self.answer(query);
        Box::pin(async move { Ok(answer.await?.is_some()) })
    }
}
