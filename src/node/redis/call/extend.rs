//! The extend call of the Redis nodes: compare-and-pexpire of one hold or many (each
//! with its owner, exclusive or shared alike), one extend script per chunk of holds,
//! every chunk pipelined on one connection.

use std::time::Duration;

use crate::node::redis::conn::SendOne;
use redis::{ErrorKind, RedisResult, ServerErrorKind, Value};

use super::{check_acks, int, node_error, query, Call, CallError, Op, ReplicaWait, EXTEND};
use crate::error::NodeError;
use crate::node::redis::millis_ceil;
use crate::node::{Owner, ResourceKeys};

/// Holds per extend script: a script blocks the server while it runs, so a large batch
/// goes out as several scripts, pipelined in one round trip, between which the server
/// serves other clients.
const EXTEND_CHUNK: usize = 256;

/// The owned arguments of one extend: one extend script per [`EXTEND_CHUNK`] holds.
pub(crate) struct ExtendCall {
    /// Each chunk's script call and its number of holds.
    pub(super) chunks: Vec<(Call, usize)>,
}

impl ExtendCall {
    /// Extends each `(keys, owner)` hold by `ttl`; `shared`: the holds are shared
    /// holders (an exclusive extend never touches those, nor a shared one a lock key).
    pub(crate) fn new<'a>(
        holds: impl IntoIterator<Item = (&'a ResourceKeys, &'a Owner)>,
        ttl: Duration,
        shared: bool,
    ) -> Self {
        let ttl_ms = millis_ceil(ttl);
        let holds: Vec<_> = holds.into_iter().collect();
        let chunks = holds
            .chunks(EXTEND_CHUNK)
            .map(|chunk| {
                let mut call = Call::new(&EXTEND, chunk.len());
                for (keys, _) in chunk {
                    call = call.arg(&keys.lock);
                }
                call = call.arg(ttl_ms);
                for (_, owner) in chunk {
                    call = call.arg(owner.as_str());
                }
                if shared {
                    call = call.arg("1");
                }
                (call, chunk.len())
            })
            .collect();
        ExtendCall { chunks }
    }
}

/// The extend scripts, pipelined on one connection (one round trip, plus one more for
/// the chunks a server without the script answered `NOSCRIPT` to). Answers per hold,
/// in order. With `wait`, the extensions count only once enough replicas acknowledged
/// them; a failed acknowledgement fails the whole call, as the node's vote is then void.
impl Op for ExtendCall {
    type Output = Vec<Result<bool, NodeError>>;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<Vec<Result<bool, NodeError>>, CallError> {
        if let [(call, _)] = self.chunks.as_slice() {
            // One script, no pipeline: what nearly every extend is.
            let wrote = |value: &Value| matches!(value, Value::Array(flags) if flags.iter().any(|f| int(f) == Some(1)));
            let value = call.run(conn, wait, wrote).await?;
            return Ok(answers(self, vec![Some(Ok(value))]));
        }
        extend_many(conn, self, wait).await
    }
}

async fn extend_many<C: SendOne>(
    conn: &mut C,
    call: &ExtendCall,
    wait: Option<ReplicaWait>,
) -> Result<Vec<Result<bool, NodeError>>, CallError> {
    let mut values: Vec<Option<RedisResult<Value>>> = vec![None; call.chunks.len()];
    for by_hash in [true, false] {
        let pending: Vec<usize> = (0..call.chunks.len())
            .filter(|&i| match &values[i] {
                None => true,
                Some(Err(e)) => e.kind() == ErrorKind::Server(ServerErrorKind::NoScript),
                Some(Ok(_)) => false,
            })
            .collect();
        if pending.is_empty() {
            break;
        }
        let mut pipe = redis::pipe();
        for &i in &pending {
            let chunk = &call.chunks[i].0;
            pipe.add_command(if by_hash {
                chunk.evalsha.clone()
            } else {
                chunk.eval()
            });
        }
        let mut replies = query(conn, pipe, pending.len(), wait).await?;
        let acks = wait.and_then(|_| replies.pop());
        let mut wrote_now = false;
        for (&i, reply) in pending.iter().zip(replies) {
            if let Ok(Value::Array(flags)) = &reply {
                wrote_now |= flags.iter().any(|flag| int(flag) == Some(1));
            }
            values[i] = Some(reply);
        }
        if wrote_now {
            check_acks(acks, wait)?;
        }
    }
    Ok(answers(call, values))
}

/// Each hold's answer, from each chunk's reply.
fn answers(
    call: &ExtendCall,
    values: Vec<Option<RedisResult<Value>>>,
) -> Vec<Result<bool, NodeError>> {
    let mut answers = Vec::with_capacity(call.chunks.iter().map(|(_, size)| size).sum());
    for (&(_, size), value) in call.chunks.iter().zip(values) {
        let error = match value {
            Some(Ok(Value::Array(flags))) if flags.len() == size => {
                answers.extend(flags.iter().map(|flag| match int(flag) {
                    Some(1) => Ok(true),
                    Some(0) => Ok(false),
                    _ => Err(NodeError::Protocol(
                        format!("extend script returned {flag:?}").into(),
                    )),
                }));
                continue;
            }
            Some(Err(e)) => node_error(e),
            other => NodeError::Protocol(format!("extend script returned {other:?}").into()),
        };
        answers.extend(std::iter::repeat_n(Err(error), size));
    }
    answers
}
