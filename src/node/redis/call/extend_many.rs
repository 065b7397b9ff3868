//! The batched extend of the Redis nodes ([`Node::extend_many`](crate::node::Node::extend_many)):
//! one extend-many script per chunk of entries, every chunk pipelined on one connection.

use std::time::Duration;

use crate::node::redis::conn::SendOne;
use redis::{ErrorKind, RedisResult, ServerErrorKind, Value};

use super::{check_acks, int, node_error, query, Call, CallError, Op, ReplicaWait, EXTEND_MANY};
use crate::error::NodeError;
use crate::node::redis::millis_ceil;
use crate::node::ExtendEntry;

/// Entries per extend-many script: a script blocks the server while it runs, so a
/// large batch goes out as several scripts, pipelined in one round trip, between
/// which the server serves other clients.
const EXTEND_CHUNK: usize = 256;

/// The owned arguments of one batched extend: one extend-many script per
/// [`EXTEND_CHUNK`] entries.
pub(crate) struct ExtendManyCall {
    /// Each chunk's script call and its number of entries.
    chunks: Vec<(Call, usize)>,
    entries: usize,
}

impl ExtendManyCall {
    pub(crate) fn new(entries: &[ExtendEntry<'_>], ttl: Duration) -> Self {
        let ttl_ms = millis_ceil(ttl);
        let chunks = entries
            .chunks(EXTEND_CHUNK)
            .map(|chunk| {
                let mut call = Call::new(&EXTEND_MANY, chunk.len());
                for entry in chunk {
                    call = call.arg(&entry.keys.lock);
                }
                call = call.arg(ttl_ms);
                for entry in chunk {
                    call = call.arg(entry.owner.as_str());
                }
                (call, chunk.len())
            })
            .collect();
        ExtendManyCall {
            chunks,
            entries: entries.len(),
        }
    }
}

/// The extend-many scripts, pipelined on one connection (one round trip, plus one
/// more for the chunks a server without the script answered `NOSCRIPT` to). With
/// `wait`, the extensions count only once enough replicas acknowledged them; a
/// failed acknowledgement fails the whole batch, as the node's vote is then void.
impl Op for ExtendManyCall {
    type Output = Vec<Result<bool, NodeError>>;

    async fn run<C: SendOne>(
        &self,
        conn: &mut C,
        wait: Option<ReplicaWait>,
    ) -> Result<Vec<Result<bool, NodeError>>, CallError> {
        let call = self;
        extend_many(conn, call, wait).await
    }
}

async fn extend_many<C: SendOne>(
    conn: &mut C,
    call: &ExtendManyCall,
    wait: Option<ReplicaWait>,
) -> Result<Vec<Result<bool, NodeError>>, CallError> {
    let mut values: Vec<Option<RedisResult<Value>>> = Vec::new();
    values.resize_with(call.chunks.len(), || None);
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
            pipe.add_command(call.chunks[i].0.command(by_hash));
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
    let mut answers = Vec::with_capacity(call.entries);
    for (&(_, size), value) in call.chunks.iter().zip(values) {
        match value {
            Some(Ok(Value::Array(flags))) if flags.len() == size => {
                answers.extend(flags.iter().map(|flag| match int(flag) {
                    Some(1) => Ok(true),
                    Some(0) => Ok(false),
                    _ => Err(NodeError::Protocol(
                        format!("extend-many script returned {flag:?}").into(),
                    )),
                }));
            }
            Some(Err(e)) => {
                let error = node_error(e);
                answers.extend(std::iter::repeat_n(Err(error), size));
            }
            other => {
                let error =
                    NodeError::Protocol(format!("extend-many script returned {other:?}").into());
                answers.extend(std::iter::repeat_n(Err(error), size));
            }
        }
    }
    Ok(answers)
}
