//! The acquire call of every lock shape (the plain `SET NX PX` or the pipelined fenced
//! acquire of `pipelined.rs`, or the acquire script), and the raise-fences call.

use super::pipelined::{acquire_plain, set_nx_px, Pipelined};
use super::*;
use crate::node::resource::LIMIT_SUFFIX;
use crate::node::{Acquire as Request, LockMode, PerKey, Vote};

/// The owned arguments of one acquire call (the call outlives the request).
pub(crate) enum Acquire {
    /// [`LockOptions::fencing(false)`](crate::LockOptions::fencing), one exclusive
    /// resource, no waiter: one `SET NX PX`. It skips the wait queue's check: a lock
    /// handed to the next waiter is reserved (the key exists), so it barges in only
    /// where a holder's key expired and the queue's head has not retried yet.
    Plain(Cmd),
    /// Fenced, one exclusive resource, no waiter, a standalone server: see [`Pipelined`].
    Pipelined(Pipelined),
    /// The acquire script (`acquire.lua`): the lock keys behind the wait queue and,
    /// with fencing, the floored fence counters, atomically.
    Script(ScriptOp<Vote>),
}

impl Acquire {
    /// `sharded`: the node publishes on sharded channels (Redis Cluster).
    pub(crate) fn new(acq: &Request<'_>, sharded: bool) -> Self {
        let ttl_ms = millis_ceil(acq.ttl);
        let [keys] = acq.keys else {
            return Acquire::Script(acquire_script(script(acq, ttl_ms, sharded)));
        };
        let common = !acq.seed_only_when_missing && acq.waiter.is_none() && acq.mode.is_exclusive();
        if common && !acq.fencing {
            return Acquire::Plain(set_nx_px(&keys.lock, acq.owner.as_str(), ttl_ms));
        }
        // A cluster's pipeline would be split by redis-rs's routing: one script there.
        if common && !sharded {
            return Acquire::Pipelined(Pipelined::new(acq, keys, ttl_ms));
        }
        Acquire::Script(acquire_script(script(acq, ttl_ms, sharded)))
    }
}

/// The acquire script's call as an operation: with `wait`, a grant counts only once
/// enough replicas acknowledged the key and the counter.
pub(super) fn acquire_script(call: Call) -> ScriptOp<Vote> {
    // A grant wrote.
    let granted: fn(&Value) -> bool =
        |value| matches!(value, Value::Array(items) if items.first().and_then(int) == Some(1));
    ScriptOp::new(call, Some(granted), |value| parse_acquire(&value))
}

/// The acquire script's call (see `acquire.lua` for its arguments).
fn script(acq: &Request<'_>, ttl_ms: u64, sharded: bool) -> Call {
    let fence_mode = match (acq.fencing, acq.seed_only_when_missing) {
        (false, _) => "0",
        (true, false) => "1",
        (true, true) => "s",
    };
    let keys = acq.keys.len() * 3 + if acq.mode.is_exclusive() { 0 } else { 2 };
    let mut call = Call::new(&ACQUIRE, keys);
    for member in acq.keys {
        call = call
            .arg(&member.lock)
            .arg(&member.fence)
            .arg(Suffixed(&member.lock, QUEUE_SUFFIX));
    }
    if let ([member], false) = (acq.keys, acq.mode.is_exclusive()) {
        call = call
            .arg(member.writer())
            .arg(Suffixed(&member.lock, LIMIT_SUFFIX));
    }
    call = call
        .arg(acq.owner.as_str())
        .arg(ttl_ms)
        .arg(millis_ceil(acq.fence_ttl))
        // Sent as a decimal string (as every argument is): Lua would format a number
        // this large as a float.
        .arg(acq.fence_floor)
        .arg(fence_mode);
    if !acq.mode.is_exclusive() {
        return call.arg(acq.mode.limit().map_or(0, |n| n.get()));
    }
    if acq.keys.len() > 1 {
        return call;
    }
    let keys = &acq.keys[0];
    let call = call
        .arg(&keys.channel)
        .arg(if sharded { "1" } else { "0" })
        .arg(millis_ceil(HANDOFF_TTL));
    // The waiter's arguments are also what keeps the script off its fast path, which
    // is for callers that do not wait.
    match acq.waiter {
        Some(waiter) => call
            .arg(&waiter.id)
            .arg(waiter.ticket)
            .arg(millis_ceil(waiter.queue_ttl)),
        None => call,
    }
}

impl Op for Acquire {
    type Output = Vote;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<Vote, CallError> {
        match self {
            Acquire::Plain(set) => acquire_plain(conn, set, wait).await,
            Acquire::Pipelined(pipelined) => pipelined.run(conn, wait).await,
            Acquire::Script(script) => script.run(conn, wait).await,
        }
    }
}

/// The acquire script's reply: `{1, token, …}` (one per resource), `{0, pttl[, i]}`
/// (resource `i`, 1-based, is held) or `{2, limit}` (shared holders with another limit).
pub(super) fn parse_acquire(value: &Value) -> Result<Vote, NodeError> {
    let bad = || NodeError::Protocol(format!("acquire script returned {value:?}").into());
    let token = |n: &Value| int(n).and_then(|t| u64::try_from(t).ok()).ok_or_else(bad);
    let Value::Array(items) = value else {
        return Err(bad());
    };
    let Some((flag, [n, rest @ ..])) = items.split_first() else {
        return Err(bad());
    };
    match (int(flag), rest) {
        (Some(1), []) => Ok(Vote::Granted {
            fences: PerKey::one(token(n)?),
        }),
        (Some(1), _) => Ok(Vote::Granted {
            fences: std::iter::once(n)
                .chain(rest)
                .map(token)
                .collect::<Result<Vec<_>, _>>()?
                .into(),
        }),
        // -1: the key has no ttl; -2: it vanished in between (cannot happen in a script).
        (Some(0), [] | [_]) => {
            let member = match rest {
                [member] => token(member)?.checked_sub(1).ok_or_else(bad)?,
                _ => 0,
            };
            Ok(Vote::Held {
                member: usize::try_from(member).map_err(|_| bad())?,
                pttl: pttl(n),
            })
        }
        // Shared holders: their limit, 0 for readers.
        (Some(2), []) => {
            let limit = int(n).and_then(|l| u32::try_from(l).ok()).ok_or_else(bad)?;
            Ok(Vote::OtherMode {
                held: LockMode::counted(limit).unwrap_or(LockMode::Shared),
            })
        }
        _ => Err(bad()),
    }
}

/// The raise-fences script: each resource's counter to at least its token (the one the
/// quorum agreed on). With `wait`, a raised counter counts only once enough replicas
/// acknowledged it.
pub(crate) fn raise_fences(
    keys: &[ResourceKeys],
    tokens: &[u64],
    fence_ttl: Duration,
) -> ScriptOp<()> {
    let mut call = Call::new(&RAISE_FENCES, keys.len());
    for member in keys {
        call = call.arg(&member.fence);
    }
    call = call.arg(millis_ceil(fence_ttl));
    for token in tokens {
        call = call.arg(*token);
    }
    let wrote: fn(&Value) -> bool = |value| int(value).is_some_and(|raised| raised > 0);
    ScriptOp::new(call, Some(wrote), |value| {
        int(&value)
            .map(drop)
            .ok_or_else(|| returned("raise-fences script", &value))
    })
}
