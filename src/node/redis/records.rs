//! The outcome-record commands of Redis-backed nodes (see `lock/record/`): the record
//! script (`scripts/record.lua`: claim, store, discard; sent in order, see
//! [`Call`]) and one `HMGET`, over any connection, so the standalone, cluster and
//! sentinel nodes run one implementation of the protocol. The record key is a hash
//! (`state`, `token`, `fp`, `data`, `orphan`) in the lock key's hash slot; values are
//! raw bytes. Errors are [`CallError`]s, so a sentinel node can tell the ones that call
//! for looking its master up again.

use std::time::Duration;

use crate::node::redis::conn::SendOne;
use bytes::Bytes;
use redis::Value;

use crate::error::NodeError;
use crate::node::redis::call::{int, Call, CallError, Op, ReplicaWait, RECORD};
use crate::node::redis::millis_ceil;
use crate::node::FencingToken;
use crate::node::ResourceKeys;
use crate::node::{ClaimReply, ClaimRequest, Record, StoreReply, StoreRequest};

/// The record script's call of operation `op` on `keys`' record (its three keys); add
/// the operation's arguments.
fn record_call(keys: &ResourceKeys, op: &'static str) -> Call {
    Call::new(&RECORD, 3)
        .arg(&keys.lock)
        .arg(keys.record())
        .arg(keys.interrupted())
        .arg(op)
}

fn protocol(what: &str, value: &Value) -> CallError {
    CallError::Reply(NodeError::Protocol(
        format!("{what} returned {value:?}").into(),
    ))
}

fn bytes_of(value: &Value) -> Option<Bytes> {
    match value {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
        Value::Nil => Some(Bytes::new()),
        _ => None,
    }
}

fn token_of(value: &Value) -> Option<FencingToken> {
    int(value)
        .and_then(|n| u64::try_from(n).ok())
        .map(FencingToken::new)
}

fn record_of(
    what: &str,
    token: &Value,
    fingerprint: &Value,
    data: &Value,
) -> Result<Record, CallError> {
    match (token_of(token), bytes_of(fingerprint), bytes_of(data)) {
        (Some(token), Some(fingerprint), Some(data)) => Ok(Record::new(token, fingerprint, data)),
        _ => Err(CallError::Reply(NodeError::Protocol(
            format!("{what}: malformed record (token {token:?})").into(),
        ))),
    }
}

/// `HMGET record state token fp data`: the completed record, if any.
pub(crate) struct ReadCall(pub(crate) ResourceKeys);

impl Op for ReadCall {
    type Output = Option<Record>;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        _: Option<ReplicaWait>,
    ) -> Result<Option<Record>, CallError> {
        read(conn, &self.0).await
    }
}

async fn read<C: SendOne>(conn: &mut C, keys: &ResourceKeys) -> Result<Option<Record>, CallError> {
    let value: Value = redis::cmd("HMGET")
        .arg(keys.record())
        .arg(&["state", "token", "fp", "data"])
        .query_async(conn)
        .await?;
    let Value::Array(fields) = &value else {
        return Err(protocol("HMGET", &value));
    };
    match fields.as_slice() {
        [Value::BulkString(state), token, fingerprint, data] if state.as_slice() == b"done" => {
            record_of("HMGET", token, fingerprint, data).map(Some)
        }
        [_, _, _, _] => Ok(None),
        _ => Err(protocol("HMGET", &value)),
    }
}

/// The owned arguments of one claim call.
pub(crate) struct ClaimCall(Call);

impl ClaimCall {
    pub(crate) fn new(request: &ClaimRequest<'_>) -> Self {
        let ms = |ttl: Option<Duration>| ttl.map(|ttl| millis_ceil(ttl).to_string());
        ClaimCall(
            record_call(request.keys, "claim")
                .arg(request.owner.as_str())
                .arg(request.token)
                .arg(request.fingerprint)
                .arg(millis_ceil(request.pending_ttl))
                .arg(ms(request.orphan_ttl).unwrap_or_default())
                .arg(ms(request.remember_interrupted).unwrap_or_default()),
        )
    }
}

/// The record script's claim. With `wait`, a stored marker counts only once enough replicas
/// acknowledged it.
impl Op for ClaimCall {
    type Output = ClaimReply;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<ClaimReply, CallError> {
        let call = self;
        let value = call
            .0
            .run(
                conn,
                wait,
                |v| matches!(v, Value::Array(a) if matches!(a.first().and_then(int), Some(2 | 4))),
            )
            .await?;
        let Value::Array(items) = &value else {
            return Err(protocol("claim", &value));
        };
        match items.as_slice() {
            [tag] if int(tag) == Some(0) => Ok(ClaimReply::NotOwner),
            [tag] if int(tag) == Some(2) => Ok(ClaimReply::Claimed),
            [tag, Value::BulkString(token)] if int(tag) == Some(4) => {
                match std::str::from_utf8(token).ok().and_then(|t| t.parse().ok()) {
                    Some(interrupted) => Ok(ClaimReply::ClaimedAfter { interrupted }),
                    None => Err(protocol("claim", &value)),
                }
            }
            [tag, pttl] if int(tag) == Some(3) => Ok(ClaimReply::Orphaned {
                pttl: int(pttl)
                    .and_then(|ms| u64::try_from(ms).ok())
                    .map(Duration::from_millis),
            }),
            [tag, token, fingerprint, data] if int(tag) == Some(1) => {
                record_of("claim", token, fingerprint, data).map(ClaimReply::Completed)
            }
            _ => Err(protocol("claim", &value)),
        }
    }
}

/// The owned arguments of one store call.
pub(crate) struct StoreCall(Call);

impl StoreCall {
    pub(crate) fn new(request: &StoreRequest<'_>) -> Self {
        StoreCall(
            record_call(request.keys, "store")
                .arg(request.owner.as_str())
                .arg(request.record.token().get())
                .arg(request.record.fingerprint().as_ref())
                .arg(request.record.data().as_ref())
                .arg(millis_ceil(request.retention)),
        )
    }
}

/// The record script's store. With `wait`, a stored record counts only once enough replicas
/// acknowledged it.
impl Op for StoreCall {
    type Output = StoreReply;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<StoreReply, CallError> {
        let call = self;
        let value = call.0.run(conn, wait, |v| int(v) == Some(1)).await?;
        match int(&value) {
            Some(1) => Ok(StoreReply::Stored),
            Some(0) => Ok(StoreReply::NotOwner),
            Some(2) => Ok(StoreReply::Superseded),
            _ => Err(protocol("store", &value)),
        }
    }
}

/// The owned arguments of one discard call.
pub(crate) struct DiscardCall(Call);

impl DiscardCall {
    pub(crate) fn new(keys: &ResourceKeys, token: u64) -> Self {
        DiscardCall(record_call(keys, "discard").arg(token))
    }
}

/// The record script's discard. Never waits for replicas: a lost discard only makes a later
/// claim report an unknown outcome.
impl Op for DiscardCall {
    type Output = bool;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        _: Option<ReplicaWait>,
    ) -> Result<bool, CallError> {
        let call = self;
        let value = call.0.run(conn, None, |_| false).await?;
        match int(&value) {
            Some(1) => Ok(true),
            Some(0) => Ok(false),
            _ => Err(protocol("discard", &value)),
        }
    }
}
