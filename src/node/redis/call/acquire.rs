//! The acquire call of every lock shape: one resource or a set of them, exclusive or
//! shared, as the plain `SET NX PX`, the pipelined fenced acquire of a standalone server,
//! or the acquire script; and the raise-fences call that follows a fenced acquisition.

use super::*;
use crate::node::resource::LIMIT_SUFFIX;
use crate::node::{AcquireSetReply, SharedMode, Waiter};

/// What one acquisition asks of a node: the keys of one resource or of a set (all or
/// nothing), how it holds them, and the fence settings (see [`AcquireRequest`]).
#[derive(Clone, Copy)]
pub(crate) struct Acquisition<'a> {
    /// One resource, or a set's members in its canonical order; never empty.
    pub(crate) keys: &'a [ResourceKeys],
    pub(crate) owner: &'a Owner,
    pub(crate) ttl: Duration,
    /// `None`: exclusive. A shared holder's mode is for one resource only.
    pub(crate) shared: Option<SharedMode>,
    pub(crate) fencing: bool,
    pub(crate) fence_floor: u64,
    pub(crate) fence_ttl: Duration,
    pub(crate) seed_only_when_missing: bool,
    /// The waiting caller's place in one resource's wait queue (exclusive only).
    pub(crate) waiter: Option<&'a Waiter>,
}

impl<'a> From<&AcquireRequest<'a>> for Acquisition<'a> {
    fn from(request: &AcquireRequest<'a>) -> Self {
        Acquisition {
            keys: std::slice::from_ref(request.keys),
            owner: request.owner,
            ttl: request.ttl,
            shared: None,
            fencing: request.fencing,
            fence_floor: request.fence_floor,
            fence_ttl: request.fence_ttl,
            seed_only_when_missing: request.seed_only_when_missing,
            waiter: request.waiter,
        }
    }
}

/// A node's answer to an [`Acquisition`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Grant {
    /// Every resource granted: the first one's fence token, then the others' (a
    /// `Vec` only for a set, so that one resource allocates nothing).
    Acquired { first: u64, rest: Vec<u64> },
    /// Someone else holds resource `member` (the longest remaining ttl of those held).
    Held {
        member: usize,
        pttl: Option<Duration>,
    },
    /// Shared holders hold it in another mode.
    OtherMode { held: SharedMode },
}

impl From<Grant> for AcquireReply {
    fn from(grant: Grant) -> Self {
        match grant {
            Grant::Acquired { first, .. } => AcquireReply::Acquired { fence: first },
            Grant::Held { pttl, .. } => AcquireReply::Held { pttl },
            Grant::OtherMode { held } => AcquireReply::OtherMode { held },
        }
    }
}

impl From<Grant> for AcquireSetReply {
    fn from(grant: Grant) -> Self {
        match grant {
            Grant::Acquired { first, rest } => AcquireSetReply::Acquired {
                fences: std::iter::once(first).chain(rest).collect(),
            },
            Grant::Held { member, pttl } => AcquireSetReply::Held { member, pttl },
            // Sets are exclusive.
            Grant::OtherMode { .. } => AcquireSetReply::Held { member: 0, pttl: None },
        }
    }
}

/// The owned arguments of one acquire call (the call outlives the request).
pub(crate) enum Acquire {
    /// [`LockOptions::fencing(false)`](crate::LockOptions::fencing), one exclusive
    /// resource, no waiter: one `SET NX PX`. It skips the wait queue's check: a lock
    /// handed to the next waiter is reserved (the key exists), so it barges in only
    /// where a holder's key expired and the queue's head has not retried yet.
    Plain {
        lock: String,
        owner: String,
        ttl_ms: u64,
    },
    /// Fenced, one exclusive resource, no waiter, a standalone server: see [`Pipelined`].
    Pipelined(Pipelined),
    /// The acquire script (`acquire.lua`): the lock keys behind the wait queue and,
    /// with fencing, the floored fence counters, atomically.
    Script(Call),
}

impl Acquire {
    /// `sharded`: the node publishes on sharded channels (Redis Cluster).
    pub(crate) fn new(acq: &Acquisition<'_>, sharded: bool) -> Self {
        let ttl_ms = millis_ceil(acq.ttl);
        let [keys] = acq.keys else {
            return Acquire::Script(script(acq, ttl_ms, sharded));
        };
        let common = !acq.seed_only_when_missing && acq.waiter.is_none() && acq.shared.is_none();
        if common && !acq.fencing {
            return Acquire::Plain {
                lock: keys.lock.clone(),
                owner: acq.owner.as_str().to_owned(),
                ttl_ms,
            };
        }
        // A cluster's pipeline would be split by redis-rs's routing: one script there.
        if common && !sharded {
            return Acquire::Pipelined(Pipelined::new(acq, keys, ttl_ms));
        }
        Acquire::Script(script(acq, ttl_ms, sharded))
    }
}

/// The acquire script's call (see `acquire.lua` for its arguments).
fn script(acq: &Acquisition<'_>, ttl_ms: u64, sharded: bool) -> Call {
    let fence_mode = match (acq.fencing, acq.seed_only_when_missing) {
        (false, _) => "0",
        (true, false) => "1",
        (true, true) => "s",
    };
    let keys = acq.keys.len() * 3 + if acq.shared.is_some() { 2 } else { 0 };
    let mut call = Call::new(&ACQUIRE, keys);
    for member in acq.keys {
        call = call
            .arg(&member.lock)
            .arg(&member.fence)
            .arg(Suffixed(&member.lock, QUEUE_SUFFIX));
    }
    if let ([member], Some(_)) = (acq.keys, acq.shared) {
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
    if let Some(mode) = acq.shared {
        return call.arg(mode.limit().map_or(0, |n| n.get()));
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

/// With `wait`, a grant counts only once enough replicas acknowledged the key and the
/// counter.
impl Op for Acquire {
    type Output = Grant;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<Grant, CallError> {
        let one = match self {
            Acquire::Plain {
                lock,
                owner,
                ttl_ms,
            } => acquire_plain(conn, lock, owner, *ttl_ms, wait).await?,
            Acquire::Pipelined(pipelined) => pipelined.run(conn, wait).await?,
            Acquire::Script(call) => {
                let value = call.run(conn, wait, acquire_granted).await?;
                return parse_acquire(&value).map_err(CallError::Reply);
            }
        };
        Ok(match one {
            AcquireReply::Acquired { fence } => Grant::Acquired {
                first: fence,
                rest: Vec::new(),
            },
            AcquireReply::Held { pttl } => Grant::Held { member: 0, pttl },
            AcquireReply::OtherMode { held } => Grant::OtherMode { held },
        })
    }
}

/// A fenced caller that does not wait, on a standalone server (or a Sentinel's master):
/// the lock's `SET NX PX`, an `EXISTS` of its wait queue and the fence script
/// (`fence.lua`: the counter's rule, `max(counter + 1, floor)`), pipelined. Redis
/// charges a command inside a script far more than the same command sent plainly, and
/// a script per argument (Redis's instructions per acquire + release, the acquire script
/// against this pipeline: `benches/server_cost.py`, BENCHMARKS.md).
///
/// The fence script runs whether or not the `SET` took the key: a refused caller moves
/// the counter up, never down, so every later token is still above every earlier one
/// (the counter's guarantee is about order, not about gaps). Where the `SET` took the
/// key while waiters are queued (a holder's key expired before the queue's head
/// retried), the acquire script finishes the call (its `ARGV[12]`): the queue's head
/// comes first, as for any key found free, so no caller barges in.
pub(crate) struct Pipelined {
    /// `SET lock owner NX PX ttl`, `EXISTS queue`, `EVALSHA fence 1 counter floor [ttl]`.
    pub(super) pipe: redis::Pipeline,
}

impl Pipelined {
    fn new(acq: &Acquisition<'_>, keys: &ResourceKeys, ttl_ms: u64) -> Self {
        let (lock, owner) = (&keys.lock, acq.owner.as_str());
        // Each command sized up front (numbers: at most 20 digits), so that building
        // it never reallocates: growing three empty commands cost more than the rest
        // of the call's client work.
        let set = set_nx_px(lock, owner, ttl_ms);
        let mut exists = Cmd::with_capacity(2, lock.len() + QUEUE_SUFFIX.len() + 6);
        exists.arg("EXISTS").arg(Suffixed(lock, QUEUE_SUFFIX));
        let mut fence = Call::with_capacity(&FENCE, 1, 6, keys.fence.len() + 96)
            .arg(&keys.fence)
            .arg(acq.fence_floor);
        if acq.fence_ttl != DEFAULT_FENCE_TTL {
            fence = fence.arg(millis_ceil(acq.fence_ttl));
        }
        let mut pipe = redis::Pipeline::with_capacity(3);
        pipe.add_command(set)
            .add_command(exists)
            .add_command(fence.into_command())
            .ignore_errors();
        Pipelined { pipe }
    }

    /// Argument `index` of command `command` of the pipeline.
    fn arg(&self, command: usize, index: usize) -> &[u8] {
        self.pipe
            .cmd_iter()
            .nth(command)
            .and_then(|cmd| cmd.args_iter().nth(index))
            .map_or(&[], |arg| match arg {
                redis::Arg::Simple(bytes) => bytes,
                _ => &[],
            })
    }

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<AcquireReply, CallError> {
        let replies: Vec<RedisResult<Value>> = match wait {
            None => conn.send_pipeline(&self.pipe).await?,
            // Boxed, as every rare path here: held inline, they made every acquire's
            // future too large for the allocator's fast path (see `RedisNode`'s test).
            Some(_) => Box::pin(query(conn, self.pipe.clone(), 3, wait)).await?,
        };
        let mut replies = replies.into_iter();
        let mut next = || {
            replies.next().ok_or_else(|| {
                CallError::Reply(NodeError::Protocol("too few replies to the acquire".into()))
            })
        };
        let (set, queued, fence, mut acks) = (next()?, next()?, next()?, replies.next());
        let set = set?;
        let queued = queued?;
        let fence = match fence {
            // A server that has not seen the fence script yet: the SET and EXISTS ran,
            // the counter's step follows alone, with its own WAIT, which covers the SET
            // as well (a WAIT counts every earlier write of the connection): the
            // pipeline's WAIT need not count too.
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let call = Call {
                    lua: &FENCE,
                    evalsha: self.pipe.cmd_iter().nth(2).cloned().unwrap_or_default(),
                };
                acks = wait.map(|_| Ok(Value::Int(i64::MAX)));
                Box::pin(call.once(conn, &call.eval(), wait, |_| true)).await
            }
            fence => fence.map_err(CallError::from),
        };
        let fence = match fence {
            Err(e) if !matches!(set, Value::Nil) => {
                // A counter of the wrong type: no lock key of ours is left behind.
                Box::pin(self.release_taken(conn)).await?;
                return Err(e);
            }
            fence => fence?,
        };
        let token = int(&fence)
            .and_then(|token| u64::try_from(token).ok())
            .ok_or_else(|| {
                CallError::Reply(NodeError::Protocol(
                    format!("fence script returned {fence:?}").into(),
                ))
            })?;
        if matches!(set, Value::Nil) {
            // Boxed: held inline, its rare case (shared holders) would enlarge every
            // acquire's future.
            let held = Box::pin(held_by_another(conn, self.arg(0, 1), self.arg(0, 2)));
            if let Some(held) = held.await? {
                return Ok(held);
            }
            // Our own key: an earlier send of this very call landed before its
            // connection broke (see `acquire_plain`). The counter's write follows that
            // SET on the server, so this send's `WAIT` covers it too.
        } else if int(&queued) == Some(1) {
            return Box::pin(self.behind_the_queue(conn, wait)).await;
        }
        check_acks(acks, wait)?;
        Ok(AcquireReply::Acquired { fence: token })
    }

    /// Releases the key the `SET` took (the release script, as a lease's release).
    async fn release_taken<C: SendOne>(&self, conn: &mut C) -> Result<(), CallError> {
        // The release's fast path: the lock key, its queue and the owner.
        let call = Call::new(&RELEASE, 2)
            .arg(self.arg(0, 1))
            .arg(self.arg(1, 1))
            .arg(self.arg(0, 2));
        call.run(conn, None, |_| false).await.map(drop)
    }

    /// The acquire script's call for [`Self::behind_the_queue`]: this call's arguments,
    /// a caller that does not wait, and `ARGV[12]`.
    pub(super) fn queued_call(&self) -> Call {
        let lock = self.arg(0, 1);
        // The fence script's ttl, left out when it is the default.
        let default_fence_ttl = millis_ceil(DEFAULT_FENCE_TTL).to_string();
        let fence_ttl = match self.arg(2, 5) {
            [] => default_fence_ttl.as_bytes(),
            sent => sent,
        };
        Call::new(&ACQUIRE, 3)
            .arg(lock)
            .arg(self.arg(2, 3))
            .arg(self.arg(1, 1))
            .arg(self.arg(0, 2))
            .arg(self.arg(0, 5))
            .arg(fence_ttl)
            .arg(self.arg(2, 4))
            .arg("1")
            .arg([lock, CHANNEL_SUFFIX.as_bytes()].concat())
            .arg("0")
            .arg(millis_ceil(HANDOFF_TTL))
            .arg("")
            .arg(0)
            .arg(0)
            .arg("1")
    }

    /// The `SET` took a free key while waiters are queued: the acquire script decides
    /// (the queue's head first), with this call's arguments.
    async fn behind_the_queue<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<AcquireReply, CallError> {
        let call = self.queued_call();
        let value = call.run(conn, wait, acquire_granted).await?;
        parse_acquire(&value)
            .map(AcquireReply::from)
            .map_err(CallError::Reply)
    }
}

/// `true` when the acquire script's reply says it granted (and so wrote).
pub(super) fn acquire_granted(value: &Value) -> bool {
    matches!(value, Value::Array(items) if items.first().and_then(int) == Some(1))
}

/// The acquire script's reply: `{1, token, …}` (one per resource), `{0, pttl[, i]}`
/// (resource `i`, 1-based, is held) or `{2, limit}` (shared holders with another limit).
pub(super) fn parse_acquire(value: &Value) -> Result<Grant, NodeError> {
    let bad = || NodeError::Protocol(format!("acquire script returned {value:?}").into());
    let token = |n: &Value| int(n).and_then(|t| u64::try_from(t).ok()).ok_or_else(bad);
    let Value::Array(items) = value else {
        return Err(bad());
    };
    let Some((flag, [n, rest @ ..])) = items.split_first() else {
        return Err(bad());
    };
    match (int(flag), rest) {
        (Some(1), _) => Ok(Grant::Acquired {
            first: token(n)?,
            rest: rest.iter().map(token).collect::<Result<_, _>>()?,
        }),
        // -1: the key has no ttl; -2: it vanished in between (cannot happen in a script).
        (Some(0), [] | [_]) => {
            let member = match rest {
                [member] => token(member)?.checked_sub(1).ok_or_else(bad)?,
                _ => 0,
            };
            Ok(Grant::Held {
                member: usize::try_from(member).map_err(|_| bad())?,
                pttl: int(n)
                    .and_then(|ms| u64::try_from(ms).ok())
                    .map(Duration::from_millis),
            })
        }
        // Shared holders: their limit, 0 for readers.
        (Some(2), []) => {
            let limit = int(n).and_then(|l| u32::try_from(l).ok()).ok_or_else(bad)?;
            Ok(Grant::OtherMode {
                held: SharedMode::counted(limit).unwrap_or(SharedMode::Shared),
            })
        }
        _ => Err(bad()),
    }
}

/// After a `SET NX` that did not set: `Held` when another owner has the key, `None`
/// when it is ours (the resend of a call whose first send landed).
async fn held_by_another<C: SendOne>(
    conn: &mut C,
    lock: &[u8],
    owner: &[u8],
) -> Result<Option<AcquireReply>, CallError> {
    let mut pipe = redis::pipe();
    pipe.cmd("GET")
        .arg(lock)
        .cmd("PTTL")
        .arg(lock)
        .ignore_errors();
    let mut replies = conn.send_pipeline(&pipe).await?.into_iter();
    let (Some(holder), Some(pttl)) = (replies.next(), replies.next()) else {
        return Err(CallError::Reply(NodeError::Protocol(
            "too few replies to GET and PTTL".into(),
        )));
    };
    match holder {
        Ok(Value::BulkString(value)) if value.as_slice() == owner => Ok(None),
        Ok(_) => Ok(Some(held(pttl?))),
        Err(e) => held_by_shared_holders(conn, lock, e, pttl).await,
    }
}

/// The holder's ttl as `PTTL` answered it (-1: the key has no ttl; -2: it vanished in
/// between).
fn held(pttl: Value) -> AcquireReply {
    AcquireReply::Held {
        pttl: int(&pttl)
            .and_then(|ms| u64::try_from(ms).ok())
            .map(Duration::from_millis),
    }
}

/// A GET refused (WRONGTYPE): shared holders keep a sorted set at the key (see
/// `node::modes`), which is another holder; any other type's error is the answer. The
/// key may have changed since (the holders gone, a writer in): a string or no key reads
/// as held too, and the caller tries again.
async fn held_by_shared_holders<C: SendOne>(
    conn: &mut C,
    lock: &[u8],
    error: RedisError,
    pttl: RedisResult<Value>,
) -> Result<Option<AcquireReply>, CallError> {
    let kind: String = redis::cmd("TYPE").arg(lock).query_async(conn).await?;
    if !matches!(kind.as_str(), "zset" | "string" | "none") {
        return Err(error.into());
    }
    Ok(Some(held(pttl?)))
}

/// `SET lock owner NX PX ttl`, sized up front (numbers: at most 20 digits) so that
/// building it never reallocates.
fn set_nx_px(lock: &str, owner: &str, ttl_ms: u64) -> Cmd {
    let mut set = Cmd::with_capacity(6, lock.len() + owner.len() + 32);
    set.arg("SET")
        .arg(lock)
        .arg(owner)
        .arg("NX")
        .arg("PX")
        .arg(ttl_ms);
    set
}

/// Without fencing: one `SET NX PX`, the least a Redlock can do; `GET` and `PTTL`
/// follow only when the key exists.
async fn acquire_plain<C: SendOne>(
    conn: &mut C,
    lock: &str,
    owner: &str,
    ttl_ms: u64,
    wait: Option<ReplicaWait>,
) -> Result<AcquireReply, CallError> {
    let set = set_nx_px(lock, owner, ttl_ms);
    let (set, acks) = match wait {
        // One command, no pipeline: the common case.
        None => (conn.send_one(&set).await?, None),
        Some(_) => {
            let mut pipe = redis::pipe();
            pipe.add_command(set);
            // Boxed: rare, and held inline it would enlarge every acquire's future.
            let mut replies = Box::pin(query(conn, pipe, 1, wait)).await?.into_iter();
            let Some(set) = replies.next() else {
                return Err(CallError::Reply(NodeError::Protocol(
                    "no reply to SET".into(),
                )));
            };
            (set?, replies.next())
        }
    };
    if matches!(set, Value::Nil) {
        // Boxed, as in `Pipelined::run`.
        let held = Box::pin(held_by_another(conn, lock.as_bytes(), owner.as_bytes()));
        if let Some(held) = held.await? {
            return Ok(held);
        }
        // Our own key: an earlier send of this very call landed before its connection
        // broke, and this is the resend (`redis_conn`, or redis-rs's cluster client).
        // It is the same grant, not a second one: the owner value is this
        // acquisition's alone, and the key held it ever since.
        if let Some(wait) = wait {
            // This send wrote nothing, so its `WAIT` says nothing about the earlier
            // send's SET: fail closed.
            return Err(CallError::Reply(NodeError::Server(
                format!("a resent grant cannot be confirmed by replicas ({wait})").into(),
            )));
        }
    }
    check_acks(acks, wait)?;
    Ok(AcquireReply::Acquired { fence: 0 })
}

/// The raise-fences script: each resource's counter to at least its token (the one the
/// quorum agreed on). With `wait`, a raised counter counts only once enough replicas
/// acknowledged it.
pub(crate) struct RaiseFences(Call);

impl RaiseFences {
    pub(crate) fn new(keys: &[ResourceKeys], tokens: &[u64], fence_ttl: Duration) -> Self {
        let mut call = Call::new(&RAISE_FENCES, keys.len());
        for member in keys {
            call = call.arg(&member.fence);
        }
        call = call.arg(millis_ceil(fence_ttl));
        for token in tokens {
            call = call.arg(*token);
        }
        RaiseFences(call)
    }
}

impl Op for RaiseFences {
    type Output = ();

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<(), CallError> {
        let wrote = |value: &Value| int(value).is_some_and(|raised| raised > 0);
        let value = self.0.run(conn, wait, wrote).await?;
        int(&value).map(drop).ok_or_else(|| {
            CallError::Reply(NodeError::Protocol(
                format!("raise-fences script returned {value:?}").into(),
            ))
        })
    }
}
