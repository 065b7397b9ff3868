//! The acquire calls that need no script for one exclusive resource: the plain
//! `SET NX PX` without fencing, and the pipelined fenced acquire of a standalone server.

use super::acquire::acquire_script;
use super::*;
use crate::node::{Acquire as Request, PerKey, Vote};

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
    pub(super) fn new(acq: &Request<'_>, keys: &ResourceKeys, ttl_ms: u64) -> Self {
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
            .add_command(fence.evalsha)
            .ignore_errors();
        Pipelined { pipe }
    }

    /// Argument `index` of command `command` of the pipeline.
    fn arg(&self, command: usize, index: usize) -> &[u8] {
        self.pipe
            .cmd_iter()
            .nth(command)
            .map_or(&[], |cmd| arg(cmd, index))
    }

    pub(super) async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<Vote, CallError> {
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
                Box::pin(once(conn, &call.eval(), wait, |_| true)).await
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
        Ok(Vote::Granted {
            fences: PerKey::one(token),
        })
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

    /// The `SET` took a free key while waiters are queued: the acquire script decides
    /// (the queue's head first), with this call's arguments, as a caller that does not
    /// wait, and `ARGV[12]`.
    async fn behind_the_queue<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<Vote, CallError> {
        let lock = self.arg(0, 1);
        // The fence script's ttl, left out when it is the default.
        let default_fence_ttl = millis_ceil(DEFAULT_FENCE_TTL).to_string();
        let fence_ttl = match self.arg(2, 5) {
            [] => default_fence_ttl.as_bytes(),
            sent => sent,
        };
        let call = Call::new(&ACQUIRE, 3)
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
            .arg("1");
        acquire_script(call).run(conn, wait).await
    }
}

/// After a `SET NX` that did not set: `Held` when another owner has the key, `None`
/// when it is ours (the resend of a call whose first send landed).
async fn held_by_another<C: SendOne>(
    conn: &mut C,
    lock: &[u8],
    owner: &[u8],
) -> Result<Option<Vote>, CallError> {
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
        Ok(Value::BulkString(value)) if value.as_slice() == owner => return Ok(None),
        Ok(_) => {}
        // A GET refused (WRONGTYPE): shared holders keep a sorted set at the key (see
        // `node::modes`), which is another holder; any other type's error is the answer.
        // The key may have changed since (the holders gone, a writer in): a string or no
        // key reads as held too, and the caller tries again.
        Err(error) => {
            let kind = conn.send_one(redis::cmd("TYPE").arg(lock)).await?;
            let kind: String = redis::from_redis_value(kind).map_err(RedisError::from)?;
            if !matches!(kind.as_str(), "zset" | "string" | "none") {
                return Err(error.into());
            }
        }
    }
    // The holder's ttl as `PTTL` answered it (-1: the key has no ttl; -2: it vanished
    // in between).
    Ok(Some(Vote::Held {
        member: 0,
        pttl: super::pttl(&pttl?),
    }))
}

/// Argument `index` of `cmd`.
fn arg(cmd: &Cmd, index: usize) -> &[u8] {
    match cmd.args_iter().nth(index) {
        Some(redis::Arg::Simple(bytes)) => bytes,
        _ => &[],
    }
}

/// `SET lock owner NX PX ttl`, sized up front (numbers: at most 20 digits) so that
/// building it never reallocates.
pub(super) fn set_nx_px(lock: &str, owner: &str, ttl_ms: u64) -> Cmd {
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
pub(super) async fn acquire_plain<C: SendOne>(
    conn: &mut C,
    set: &Cmd,
    wait: Option<ReplicaWait>,
) -> Result<Vote, CallError> {
    let (lock, owner) = (arg(set, 1), arg(set, 2));
    // Replicas acknowledge only a SET that took the key.
    let set = once(conn, set, wait, |set| !matches!(set, Value::Nil)).await?;
    if matches!(set, Value::Nil) {
        // Boxed, as in `Pipelined::run`.
        let held = Box::pin(held_by_another(conn, lock, owner));
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
    Ok(Vote::Granted {
        fences: PerKey::one(0),
    })
}
