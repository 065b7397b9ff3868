//! [`EtcdNode`]: one etcd cluster as a lock node, with fencing tokens that need no clock.

mod calls;
mod stored;

use calls::*;
use stored::Stored;

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
    WatchFilterType, WatchOptions,
};
use tokio::sync::{watch, OnceCell};

use crate::error::{ConfigError, NodeError};
use crate::node::percent::percent_decode;
use crate::node::FencingToken;
use crate::node::ResourceKeys;
use crate::node::{Acquire, Hold, Node, NodeFuture, Owner, PerKey, Release, ReleaseSignal, Vote};
use crate::node::{ClaimReply, ClaimRequest, Record, RecordStore, StoreReply, StoreRequest};

/// How often a record operation re-reads after another writer changed the record key
/// between its read and its transaction, before it gives up.
const RECORD_ATTEMPTS: usize = 16;

/// An etcd cluster as one lock node (feature `etcd`): fencing tokens that need no clock.
///
/// The token is the lock key's create revision: one counter for the whole cluster,
/// advanced by raft and persisted before a write is acknowledged, so tokens increase
/// strictly without a clock, a counter ttl or a write-back. Leases are timed by the
/// leader alone. The cluster's quorum is a single vote here: a locker with an etcd node
/// must have no other node (such a locker is refused with a [`ConfigError`]). What this
/// buys over Redis, and what it cannot (a paused holder), is in the
/// [stores guide](crate::guide::stores).
///
/// # Mapping onto [`Node`]
///
/// | operation | etcd |
/// |---|---|
/// | acquire | grant a lease (ttl in whole seconds), then one transaction: `if create_revision(key) == 0 then put(key, owner, lease) else get(key)`; on success the token is the transaction's revision; when held, the holder's lease's remaining ttl |
/// | extend | `if value(key) == owner then get(key)`, then one keep-alive of the key's lease; never re-creates a key |
/// | release | `if value(key) == owner then get(key), delete(key)`, then revoke the lease |
/// | raise the fence | nothing to do: the revision is the token |
/// | the clock floor ([`Acquire::fence_floor`](crate::node::Acquire::fence_floor)) | ignored: a revision never comes back behind, and a floor would tie the token to a clock again |
/// | wake-up | a watch on the key's deletions (a release, or the lease's expiry) |
/// | outcome records | a key per resource holding an encoded record, attached to a lease of its own (the record's ttl), written in transactions that compare the lock key's value with the owner and the record key's mod revision with what was read |
///
/// A transaction whose comparison fails is an answer (held, not the owner); a call
/// that fails or times out is a [`NodeError`]: held and unavailable stay apart as for
/// Redis.
///
/// # Ttl
///
/// etcd leases count whole seconds and etcd raises a ttl below its minimum (one and a
/// half election timeouts, 1.5 s with the default configuration) silently. A locker
/// with an etcd node therefore refuses, when it is built, a lease ttl that is not a
/// whole number of seconds or is shorter than [`EtcdNode::MIN_TTL`]. Record ttls are
/// rounded up to whole seconds.
///
/// # Node timeout
///
/// Every write is a raft commit: an fsync on a majority of members. The locker's
/// default [`node_timeout`](crate::LockOptions::node_timeout) of 200 ms, chosen for
/// Redis, may be short for that on ordinary disks; give etcd a few hundred milliseconds.
///
/// # Example
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_redlock::{EtcdNode, LockOptions, Redlock};
///
/// let node = EtcdNode::new(["127.0.0.1:2379", "127.0.0.1:22379"], "locks/")?;
/// assert_eq!(node.name(), "etcd://127.0.0.1:2379,127.0.0.1:22379/locks/");
/// let locker = Redlock::new(
///     [node],
///     LockOptions::default()
///         .ttl(Duration::from_secs(10))
///         .node_timeout(Duration::from_millis(500)),
/// )?;
/// # let _ = locker;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EtcdNode {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    endpoints: Vec<String>,
    prefix: Vec<u8>,
    user: Option<(String, String)>,
    /// One client per member, connected on first use.
    clients: Vec<OnceCell<Client>>,
    /// The member calls go to, until one fails (see [`pinned!`]).
    current: AtomicUsize,
}

impl Inner {
    fn build(
        name: String,
        endpoints: Vec<String>,
        prefix: Vec<u8>,
        user: Option<(String, String)>,
    ) -> Self {
        Inner {
            name,
            clients: endpoints.iter().map(|_| OnceCell::new()).collect(),
            endpoints,
            prefix,
            user,
            current: AtomicUsize::new(0),
        }
    }
}

/// Runs one node operation, `call(cloned…; copied…)` of the node's `Inner` (each
/// attempt given its own clones), in a boxed future on the pinned member, moving on to the next member when it
/// cannot be reached (at most once round all members).
///
/// etcd-client balances over all endpoints but keeps sending to a member that is down
/// (each call fails with a connection error), so the node pins one member, as etcd's
/// own Go client does, and moves on when that member fails. A call that was dropped
/// unanswered (the locker's timeout) moves on too: a paused or partitioned member must
/// not hold every later call. Re-running an operation is safe: each one is written so
/// that running it twice answers as running it once (an acquire that finds its own
/// owner value in the key reports it acquired).
macro_rules! pinned {
    ($node:expr, $call:ident($($cloned:ident),*; $($copied:ident),*)) => {{
        let inner = $node.inner.clone();
        Box::pin(async move {
            let inner: &Inner = &inner;
            let mut last = None;
            for _ in 0..inner.endpoints.len() {
                let (index, client) = inner.pinned().await?;
                let guard = MoveOnFailure {
                    inner,
                    index,
                    armed: true,
                };
                match inner.$call(client, $($cloned.clone(),)* $($copied),*).await {
                    Err(e @ NodeError::Connection(_)) => {
                        drop(guard);
                        last = Some(e);
                    }
                    answer => {
                        guard.disarm();
                        return answer;
                    }
                }
            }
            Err(last.unwrap_or_else(|| NodeError::Connection("no etcd endpoint".into())))
        })
    }};
}

// After `pinned!`, which its calls use.
mod node;

/// Moves the node's pinned member past `index` when dropped armed.
struct MoveOnFailure<'a> {
    inner: &'a Inner,
    index: usize,
    armed: bool,
}

impl MoveOnFailure<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for MoveOnFailure<'_> {
    fn drop(&mut self) {
        if self.armed {
            let next = (self.index + 1) % self.inner.endpoints.len();
            // Only if no other call moved it already.
            let _ = self.inner.current.compare_exchange(
                self.index,
                next,
                AtomicOrdering::Relaxed,
                AtomicOrdering::Relaxed,
            );
        }
    }
}

impl EtcdNode {
    /// The shortest lease ttl a locker with an etcd node accepts: etcd raises shorter
    /// lease ttls to one and a half election timeouts (1.5 s by default), rounded up.
    pub const MIN_TTL: Duration = Duration::from_secs(2);

    /// A node over the cluster reachable at `endpoints` (`host:port` or
    /// `http://host:port`, one or more members), every key prefixed with `prefix`.
    /// Never connects: the client connects on first use.
    pub fn new<E: AsRef<str>>(
        endpoints: impl IntoIterator<Item = E>,
        prefix: impl Into<String>,
    ) -> Result<Self, ConfigError> {
        let endpoints: Vec<String> = endpoints
            .into_iter()
            .map(|e| e.as_ref().trim().to_owned())
            .collect();
        if endpoints.is_empty() || endpoints.iter().any(String::is_empty) {
            return Err(ConfigError::new(
                "an etcd node needs at least one endpoint host:port",
            ));
        }
        let mut hosts = Vec::with_capacity(endpoints.len());
        for endpoint in &endpoints {
            let host = endpoint.strip_prefix("http://").unwrap_or(endpoint);
            if host.starts_with("https://") {
                return Err(ConfigError::new(
                    "etcd over TLS is not supported by this crate's etcd feature yet",
                ));
            }
            let valid = host.rsplit_once(':').is_some_and(|(h, port)| {
                !h.is_empty() && !h.contains('/') && port.parse::<u16>().is_ok()
            });
            if !valid {
                return Err(ConfigError::new(format!(
                    "bad etcd endpoint `{endpoint}`: expected host:port"
                )));
            }
            hosts.push(host.to_owned());
        }
        let prefix = prefix.into();
        Ok(EtcdNode {
            inner: Arc::new(Inner::build(
                format!("etcd://{}/{prefix}", hosts.join(",")),
                hosts.iter().map(|h| format!("http://{h}")).collect(),
                prefix.into_bytes(),
                None,
            )),
        })
    }

    /// A node from a URL `etcd://[user:password@]host1:port1,host2:port2[/prefix]`.
    /// A non-empty prefix gets a trailing `/` (`etcd://h:2379/locks` keeps its keys
    /// under `locks/`). Credentials are percent-encoded and never appear in the name.
    pub fn from_url(url: &str) -> Result<Self, ConfigError> {
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| ConfigError::new("an etcd node URL starts with etcd://"))?;
        if rest.contains(['?', '#']) {
            return Err(ConfigError::new(
                "an etcd URL takes no query or fragment: etcd://host1:port1,host2:port2/prefix",
            ));
        }
        let (authority, path) = match rest.split_once('/') {
            Some((authority, path)) => (authority, path),
            None => (rest, ""),
        };
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => {
                let (name, password) = userinfo.split_once(':').ok_or_else(|| {
                    ConfigError::new("etcd credentials are written user:password@")
                })?;
                (
                    Some((percent_decode(name)?, percent_decode(password)?)),
                    hosts,
                )
            }
            None => (None, authority),
        };
        let mut prefix = percent_decode(path)?;
        if !prefix.is_empty() && !prefix.ends_with('/') {
            prefix.push('/');
        }
        let mut node = Self::new(hosts.split(','), prefix)?;
        if let Some(user) = user {
            node = node.with_user(user.0, user.1);
        }
        Ok(node)
    }

    /// This node authenticating as `user` (etcd's own users and roles).
    #[must_use]
    pub fn with_user(self, user: impl Into<String>, password: impl Into<String>) -> Self {
        let inner = &self.inner;
        EtcdNode {
            inner: Arc::new(Inner::build(
                inner.name.clone(),
                inner.endpoints.clone(),
                inner.prefix.clone(),
                Some((user.into(), password.into())),
            )),
        }
    }

    /// The node's name, `etcd://host1:port1,host2:port2/prefix`, without credentials.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Checks that a locker's ttl and node count suit an etcd node (see the type's
    /// documentation).
    pub(crate) fn check(ttl: Duration, nodes: usize) -> Result<(), ConfigError> {
        if nodes > 1 {
            return Err(ConfigError::new(
                "an etcd node must be the locker's only node: etcd is a quorum already, and \
                 its revisions cannot be combined with other nodes' fence counters",
            ));
        }
        if ttl.subsec_nanos() != 0 {
            return Err(ConfigError::new(format!(
                "etcd leases count whole seconds: a ttl of {ttl:?} would live {}s; give a whole \
                 number of seconds",
                whole_seconds(ttl)
            )));
        }
        if ttl < Self::MIN_TTL {
            return Err(ConfigError::new(format!(
                "a ttl of {ttl:?} is below etcd's minimum lease ttl; use at least {:?}",
                Self::MIN_TTL
            )));
        }
        Ok(())
    }
}

impl std::fmt::Debug for EtcdNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdNode")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let node =
            EtcdNode::from_url("etcd://u:p%40ss@127.0.0.1:2379,127.0.0.1:22379/app").unwrap();
        assert_eq!(node.name(), "etcd://127.0.0.1:2379,127.0.0.1:22379/app/");
        assert_eq!(node.inner.prefix, b"app/");
        assert_eq!(node.inner.user, Some(("u".to_owned(), "p@ss".to_owned())));
        assert_eq!(EtcdNode::from_url("etcd://h:1").unwrap().inner.prefix, b"");
        for (url, says) in [
            ("etcd://", "endpoint"),
            ("etcd://h", "host:port"),
            ("etcd://h:1,,h:2", "endpoint"),
            ("etcd://h:x", "host:port"),
            ("etcd://h:1?x=1", "no query"),
            ("etcd://user@h:1", "user:password"),
            ("redis://h:1", "etcd://"),
        ] {
            let err = EtcdNode::from_url(url)
                .map(|_| ())
                .expect_err(url)
                .to_string();
            assert!(err.contains(says), "{url}: {err}");
        }
    }
}
