//! [`RedisNode`]: one Redis server as a lock node, over redis-rs.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, ErrorKind, IntoConnectionInfo, PushInfo, PushKind, RedisError, Script, Value};
use tokio::sync::{watch, Mutex as AsyncMutex};

use crate::error::{ConfigError, NodeError};
use crate::lock::node::{AcquireReply, AcquireRequest, Node, NodeFuture, Owner, ReleaseSignal};
use crate::lock::options::millis_ceil;
use crate::lock::resource::LockKeys;

static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/acquire.lua")));
static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/extend.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/release.lua")));
static RAISE_FENCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/raise_fence.lua")));

/// One Redis server (standalone master) as a lock node.
///
/// Commands go over one multiplexed connection that reconnects by itself
/// (redis-rs's `ConnectionManager`), shared by every lease and every task: ten
/// thousand leases renew over one connection. Scripts run with `EVALSHA` and are
/// loaded again when the server answers `NOSCRIPT` (after `SCRIPT FLUSH` or a restart).
/// Release notifications arrive over a second, RESP3 connection, opened on first use
/// and shared by every waiter of the process.
///
/// Create it inside a Tokio runtime. It connects lazily, so a locker starts even while
/// a minority of its nodes is down.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redlock::{LockOptions, RedisNode, Redlock};
///
/// let nodes = [
///     RedisNode::open("redis://127.0.0.1:7001/0")?,
///     RedisNode::open("redis://127.0.0.1:7002/0")?,
///     RedisNode::open("redis://127.0.0.1:7003/0")?,
/// ];
/// let locker = Redlock::new(nodes, LockOptions::default())?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisNode {
    inner: Arc<Inner>,
}

struct Inner {
    name: Arc<str>,
    client: Client,
    conn: ConnectionManager,
    subscriber: Mutex<Option<Arc<Subscriber>>>,
}

impl RedisNode {
    /// A node for one Redis URL: `redis://[user:password@]host:port/db`, or
    /// `rediss://…` with the `tls` feature.
    ///
    /// Fails on a malformed URL or outside a Tokio runtime; does not connect yet.
    pub fn open(url: impl IntoConnectionInfo) -> Result<Self, ConfigError> {
        let client =
            Client::open(url).map_err(|e| ConfigError::new(format!("bad Redis URL: {e}")))?;
        Self::from_client(client)
    }

    /// A node over an already configured redis-rs [`Client`].
    pub fn from_client(client: Client) -> Result<Self, ConfigError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ConfigError::new(
                "RedisNode must be created inside a Tokio runtime",
            ));
        }
        let info = client.get_connection_info();
        let name: Arc<str> =
            format!("redis://{}/{}", info.addr(), info.redis_settings().db()).into();
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), connection_config())
            .map_err(|e| ConfigError::new(format!("{name}: {e}")))?;
        Ok(RedisNode {
            inner: Arc::new(Inner {
                name,
                client,
                conn,
                subscriber: Mutex::new(None),
            }),
        })
    }

    fn subscriber(&self) -> Result<Arc<Subscriber>, NodeError> {
        let mut slot = self
            .inner
            .subscriber
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(subscriber) = slot.as_ref() {
            return Ok(subscriber.clone());
        }
        let subscriber = Subscriber::new(&self.inner.client)?;
        *slot = Some(subscriber.clone());
        Ok(subscriber)
    }
}

fn connection_config() -> ConnectionManagerConfig {
    // Reconnect quickly: a restarted node should vote again within milliseconds, and
    // every caller is bounded by the per-node timeout anyway.
    ConnectionManagerConfig::new()
        .set_min_delay(Duration::from_millis(5))
        .set_max_delay(Duration::from_millis(200))
        .set_number_of_retries(2)
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(None)
        .set_pipeline_buffer_size(1024)
}

fn node_error(e: RedisError) -> NodeError {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() {
        NodeError::Connection(e.to_string().into())
    } else if matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension) {
        NodeError::Server(e.to_string().into())
    } else {
        NodeError::Protocol(e.to_string().into())
    }
}

fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn parse_acquire(value: Value) -> Result<AcquireReply, NodeError> {
    let bad = || NodeError::Protocol(format!("acquire script returned {value:?}").into());
    let Value::Array(items) = &value else {
        return Err(bad());
    };
    let [flag, n] = items.as_slice() else {
        return Err(bad());
    };
    match (int(flag), int(n)) {
        (Some(1), Some(fence)) => Ok(AcquireReply::Acquired {
            fence: u64::try_from(fence).map_err(|_| bad())?,
        }),
        (Some(0), Some(pttl)) => Ok(AcquireReply::Held {
            // -1: the key has no ttl; -2: it vanished between the two commands.
            pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
        }),
        _ => Err(bad()),
    }
}

impl Node for RedisNode {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn acquire(&self, request: &AcquireRequest<'_>) -> NodeFuture<AcquireReply> {
        let mut invocation = ACQUIRE.prepare_invoke();
        invocation
            .key(&request.keys.lock)
            .key(&request.keys.fence)
            .arg(request.owner.as_str())
            .arg(millis_ceil(request.ttl))
            .arg(millis_ceil(request.fence_ttl));
        let mut conn = self.inner.conn.clone();
        Box::pin(async move {
            let value: Value = invocation
                .invoke_async(&mut conn)
                .await
                .map_err(node_error)?;
            parse_acquire(value)
        })
    }

    fn extend(&self, keys: &LockKeys, owner: &Owner, ttl: Duration) -> NodeFuture<bool> {
        let mut invocation = EXTEND.prepare_invoke();
        invocation
            .key(&keys.lock)
            .arg(owner.as_str())
            .arg(millis_ceil(ttl));
        let mut conn = self.inner.conn.clone();
        Box::pin(async move {
            let n: i64 = invocation
                .invoke_async(&mut conn)
                .await
                .map_err(node_error)?;
            Ok(n == 1)
        })
    }

    fn release(&self, keys: &LockKeys, owner: &Owner) -> NodeFuture<bool> {
        let mut invocation = RELEASE.prepare_invoke();
        invocation
            .key(&keys.lock)
            .arg(owner.as_str())
            .arg(&keys.channel);
        let mut conn = self.inner.conn.clone();
        Box::pin(async move {
            let n: i64 = invocation
                .invoke_async(&mut conn)
                .await
                .map_err(node_error)?;
            Ok(n == 1)
        })
    }

    fn raise_fence(&self, keys: &LockKeys, token: u64, fence_ttl: Duration) -> NodeFuture<()> {
        let mut invocation = RAISE_FENCE.prepare_invoke();
        invocation
            .key(&keys.fence)
            .arg(token)
            .arg(millis_ceil(fence_ttl));
        let mut conn = self.inner.conn.clone();
        Box::pin(async move {
            let _: i64 = invocation
                .invoke_async(&mut conn)
                .await
                .map_err(node_error)?;
            Ok(())
        })
    }

    fn subscribe(&self, keys: &LockKeys) -> NodeFuture<ReleaseSignal> {
        let channel = keys.channel.clone();
        let subscriber = self.subscriber();
        Box::pin(async move { subscriber?.subscribe(channel).await })
    }
}

impl fmt::Debug for RedisNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RedisNode").field(&self.inner.name).finish()
    }
}

/// The pub/sub side of a node: one RESP3 connection whose pushes are routed to the
/// subscribed channels. Subscriptions are reference-counted per channel.
struct Subscriber {
    conn: ConnectionManager,
    channels: Arc<Mutex<HashMap<String, Weak<Channel>>>>,
    /// Serialises SUBSCRIBE and UNSUBSCRIBE so an UNSUBSCRIBE of a channel's last
    /// subscriber can never overtake the SUBSCRIBE of its next one.
    commands: AsyncMutex<()>,
}

struct Channel {
    name: String,
    tx: watch::Sender<u64>,
    subscriber: Weak<Subscriber>,
}

impl Subscriber {
    fn new(client: &Client) -> Result<Arc<Self>, NodeError> {
        let info = client.get_connection_info().clone();
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        let client = Client::open(info.set_redis_settings(settings)).map_err(node_error)?;
        let channels: Arc<Mutex<HashMap<String, Weak<Channel>>>> = Arc::default();
        let routes = channels.clone();
        let config = connection_config()
            .set_push_sender(move |push: PushInfo| -> Result<(), ()> {
                route_push(&routes, push);
                Ok(())
            })
            .set_automatic_resubscription();
        let conn = ConnectionManager::new_lazy_with_config(client, config).map_err(node_error)?;
        Ok(Arc::new(Subscriber {
            conn,
            channels,
            commands: AsyncMutex::new(()),
        }))
    }

    async fn subscribe(self: Arc<Self>, name: String) -> Result<ReleaseSignal, NodeError> {
        let _serial = self.commands.lock().await;
        let existing = self
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&name)
            .and_then(Weak::upgrade);
        if let Some(channel) = existing {
            return Ok(ReleaseSignal::new(channel.tx.subscribe(), channel));
        }
        let mut conn = self.conn.clone();
        conn.subscribe(&name).await.map_err(node_error)?;
        let (tx, rx) = watch::channel(0);
        let channel = Arc::new(Channel {
            name: name.clone(),
            tx,
            subscriber: Arc::downgrade(&self),
        });
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name, Arc::downgrade(&channel));
        Ok(ReleaseSignal::new(rx, channel))
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        let Some(subscriber) = self.subscriber.upgrade() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let name = std::mem::take(&mut self.name);
        runtime.spawn(async move {
            let _serial = subscriber.commands.lock().await;
            {
                let mut channels = subscriber
                    .channels
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if channels.get(&name).is_some_and(|w| w.strong_count() > 0) {
                    // A new subscriber took the channel over in the meantime.
                    return;
                }
                channels.remove(&name);
            }
            let mut conn = subscriber.conn.clone();
            let _ = conn.unsubscribe(&name).await;
        });
    }
}

fn route_push(channels: &Mutex<HashMap<String, Weak<Channel>>>, push: PushInfo) {
    let channels = channels.lock().unwrap_or_else(|p| p.into_inner());
    match push.kind {
        PushKind::Message => {
            let Some(Value::BulkString(name)) = push.data.first() else {
                return;
            };
            let Ok(name) = std::str::from_utf8(name) else {
                return;
            };
            if let Some(channel) = channels.get(name).and_then(Weak::upgrade) {
                channel.tx.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
        PushKind::Disconnection => {
            // Messages may have been lost while disconnected: wake every waiter to retry.
            for channel in channels.values().filter_map(Weak::upgrade) {
                channel.tx.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_script_replies() {
        let acquired = Value::Array(vec![Value::Int(1), Value::Int(1_873_000_000_000_000)]);
        assert_eq!(
            parse_acquire(acquired).unwrap(),
            AcquireReply::Acquired {
                fence: 1_873_000_000_000_000
            }
        );
        let held = Value::Array(vec![Value::Int(0), Value::Int(1234)]);
        assert_eq!(
            parse_acquire(held).unwrap(),
            AcquireReply::Held {
                pttl: Some(Duration::from_millis(1234))
            }
        );
        let no_ttl = Value::Array(vec![Value::Int(0), Value::Int(-1)]);
        assert_eq!(
            parse_acquire(no_ttl).unwrap(),
            AcquireReply::Held { pttl: None }
        );
        assert!(parse_acquire(Value::Nil).is_err());
        assert!(parse_acquire(Value::Array(vec![Value::Int(2), Value::Int(0)])).is_err());
    }
}
