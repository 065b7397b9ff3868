//! What every Redis-backed node shares: the Lua scripts, one script call with its
//! `NOSCRIPT` fallback and its optional replica acknowledgement (`WAIT`), and how
//! redis-rs errors become [`NodeError`]s.

use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use redis::{Cmd, ErrorKind, RedisError, RedisResult, Script, ServerErrorKind, Value};

use crate::error::NodeError;
use crate::node::redis::conn::SendOne;
use crate::node::redis::millis_ceil;
use crate::node::LockKeys;
use crate::node::{
    AcquireReply, AcquireRequest, Owner, CHANNEL_SUFFIX, DEFAULT_FENCE_TTL, HANDOFF_TTL,
    QUEUE_SUFFIX,
};

/// One Lua script: its source (for `EVAL` after `NOSCRIPT`) and its SHA1 (for `EVALSHA`).
pub(crate) struct Lua {
    code: &'static str,
    script: Script,
}

impl Lua {
    fn new(code: &'static str) -> Self {
        Lua {
            code,
            script: Script::new(code),
        }
    }
}

/// The acquire script goes out as `EVALSHA` like the others. A server that has not seen
/// it yet (fresh, restarted, a promoted replica) answers `NOSCRIPT`, and the `EVAL`
/// follows one round trip later — after anything else the locker sent on the same
/// connection meanwhile. That is safe because no release of the same attempt is sent
/// to a node while its acquire is in flight: a failed attempt releases on each node
/// only once that node's acquire call has finished, retry included
/// (`Nodes::release_after`), a won lease's release waits for the acquire calls that
/// outlived the round, and a cancelled attempt drops its calls, which are then never
/// resent. The alternative, `EVAL` every time, costs the server a SHA1 of the
/// script per acquisition.
///
/// The acquire and release scripts both hand a free lock to the wait queue's next
/// waiter: they share `hand_off.lua`. Each is one script in three parts: its fast path
/// (the common case: a caller that does not wait, nobody queued), which returns before
/// any of the wait queue's functions is built, then `hand_off.lua`, then the wait
/// queue's case. Redis charges a script per argument and per `redis.call`, and a Lua
/// closure per call of the script (see BENCHMARKS.md): the fast path has the fewest.
static ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        include_str!("../scripts/fence_rule.lua"),
        include_str!("../scripts/acquire_fast.lua"),
        include_str!("../scripts/hand_off.lua"),
        include_str!("../scripts/acquire.lua")
    ))
});
/// The fence counter's rule alone, pipelined behind a plain `SET NX PX` (see
/// [`Acquire::Pipelined`]).
static FENCE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        include_str!("../scripts/fence_rule.lua"),
        include_str!("../scripts/fence.lua")
    ))
});
static EXTEND: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("../scripts/extend.lua")));
static EXTEND_MANY: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(include_str!("../scripts/extend_many.lua")));
static RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        include_str!("../scripts/release_fast.lua"),
        include_str!("../scripts/hand_off.lua"),
        include_str!("../scripts/release.lua")
    ))
});
static RAISE_FENCE: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(include_str!("../scripts/raise_fence.lua")));
static LISTEN: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("../scripts/listen.lua")));

/// Replica acknowledgement: after a script wrote, `WAIT replicas timeout` on the same
/// connection, and the answer counts only if at least `replicas` replicas acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplicaWait {
    pub(crate) replicas: usize,
    pub(crate) timeout: Duration,
}

/// The longest `WAIT` sent: the locker cuts every call at its node timeout (shorter than
/// the ttl, at most 30 days) anyway, and Redis refuses a timeout past its clock's range.
const MAX_WAIT_MS: u64 = 30 * 24 * 3600 * 1000;

impl ReplicaWait {
    /// The timeout as `WAIT` takes it: from 1 ms (0 would block until enough replicas
    /// acknowledged, however long) to [`MAX_WAIT_MS`].
    fn timeout_ms(&self) -> u64 {
        millis_ceil(self.timeout).clamp(1, MAX_WAIT_MS)
    }
}

impl fmt::Display for ReplicaWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "wait for {} replica(s) within {} ms",
            self.replicas,
            self.timeout_ms()
        )
    }
}

/// The text of a node error without its kind's prefix.
#[cfg(any(feature = "cluster", feature = "sentinel"))]
pub(crate) fn detail(e: &NodeError) -> std::sync::Arc<str> {
    match e {
        NodeError::Connection(m) | NodeError::Server(m) | NodeError::Protocol(m) => m.clone(),
        other => other.to_string().into(),
    }
}

/// Why one script call failed.
#[derive(Debug)]
pub(crate) enum CallError {
    /// The connection or the server failed.
    Redis(RedisError),
    /// The script wrote, but fewer replicas than required acknowledged it in time.
    Replicas { acked: i64, wait: ReplicaWait },
    /// The answer had an unexpected shape.
    Reply(NodeError),
}

impl From<RedisError> for CallError {
    fn from(e: RedisError) -> Self {
        CallError::Redis(e)
    }
}

impl CallError {
    /// The server that answered may no longer be the master (it is unreachable, it
    /// answers as a replica, or it lost its replicas): ask the sentinels again.
    #[cfg(feature = "sentinel")]
    pub(crate) fn master_may_have_moved(&self) -> bool {
        match self {
            CallError::Redis(e) => {
                is_connection_error(e)
                    || matches!(
                        e.kind(),
                        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
                    )
            }
            CallError::Replicas { .. } => true,
            CallError::Reply(_) => false,
        }
    }

    /// The script certainly did not run (the server refused every write, or no
    /// connection was made): the call may be sent again elsewhere without effect here.
    #[cfg(feature = "sentinel")]
    pub(crate) fn certainly_not_run(&self) -> bool {
        match self {
            CallError::Redis(e) => {
                e.is_connection_refusal()
                    || matches!(
                        e.kind(),
                        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
                    )
            }
            _ => false,
        }
    }

    pub(crate) fn into_node_error(self) -> NodeError {
        match self {
            CallError::Redis(e) => node_error(e),
            CallError::Replicas { acked, wait } => NodeError::Server(
                format!(
                    "the write was acknowledged by {acked} replica(s), {} required ({wait})",
                    wait.replicas
                )
                .into(),
            ),
            CallError::Reply(e) => e,
        }
    }
}

fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout()
}

/// A redis-rs error as a [`NodeError`]. Authentication failures and client-side
/// configuration or discovery failures count as connection failures (no usable
/// connection could be made) and keep their reason.
pub(crate) fn node_error(e: RedisError) -> NodeError {
    if is_connection_error(&e) {
        NodeError::Connection(e.to_string().into())
    } else if e.kind() == ErrorKind::AuthenticationFailed
        || matches!(e.kind(), ErrorKind::Server(ServerErrorKind::NoPerm))
        || e.code()
            .is_some_and(|code| code == "WRONGPASS" || code == "NOAUTH")
        // A server refuses a long command (the acquire script's) from a client that has
        // not authenticated with "Protocol error: unauthenticated multibulk length".
        || e.to_string().contains("unauthenticated")
    {
        NodeError::Connection(format!("authentication failed: {e}").into())
    } else if matches!(
        e.kind(),
        ErrorKind::InvalidClientConfig
            | ErrorKind::ClusterConnectionNotFound
            | ErrorKind::MasterNameNotFoundBySentinel
            | ErrorKind::NoValidReplicasFoundBySentinel
            | ErrorKind::EmptySentinelList
    ) {
        // Client-side: no usable connection to the right server could be made.
        NodeError::Connection(e.to_string().into())
    } else if matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension) {
        NodeError::Server(e.to_string().into())
    } else {
        NodeError::Protocol(e.to_string().into())
    }
}

/// A key made of a base and a suffix (the wait queue's `lock:queue`), written into the
/// command as one argument without a string of its own: it goes out on every call.
pub(crate) struct Suffixed<'a>(pub(crate) &'a str, pub(crate) &'static str);

impl redis::ToRedisArgs for Suffixed<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let mut arg = out.writer_for_next_arg();
        // Writing into the command's buffer cannot fail.
        let _ = arg.write_all(self.0.as_bytes());
        let _ = arg.write_all(self.1.as_bytes());
    }
}

/// One prepared script call: the `EVALSHA` command, built once with its keys and
/// arguments (numbers are written straight into the command, with no string of their
/// own). The `EVAL` form is built from it only after `NOSCRIPT`.
pub(crate) struct Call {
    lua: &'static Lua,
    evalsha: Cmd,
}

impl Call {
    /// `EVALSHA sha keys…`; add the keys first, then the arguments.
    fn new(lua: &'static Lua, keys: usize) -> Self {
        // Sized for the largest call (acquire: 3 keys of a few dozen bytes, 12
        // arguments), so that building it never reallocates.
        Self::with_capacity(lua, keys, 18, 384)
    }

    /// As [`new`](Self::new), for `args` words in all of `bytes` bytes.
    fn with_capacity(lua: &'static Lua, keys: usize, args: usize, bytes: usize) -> Self {
        let mut evalsha = Cmd::with_capacity(args, bytes);
        evalsha.arg("EVALSHA").arg(lua.script.get_hash()).arg(keys);
        Call { lua, evalsha }
    }

    fn arg<T: redis::ToRedisArgs>(mut self, arg: T) -> Self {
        self.evalsha.arg(arg);
        self
    }

    /// The same call as `EVAL code …`.
    fn eval(&self) -> Cmd {
        let mut eval = redis::cmd("EVAL");
        eval.arg(self.lua.code);
        for arg in self.evalsha.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                eval.arg(bytes);
            }
        }
        eval
    }

    /// Its `EVALSHA` command (to be pipelined).
    fn into_command(self) -> Cmd {
        self.evalsha
    }

    /// The command to send: `EVALSHA`, or `EVAL` after `NOSCRIPT`.
    fn command(&self, by_hash: bool) -> Cmd {
        if by_hash {
            self.evalsha.clone()
        } else {
            self.eval()
        }
    }

    /// Runs the script with `EVALSHA`, or with `EVAL` after `NOSCRIPT` (which also caches
    /// it on the server that answered, and needs no `SCRIPT LOAD` on every node of a
    /// cluster). With `wait`, `WAIT` is pipelined right behind the script on the same
    /// connection, so it covers the script's writes; its answer is checked only when
    /// `wrote` says the script wrote.
    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
        wrote: fn(&Value) -> bool,
    ) -> Result<Value, CallError> {
        match self.once(conn, &self.evalsha, wait, wrote).await {
            Err(CallError::Redis(e))
                if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
            {
                self.once(conn, &self.eval(), wait, wrote).await
            }
            other => other,
        }
    }

    async fn once<C: SendOne>(
        &self,
        conn: &mut C,
        cmd: &Cmd,
        wait: Option<ReplicaWait>,
        wrote: fn(&Value) -> bool,
    ) -> Result<Value, CallError> {
        let Some(wait) = wait else {
            // One command, no pipeline: what nearly every call is.
            return Ok(conn.send_one(cmd).await?);
        };
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone());
        // Boxed: a pipeline's send is 1.3 kB, and held inline it would enlarge every
        // call's future, nearly all of which never wait for replicas.
        let mut replies = Box::pin(query(conn, pipe, 1, Some(wait))).await?;
        let value = replies.remove(0)?;
        if wrote(&value) {
            check_acks(replies.pop(), Some(wait))?;
        }
        Ok(value)
    }
}

/// Sends `pipe` (plus `WAIT` when `wait` is set) and returns one result per command
/// (`replies` of them; none may be marked ignored), the `WAIT` reply last.
pub(crate) async fn query<C: SendOne>(
    conn: &mut C,
    mut pipe: redis::Pipeline,
    replies: usize,
    wait: Option<ReplicaWait>,
) -> Result<Vec<RedisResult<Value>>, CallError> {
    let expected = replies + usize::from(wait.is_some());
    if let Some(wait) = wait {
        pipe.cmd("WAIT").arg(wait.replicas).arg(wait.timeout_ms());
    }
    pipe.ignore_errors();
    let replies = conn.send_pipeline(&pipe).await?;
    if replies.len() != expected {
        return Err(CallError::Reply(NodeError::Protocol(
            format!("{} replies to {expected} commands", replies.len()).into(),
        )));
    }
    Ok(replies)
}

/// Checks the `WAIT` reply (when `wait` is set) against the replicas required.
pub(crate) fn check_acks(
    reply: Option<RedisResult<Value>>,
    wait: Option<ReplicaWait>,
) -> Result<(), CallError> {
    let Some(wait) = wait else {
        return Ok(());
    };
    let reply =
        reply.ok_or_else(|| CallError::Reply(NodeError::Protocol("no reply to WAIT".into())))??;
    let acked = int(&reply).ok_or_else(|| {
        CallError::Reply(NodeError::Protocol(
            format!("WAIT returned {reply:?}").into(),
        ))
    })?;
    if acked < i64::try_from(wait.replicas).unwrap_or(i64::MAX) {
        return Err(CallError::Replicas { acked, wait });
    }
    Ok(())
}

/// The owned arguments of one acquire call (the call outlives the request).
pub(crate) enum Acquire {
    /// [`LockOptions::fencing(false)`](crate::LockOptions::fencing) and no waiter: one
    /// `SET NX PX`. It skips the wait queue's check: a lock handed to the next waiter
    /// is reserved (the key exists), so it barges in only where a holder's key expired
    /// and the queue's head has not retried yet.
    Plain {
        lock: String,
        owner: String,
        ttl_ms: u64,
    },
    /// Fenced, no waiter, a standalone server: see [`Pipelined`].
    Pipelined(Pipelined),
    /// The acquire script: the lock key behind the wait queue and, with fencing, the
    /// floored fence counter, atomically.
    Script(Call),
}

impl Acquire {
    /// `sharded`: the node publishes on sharded channels (Redis Cluster).
    pub(crate) fn new(request: &AcquireRequest<'_>, sharded: bool) -> Self {
        let ttl_ms = millis_ceil(request.ttl);
        let common = !request.seed_only_when_missing && request.waiter.is_none();
        if common && !request.fencing {
            return Acquire::Plain {
                lock: request.keys.lock.clone(),
                owner: request.owner.as_str().to_owned(),
                ttl_ms,
            };
        }
        // A cluster's pipeline would be split by redis-rs's routing: one script there.
        if common && !sharded {
            return Acquire::Pipelined(Pipelined::new(request, ttl_ms));
        }
        let fence_mode = match (request.fencing, request.seed_only_when_missing) {
            (false, _) => "0",
            (true, false) => "1",
            (true, true) => "s",
        };
        let call = Call::new(&ACQUIRE, 3)
            .arg(&request.keys.lock)
            .arg(&request.keys.fence)
            .arg(Suffixed(&request.keys.lock, QUEUE_SUFFIX))
            .arg(request.owner.as_str())
            .arg(ttl_ms)
            .arg(millis_ceil(request.fence_ttl))
            // Sent as a decimal string (as every argument is): Lua would format a
            // number this large as a float.
            .arg(request.fence_floor)
            .arg(fence_mode)
            .arg(&request.keys.channel)
            .arg(if sharded { "1" } else { "0" })
            .arg(millis_ceil(HANDOFF_TTL));
        // The waiter's arguments are also what keeps the script off its fast path,
        // which is for callers that do not wait.
        Acquire::Script(match request.waiter {
            Some(waiter) => call
                .arg(&waiter.id)
                .arg(waiter.ticket)
                .arg(millis_ceil(waiter.queue_ttl)),
            None => call,
        })
    }

    /// With `wait`, a grant counts only once enough replicas acknowledged the key and
    /// the counter.
    pub(crate) async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<AcquireReply, CallError> {
        match self {
            Acquire::Plain {
                lock,
                owner,
                ttl_ms,
            } => acquire_plain(conn, lock, owner, *ttl_ms, wait).await,
            Acquire::Pipelined(pipelined) => pipelined.run(conn, wait).await,
            Acquire::Script(call) => {
                let value = call.run(conn, wait, acquire_granted).await?;
                parse_acquire(&value).map_err(CallError::Reply)
            }
        }
    }
}

/// A fenced caller that does not wait, on a standalone server (or a Sentinel's master):
/// the lock's `SET NX PX`, an `EXISTS` of its wait queue and the fence script
/// (`fence.lua`: the counter's rule, `max(counter + 1, floor)`), pipelined. Redis
/// charges a command inside a script far more than the same command sent plainly, and
/// a script per argument (Redis's instructions per acquire + release with the acquire
/// script 95.9k, with this pipeline 79.6k: `benches/server_cost.py`, BENCHMARKS.md).
///
/// The fence script runs whether or not the `SET` took the key: a refused caller moves
/// the counter up, never down, so every later token is still above every earlier one
/// (the counter's guarantee is about order, not about gaps). Where the `SET` took the
/// key while waiters are queued (a holder's key expired before the queue's head
/// retried), the acquire script finishes the call (its `ARGV[12]`): the queue's head
/// comes first, as for any key found free, so no caller barges in.
pub(crate) struct Pipelined {
    /// `SET lock owner NX PX ttl`, `EXISTS queue`, `EVALSHA fence 1 counter floor [ttl]`.
    pipe: redis::Pipeline,
}

impl Pipelined {
    fn new(request: &AcquireRequest<'_>, ttl_ms: u64) -> Self {
        let (lock, owner) = (&request.keys.lock, request.owner.as_str());
        // Each command sized up front (numbers: at most 20 digits), so that building
        // it never reallocates: growing three empty commands cost more than the rest
        // of the call's client work.
        let set = set_nx_px(lock, owner, ttl_ms);
        let mut exists = Cmd::with_capacity(2, lock.len() + QUEUE_SUFFIX.len() + 6);
        exists.arg("EXISTS").arg(Suffixed(lock, QUEUE_SUFFIX));
        let mut fence = Call::with_capacity(&FENCE, 1, 6, request.keys.fence.len() + 96)
            .arg(&request.keys.fence)
            .arg(request.fence_floor);
        if request.fence_ttl != DEFAULT_FENCE_TTL {
            fence = fence.arg(millis_ceil(request.fence_ttl));
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
            if let Some(held) = held_by_another(conn, self.arg(0, 1), self.arg(0, 2)).await? {
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
        let lock = self.arg(0, 1);
        let call = Call::new(&RELEASE, 2)
            .arg(lock)
            .arg(self.arg(1, 1))
            .arg(self.arg(0, 2))
            .arg([lock, CHANNEL_SUFFIX.as_bytes()].concat());
        call.run(conn, None, |_| false).await.map(drop)
    }

    /// The acquire script's call for [`Self::behind_the_queue`]: this call's arguments,
    /// a caller that does not wait, and `ARGV[12]`.
    fn queued_call(&self) -> Call {
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
        parse_acquire(&value).map_err(CallError::Reply)
    }
}

/// `true` when the acquire script's reply says it granted (and so wrote).
fn acquire_granted(value: &Value) -> bool {
    matches!(value, Value::Array(items) if items.first().and_then(int) == Some(1))
}

/// The acquire script's reply: `{1, token}` or `{0, pttl}`.
fn parse_acquire(value: &Value) -> Result<AcquireReply, NodeError> {
    let bad = || NodeError::Protocol(format!("acquire script returned {value:?}").into());
    let Value::Array(items) = value else {
        return Err(bad());
    };
    let [flag, n] = items.as_slice() else {
        return Err(bad());
    };
    match (int(flag), int(n)) {
        (Some(1), Some(token)) => Ok(AcquireReply::Acquired {
            fence: u64::try_from(token).map_err(|_| bad())?,
        }),
        // -1: the key has no ttl; -2: it vanished in between (cannot happen in a script).
        (Some(0), Some(pttl)) => Ok(AcquireReply::Held {
            pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
        }),
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
    let (holder, pttl): (Option<Vec<u8>>, i64) = redis::pipe()
        .cmd("GET")
        .arg(lock)
        .cmd("PTTL")
        .arg(lock)
        .query_async(conn)
        .await?;
    if holder.as_deref() == Some(owner) {
        return Ok(None);
    }
    // -1: the key has no ttl; -2: it vanished in between.
    Ok(Some(AcquireReply::Held {
        pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
    }))
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
        if let Some(held) = held_by_another(conn, lock.as_bytes(), owner.as_bytes()).await? {
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

/// The extend script (compare-and-pexpire). With `wait`, an extension counts only once
/// enough replicas acknowledged it.
pub(crate) async fn extend<C: SendOne>(
    conn: &mut C,
    call: &ExtendCall,
    wait: Option<ReplicaWait>,
) -> Result<bool, CallError> {
    let value = call.0.run(conn, wait, |v| int(v) == Some(1)).await?;
    parse_flag(value).map_err(CallError::Reply)
}

/// The owned arguments of one extend call.
pub(crate) struct ExtendCall(Call);

impl ExtendCall {
    pub(crate) fn new(keys: &LockKeys, owner: &Owner, ttl: Duration) -> Self {
        ExtendCall(
            Call::new(&EXTEND, 1)
                .arg(&keys.lock)
                .arg(owner.as_str())
                .arg(millis_ceil(ttl)),
        )
    }
}

/// The owned arguments of one raise-fence call.
pub(crate) struct RaiseFenceCall(Call);

impl RaiseFenceCall {
    pub(crate) fn new(keys: &LockKeys, token: u64, fence_ttl: Duration) -> Self {
        RaiseFenceCall(
            Call::new(&RAISE_FENCE, 1)
                .arg(&keys.fence)
                .arg(token)
                .arg(millis_ceil(fence_ttl)),
        )
    }
}

/// The raise-fence script. With `wait`, a raised counter counts only once enough
/// replicas acknowledged it.
pub(crate) async fn raise_fence<C: SendOne>(
    conn: &mut C,
    call: &RaiseFenceCall,
    wait: Option<ReplicaWait>,
) -> Result<(), CallError> {
    let value = call.0.run(conn, wait, |v| int(v) == Some(1)).await?;
    int(&value).map(|_| ()).ok_or_else(|| {
        CallError::Reply(NodeError::Protocol(
            format!("raise_fence returned {value:?}").into(),
        ))
    })
}

pub(crate) fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// The reply of the extend, release and raise-fence scripts: 1 or 0.
pub(crate) fn parse_flag(value: Value) -> Result<bool, NodeError> {
    match int(&value) {
        Some(1) => Ok(true),
        Some(0) => Ok(false),
        _ => Err(NodeError::Protocol(
            format!("script returned {value:?}").into(),
        )),
    }
}

mod extend_many;
mod release;
pub(crate) mod set;
#[cfg(test)]
mod tests;

pub(crate) use extend_many::{extend_many, ExtendManyCall};
pub(crate) use release::{listen, release, ListenCall, ReleaseCall};
