//! The command connection of the standalone and Sentinel nodes: redis-rs's
//! `ConnectionManager`, plus one resend when the connection is found broken. The nodes
//! use it through `batching.rs`, which sends concurrent callers' commands together.
//!
//! # Why a resend
//!
//! A `ConnectionManager` learns that its connection died only when it is used: a
//! server restarted while the locker was idle leaves a dead connection behind, the
//! next command fails on it (`broken pipe`), and only then does the manager start a
//! new connection. Without a resend that first command (an acquisition, on every
//! restarted node at once) fails although the servers are up again. So a command
//! that fails because the connection is broken is sent once more, on the new
//! connection; the locker's per-node timeout bounds both sends together.
//!
//! A refused connection is resent too: the manager hands the next caller the cached
//! outcome of its last connection attempt (possibly made while the server was still
//! down) and only then starts a new attempt, so a refusal may be stale.
//!
//! # Why resending is safe
//!
//! A broken connection does not say whether the server ran the command before the
//! connection died, so a resend may run it twice. Every command sent over this
//! connection tolerates that, because each checks the owner value that only this
//! acquisition knows:
//!
//! * **acquire** (`SET key owner NX PX` pipelined with the fence script, or the
//!   acquire script doing both; one `SET NX PX` without fencing): a second run finds
//!   the key holding its own owner value, which is the same grant, not a second one
//!   (see `acquire_fast.lua` and `Acquire::Pipelined`): nobody else can have been
//!   granted the key in between, since it held our value all along. The extra counter
//!   step only makes later tokens larger, which fencing allows.
//! * **extend** (compare-and-`PEXPIRE`) and **raise fence** (`if cur < t then set t`)
//!   reach the same state however often they run. A second extend counts the ttl from
//!   a later moment, so the key lives a little longer than the validity the locker
//!   computed from the round's start: the safe direction.
//! * **release** (compare-and-delete) and **record discard** (compare-and-delete of our
//!   token's marker): a second run finds nothing left and answers "not deleted"; the
//!   effect is the same, only the answer understates it.
//! * **record claim**: a second run finds our own pending marker and answers "claimed"
//!   again. **record store**: a second run finds the very record it stored (same
//!   token, fingerprint and data) and answers "stored" again; any other record with
//!   an equal or larger token still answers "superseded".
//! * reads (`GET`, `PTTL`, `HMGET`) have no effect.
//!
//! Anything that is not a broken connection (a server error, a timeout, failed
//! authentication) is not resent: the server may still be busy with the first send,
//! or will refuse the second one alike.

use std::future::Future;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

/// A node's command connection: multiplexed, cheap to clone, re-established when found
/// broken, and resending once a command that failed on a broken connection (see the
/// module docs for why that is safe for every command the nodes send).
#[derive(Clone)]
pub(crate) struct Resending(ConnectionManager);

impl Resending {
    pub(crate) fn new(conn: ConnectionManager) -> Self {
        Resending(conn)
    }
}

/// The connection was found broken or could not be made: the manager has started a
/// new connection, which a resend waits for.
fn found_broken(e: &RedisError) -> bool {
    // `is_connection_dropped` covers a reset, aborted or closed connection and a
    // refusal; a timeout is not one of them.
    e.is_connection_dropped() && !e.is_timeout()
}

impl Resending {
    /// Sends `cmd`, and once more if the connection was found broken.
    pub(crate) async fn send(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        match self.0.send_packed_command(cmd).await {
            Err(e) if found_broken(&e) => {
                tracing::debug!(error = %e, "connection found broken: sending again");
                self.0.send_packed_command(cmd).await
            }
            other => other,
        }
    }

    /// Sends `count` commands of `pipeline` from `offset`, and once more if the
    /// connection was found broken.
    pub(crate) async fn send_many(
        &mut self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self.0.send_packed_commands(pipeline, offset, count).await {
            Err(e) if found_broken(&e) => {
                tracing::debug!(error = %e, "connection found broken: sending again");
                self.0.send_packed_commands(pipeline, offset, count).await
            }
            other => other,
        }
    }
}

/// A connection that sends one command, or one pipeline, as `query_async` does,
/// without boxing the call where the connection allows it: `ConnectionLike` boxes
/// every call, and every lock call is one command or one pipeline.
pub(crate) trait SendOne: ConnectionLike + Send {
    /// The reply to `cmd`, as a `Value` (the reply's errors become the `Err`).
    fn send_one<'a>(
        &'a mut self,
        cmd: &'a Cmd,
    ) -> impl Future<Output = RedisResult<Value>> + Send + 'a;

    /// The replies to every command of `pipe`, which ignores errors (`ignore_errors`)
    /// and no command of which is ignored: one result per command, a server error as
    /// its `Err`, as `query_async::<Vec<RedisResult<Value>>>` gives them.
    fn send_pipeline<'a>(
        &'a mut self,
        pipe: &'a Pipeline,
    ) -> impl Future<Output = RedisResult<Vec<RedisResult<Value>>>> + Send + 'a;
}

impl SendOne for Resending {
    async fn send_one(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        self.send(cmd).await?.extract_error()
    }

    async fn send_pipeline(&mut self, pipe: &Pipeline) -> RedisResult<Vec<RedisResult<Value>>> {
        Ok(one_result_each(self.send_many(pipe, 0, pipe.len()).await?))
    }
}

/// A pipeline's replies as `send_pipeline` gives them: a server error as its `Err`.
pub(crate) fn one_result_each(replies: Vec<Value>) -> Vec<RedisResult<Value>> {
    replies
        .into_iter()
        .map(|reply| match reply {
            Value::ServerError(error) => Err(error.into()),
            reply => Ok(reply),
        })
        .collect()
}

impl SendOne for ClusterConnection {
    fn send_one<'a>(
        &'a mut self,
        cmd: &'a Cmd,
    ) -> impl Future<Output = RedisResult<Value>> + Send + 'a {
        cmd.query_async(self)
    }

    fn send_pipeline<'a>(
        &'a mut self,
        pipe: &'a Pipeline,
    ) -> impl Future<Output = RedisResult<Vec<RedisResult<Value>>>> + Send + 'a {
        pipe.query_async(self)
    }
}

impl ConnectionLike for Resending {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.send(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(self.send_many(pipeline, offset, count))
    }

    fn get_db(&self) -> i64 {
        self.0.get_db()
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[test]
    fn only_broken_connections_are_resent() {
        for kind in [
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::ConnectionAborted,
            io::ErrorKind::ConnectionRefused,
            io::ErrorKind::UnexpectedEof,
        ] {
            assert!(
                found_broken(&RedisError::from(io::Error::from(kind))),
                "{kind:?}"
            );
        }
        assert!(!found_broken(&RedisError::from(io::Error::from(
            io::ErrorKind::TimedOut
        ))));
        let oom = RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "OOM command not allowed",
        ));
        assert!(!found_broken(&oom));
        let auth = RedisError::from((redis::ErrorKind::AuthenticationFailed, "WRONGPASS"));
        assert!(!found_broken(&auth));
    }
}
