//! The set calls of the standalone and Sentinel nodes: one script per call for the
//! whole set ([`Node::acquire_set`](crate::node::Node::acquire_set) and the others).
//! A cluster cannot run them (the members' keys are in different slots) and keeps the
//! per-key defaults.

use std::sync::LazyLock;
use std::time::Duration;

use crate::node::redis::conn::SendOne;
use redis::Value;

use super::{int, parse_flag, Call, CallError, Lua, Op, ReplicaWait, EXTEND_MANY};
use crate::error::NodeError;
use crate::node::redis::millis_ceil;
use crate::node::{AcquireSetReply, AcquireSetRequest, Owner, ResourceKeys, HANDOFF_TTL};

static ACQUIRE_SET: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(include_str!("../scripts/acquire_set.lua")));
static RELEASE_SET: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        include_str!("../scripts/hand_off.lua"),
        include_str!("../scripts/release_set.lua")
    ))
});
static RAISE_FENCES: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(include_str!("../scripts/raise_fences.lua")));

/// One prepared set call, answering `T`: the script, whether a replica acknowledgement
/// applies to it, and how to read its reply.
pub(crate) struct SetCall<T> {
    call: Call,
    /// `WAIT` applies (not to a release: a lost release only delays the next holder).
    waits: bool,
    wrote: fn(&Value) -> bool,
    parse: fn(&Value) -> Result<T, NodeError>,
}

/// Runs the script (see `Call::run`); with `wait`, an answer that wrote counts only
/// once enough replicas acknowledged it.
impl<T: Send + 'static> Op for SetCall<T> {
    type Output = T;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<T, CallError> {
        let wait = wait.filter(|_| self.waits);
        let value = self.call.run(conn, wait, self.wrote).await?;
        (self.parse)(&value).map_err(CallError::Reply)
    }
}

/// The acquire-set script: every member checked, then all set or none.
pub(crate) fn acquire_set(request: &AcquireSetRequest<'_>) -> SetCall<AcquireSetReply> {
    let flag = |on: bool| if on { "1" } else { "0" };
    let mut call = Call::new(&ACQUIRE_SET, 2 * request.keys.len());
    for keys in request.keys {
        call = call.arg(&keys.lock).arg(&keys.fence);
    }
    SetCall {
        call: call
            .arg(request.owner.as_str())
            .arg(millis_ceil(request.ttl))
            .arg(millis_ceil(request.fence_ttl))
            // A decimal string: Lua would format a number this large as a float.
            .arg(request.fence_floor.to_string())
            .arg(flag(request.seed_only_when_missing))
            .arg(flag(request.fencing)),
        waits: true,
        wrote: |value| matches!(value, Value::Array(items) if items.first().and_then(int) == Some(1)),
        parse: parse_acquire_set,
    }
}

/// `{1, token_1, …, token_n}` or `{0, member (1-based), pttl}`.
fn parse_acquire_set(value: &Value) -> Result<AcquireSetReply, NodeError> {
    let bad = || NodeError::Protocol(format!("acquire-set script returned {value:?}").into());
    let Value::Array(items) = value else {
        return Err(bad());
    };
    match items.split_first() {
        Some((flag, tokens)) if int(flag) == Some(1) => {
            let fences = tokens
                .iter()
                .map(|token| {
                    int(token)
                        .and_then(|t| u64::try_from(t).ok())
                        .ok_or_else(bad)
                })
                .collect::<Result<_, _>>()?;
            Ok(AcquireSetReply::Acquired { fences })
        }
        Some((flag, [member, pttl])) if int(flag) == Some(0) => {
            let member = int(member)
                .and_then(|m| usize::try_from(m).ok())
                .and_then(|m| m.checked_sub(1))
                .ok_or_else(bad)?;
            Ok(AcquireSetReply::Held {
                member,
                // -1: the key has no ttl.
                pttl: int(pttl)
                    .and_then(|p| u64::try_from(p).ok())
                    .map(Duration::from_millis),
            })
        }
        _ => Err(bad()),
    }
}

/// The extend-many script with one owner for every member: yes only if every member
/// was still ours (and so extended).
pub(crate) fn extend_set(keys: &[ResourceKeys], owner: &Owner, ttl: Duration) -> SetCall<bool> {
    let mut call = Call::new(&EXTEND_MANY, keys.len());
    for member in keys {
        call = call.arg(&member.lock);
    }
    call = call.arg(millis_ceil(ttl));
    for _ in keys {
        call = call.arg(owner.as_str());
    }
    SetCall {
        call,
        waits: true,
        wrote: |value| matches!(value, Value::Array(flags) if flags.iter().any(|f| int(f) == Some(1))),
        parse: |value| match value {
            Value::Array(flags) if flags.iter().all(|f| matches!(int(f), Some(0 | 1))) => {
                Ok(flags.iter().all(|f| int(f) == Some(1)))
            }
            other => Err(NodeError::Protocol(
                format!("extend-many script returned {other:?}").into(),
            )),
        },
    }
}

/// The release-set script: compare-and-delete every member, handing each to the next
/// waiter of its queue as a single release does (`SPUBLISH` when `sharded`).
pub(crate) fn release_set(keys: &[ResourceKeys], owner: &Owner, sharded: bool) -> SetCall<bool> {
    let mut call = Call::new(&RELEASE_SET, 2 * keys.len());
    for member in keys {
        call = call.arg(&member.lock).arg(member.queue());
    }
    call = call
        .arg(owner.as_str())
        .arg(if sharded { "1" } else { "0" })
        .arg(millis_ceil(HANDOFF_TTL));
    for member in keys {
        call = call.arg(&member.channel);
    }
    SetCall {
        call,
        waits: false,
        wrote: |_| false,
        parse: |value| parse_flag(value.clone()),
    }
}

/// The raise-fences script: each member's counter to at least its token.
pub(crate) fn raise_fences(
    keys: &[ResourceKeys],
    tokens: &[u64],
    fence_ttl: Duration,
) -> SetCall<()> {
    let mut call = Call::new(&RAISE_FENCES, keys.len());
    for member in keys {
        call = call.arg(&member.fence);
    }
    call = call.arg(millis_ceil(fence_ttl));
    for token in tokens {
        call = call.arg(token.to_string());
    }
    SetCall {
        call,
        waits: true,
        wrote: |value| int(value).is_some_and(|raised| raised > 0),
        parse: |value| {
            int(value).map(|_| ()).ok_or_else(|| {
                NodeError::Protocol(format!("raise-fences script returned {value:?}").into())
            })
        },
    }
}
