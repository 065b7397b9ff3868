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
use crate::node::redis::call::{
    self, int, returned, Call, CallError, Op, ReplicaWait, ScriptOp, RECORD,
};
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

fn bytes_of(value: &Value) -> Option<Bytes> {
    match value {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
        Value::Nil => Some(Bytes::new()),
        _ => None,
    }
}

fn record_of(
    what: &str,
    token: &Value,
    fingerprint: &Value,
    data: &Value,
) -> Result<Record, NodeError> {
    let token_of = int(token).and_then(|n| u64::try_from(n).ok());
    match (token_of, bytes_of(fingerprint), bytes_of(data)) {
        (Some(token), Some(fingerprint), Some(data)) => {
            Ok(Record::new(FencingToken::new(token), fingerprint, data))
        }
        _ => Err(NodeError::Protocol(
            format!("{what}: malformed record (token {token:?})").into(),
        )),
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
        let mut hmget = redis::cmd("HMGET");
        hmget
            .arg(self.0.record())
            .arg(&["state", "token", "fp", "data"]);
        let value = conn.send_one(&hmget).await?;
        let Value::Array(fields) = &value else {
            return Err(CallError::Reply(returned("HMGET", &value)));
        };
        match fields.as_slice() {
            [Value::BulkString(state), token, fingerprint, data] if state.as_slice() == b"done" => {
                record_of("HMGET", token, fingerprint, data)
                    .map(Some)
                    .map_err(CallError::Reply)
            }
            [_, _, _, _] => Ok(None),
            _ => Err(CallError::Reply(returned("HMGET", &value))),
        }
    }
}

/// The record script's claim. With `wait`, a stored marker counts only once enough
/// replicas acknowledged it.
pub(crate) fn claim(request: &ClaimRequest<'_>) -> ScriptOp<ClaimReply> {
    let ms = |ttl: Option<Duration>| ttl.map(|ttl| millis_ceil(ttl).to_string());
    let call = record_call(request.keys, "claim")
        .arg(request.owner.as_str())
        .arg(request.token)
        .arg(request.fingerprint)
        .arg(millis_ceil(request.pending_ttl))
        .arg(ms(request.orphan_ttl).unwrap_or_default())
        .arg(ms(request.remember_interrupted).unwrap_or_default());
    let wrote: fn(&Value) -> bool =
        |v| matches!(v, Value::Array(a) if matches!(a.first().and_then(int), Some(2 | 4)));
    ScriptOp::new(call, Some(wrote), |value| {
        let Value::Array(items) = &value else {
            return Err(returned("claim", &value));
        };
        match items.as_slice() {
            [tag] if int(tag) == Some(0) => Ok(ClaimReply::NotOwner),
            [tag] if int(tag) == Some(2) => Ok(ClaimReply::Claimed),
            [tag, Value::BulkString(token)] if int(tag) == Some(4) => {
                match std::str::from_utf8(token).ok().and_then(|t| t.parse().ok()) {
                    Some(interrupted) => Ok(ClaimReply::ClaimedAfter { interrupted }),
                    None => Err(returned("claim", &value)),
                }
            }
            [tag, pttl] if int(tag) == Some(3) => Ok(ClaimReply::Orphaned {
                pttl: call::pttl(pttl),
            }),
            [tag, token, fingerprint, data] if int(tag) == Some(1) => {
                record_of("claim", token, fingerprint, data).map(ClaimReply::Completed)
            }
            _ => Err(returned("claim", &value)),
        }
    })
}

/// The record script's store. With `wait`, a stored record counts only once enough
/// replicas acknowledged it.
pub(crate) fn store(request: &StoreRequest<'_>) -> ScriptOp<StoreReply> {
    let call = record_call(request.keys, "store")
        .arg(request.owner.as_str())
        .arg(request.record.token().get())
        .arg(request.record.fingerprint().as_ref())
        .arg(request.record.data().as_ref())
        .arg(millis_ceil(request.retention));
    ScriptOp::new(call, Some(|v| int(v) == Some(1)), |value| {
        match int(&value) {
            Some(1) => Ok(StoreReply::Stored),
            Some(0) => Ok(StoreReply::NotOwner),
            Some(2) => Ok(StoreReply::Superseded),
            _ => Err(returned("store", &value)),
        }
    })
}

/// The record script's discard. Never waits for replicas: a lost discard only makes a
/// later claim report an unknown outcome.
pub(crate) fn discard(keys: &ResourceKeys, token: u64) -> ScriptOp<bool> {
    let call = record_call(keys, "discard").arg(token);
    ScriptOp::new(call, None, call::parse_flag)
}
