//! The lock engine: Redlock over N independent nodes. It knows nothing of HTTP.
//!
//! An acquire draws a fresh owner value ([`Owner::for_node`]), sends the acquire to
//! **all nodes at once** (each call bounded by the node timeout, the round decided as
//! soon as its outcome is), and succeeds iff a majority granted it with more than
//! [`LockOptions::min_validity`] left of `ttl − elapsed − drift`; the fencing token is
//! made from the nodes' counters ([`fencing`]). A failed attempt is released in the
//! background on every node that may hold its key, also those that did not answer in
//! time: their `SET` may have landed.

mod acquire;
mod attempt;
mod background;
mod counters;
mod drain;
mod error;
pub mod fencing;
mod health;
mod lease;
pub mod metrics;
mod options;
mod quorum;
pub mod record;
mod renewal;
mod round;
mod set;
mod setup;
mod target;
mod wait;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::ConfigError;
use crate::node::identity;
use round::Nodes;
use target::Target;
use wait::Queues;

pub use crate::node::mode::LockMode;
pub(crate) use counters::Metrics;
pub use counters::MetricsSnapshot;
pub use drain::Drained;
pub use error::LockError;
pub use health::{NodeState, NodeStatus};
pub use lease::{Lease, LeaseHandle, LostCause, ReleaseOutcome};
pub use options::{Backoff, LockOptions, RetryPolicy};
pub use set::MAX_RESOURCES_PER_LEASE;

use crate::node::{url::node_from_url, MemoryNode, Node, Owner, Resource};

/// A Redlock over one or more independent nodes.
///
/// With one node it is the single-instance lock; with `N` nodes a lease needs a
/// majority (`N/2 + 1`), so it survives `(N−1)/2` nodes down. Cheap to clone: clones
/// share nodes, connections and local queues.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_redlock::{LockError, LockOptions, MemoryNode, Redlock};
///
/// let locker = Redlock::new(
///     [MemoryNode::new(), MemoryNode::new(), MemoryNode::new()],
///     LockOptions::default().ttl(Duration::from_secs(5)),
/// )?;
///
/// let lease = locker.try_acquire("order:42").await?;
/// match locker.try_acquire("order:42").await {
///     Err(LockError::Held { holder_ttl, .. }) => assert!(holder_ttl.is_some()),
///     other => panic!("expected contention, got {other:?}"),
/// }
/// let token = lease.fencing_token();
/// lease.release().await;
///
/// let next = locker.acquire("order:42", Duration::from_secs(1)).await?;
/// assert!(next.fencing_token() > token);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Redlock {
    shared: Arc<Shared>,
    max_waiters: usize,
}

pub(crate) struct Shared {
    pub(crate) nodes: Nodes,
    pub(crate) options: LockOptions,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) metrics: Metrics,
    pub(crate) quorum: health::QuorumWatch,
    pub(crate) renewals: renewal::Renewals,
    queues: Arc<Queues>,
    /// This locker's id in the nodes' wait queues (see `wait`).
    pub(crate) waiter_id: String,
    /// Set by [`Redlock::drain`]: no new lease.
    draining: std::sync::atomic::AtomicBool,
    /// Told when a drain begins: the waiting callers end.
    drain_began: tokio::sync::Notify,
}

impl Redlock {
    /// A locker over `nodes` of one kind. See [`from_nodes`](Redlock::from_nodes) to mix kinds.
    ///
    /// Fails when the options cannot work (see [`LockOptions`]), the list is empty, or
    /// no Tokio runtime is running.
    pub fn new<N: Node>(
        nodes: impl IntoIterator<Item = N>,
        options: LockOptions,
    ) -> Result<Self, ConfigError> {
        let nodes = nodes
            .into_iter()
            .map(|node| Arc::new(node) as Arc<dyn Node>)
            .collect();
        Self::from_nodes(nodes, options)
    }

    /// A locker over nodes of any kind.
    ///
    /// Refuses two nodes with the same address (see [`Node::address`]): one server must
    /// cast one vote. It does not connect, so it cannot tell one server reached under two
    /// names; [`connect`](Redlock::connect) can. Either way, a server listed twice never
    /// votes twice: every node gets its own owner value ([`Owner::for_node`]), so the
    /// second `SET NX` on that server finds the first one's key and counts as held.
    pub fn from_nodes(
        nodes: Vec<Arc<dyn Node>>,
        options: LockOptions,
    ) -> Result<Self, ConfigError> {
        options.validate()?;
        if nodes.is_empty() {
            return Err(ConfigError::new("a locker needs at least one node"));
        }
        if nodes.len() > Owner::MAX_NODES {
            return Err(ConfigError::new(format!(
                "a locker takes at most {} nodes, got {}",
                Owner::MAX_NODES,
                nodes.len()
            )));
        }
        identity::check_addresses(&nodes)?;
        for node in &nodes {
            node.check_locker(options.get_ttl(), nodes.len())?;
        }
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| ConfigError::new("a locker must be created inside a Tokio runtime"))?;
        metrics::engine_series(nodes.iter().map(|node| node.name()));
        Ok(Redlock {
            max_waiters: options.max_waiters,
            shared: Arc::new(Shared {
                nodes: Nodes::new(nodes, options.node_timeout),
                options,
                runtime,
                metrics: Metrics::default(),
                quorum: health::QuorumWatch::default(),
                renewals: renewal::Renewals::default(),
                queues: Arc::default(),
                waiter_id: format!("{:016x}", rand::random::<u64>()),
                draining: std::sync::atomic::AtomicBool::new(false),
                drain_began: tokio::sync::Notify::new(),
            }),
        })
    }

    /// A locker over one fresh [`MemoryNode`] with default options: the embedded
    /// default for examples, tests and single-process services.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    pub fn in_memory() -> Self {
        Self::new([MemoryNode::new()], LockOptions::default()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A locker over one node per URL, without connecting: like
    /// [`connect`](Redlock::connect) minus its check of the servers' identities, for
    /// code that cannot await (one server under two names is then not refused, and
    /// still never votes twice). Refuses the same address twice.
    pub fn from_urls<U: AsRef<str>>(
        urls: impl IntoIterator<Item = U>,
        options: LockOptions,
    ) -> Result<Self, ConfigError> {
        let nodes = urls
            .into_iter()
            .map(|url| node_from_url(url.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Self::from_nodes(nodes, options)
    }

    /// A locker over one node per URL: a standalone server, a Redis Cluster or a
    /// Sentinel-managed master, each one vote (see [`node_from_url`] for the forms).
    ///
    /// One server must cast one vote. The same address twice (however written) is
    /// refused before connecting; then every node is asked for its servers' identities
    /// ([`Node::server_ids`]), each within `max(node_timeout, 2 s)`, and two nodes
    /// reaching the same server are refused with a [`ConfigError`] naming both. A node
    /// that does not answer in time is not checked, so the locker still starts with a
    /// minority down (a server listed twice still never votes twice, see
    /// [`from_nodes`](Redlock::from_nodes)).
    ///
    /// Each node's servers are also asked about their setup ([`Node::server_setup`]):
    /// a replica or standby, an evicting `maxmemory-policy` (unless
    /// [`LockOptions::accept_evicting_nodes`]), a user refused the scripts or the keys,
    /// or a missing command is refused with a [`ConfigError`] saying what to change
    /// (the list, and why: [the operations guide](crate::guide::operations)). The
    /// locker checks again every
    /// [`setup_check_interval`](LockOptions::setup_check_interval) and logs a change
    /// (see [`NodeState::setup_warning`]).
    pub async fn connect<U: AsRef<str>>(
        urls: impl IntoIterator<Item = U>,
        options: LockOptions,
    ) -> Result<Self, ConfigError> {
        let timeout = options.node_timeout.max(Duration::from_secs(2));
        let locker = Self::from_urls(urls, options)?;
        if locker.shared.nodes.len() > 1 {
            let nodes: Vec<Arc<dyn Node>> = locker.shared.nodes.each().cloned().collect();
            identity::check_servers(&nodes, timeout).await?;
        }
        setup::check(&locker.shared, timeout).await?;
        setup::spawn_periodic(&locker.shared, timeout);
        Ok(locker)
    }

    /// This locker with another bound on the callers of this process that may wait for
    /// one resource at once (see [`LockOptions::max_waiters`]). Shares everything else.
    pub fn with_max_waiters(&self, max: usize) -> Self {
        Redlock {
            shared: self.shared.clone(),
            max_waiters: max.max(1),
        }
    }

    /// The options this locker was built with.
    pub fn options(&self) -> &LockOptions {
        &self.shared.options
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.shared.nodes.len()
    }

    /// Votes a lease needs: `N/2 + 1`.
    pub fn quorum(&self) -> usize {
        self.shared.nodes.quorum()
    }

    /// Number of resources this process currently holds or waits for. Zero when
    /// every lease is released and no caller waits: nothing is left behind.
    pub fn local_resources(&self) -> usize {
        self.shared.queues.len()
    }

    /// The leases of this locker held in this process now (the test kit reads them).
    #[cfg(feature = "test-util")]
    pub(crate) fn held_leases(&self) -> Vec<Arc<lease::LeaseInner>> {
        self.shared.queues.holders()
    }

    /// Whether `lease` was granted by this locker or a clone of it: the HTTP layer's
    /// per-request reentrancy reuses a lease for the same resource only then (another
    /// locker's lease on a resource of the same name protects nothing here).
    pub(crate) fn granted(&self, lease: &LeaseHandle) -> bool {
        Arc::ptr_eq(&self.shared, &lease.lease_inner().locker)
    }

    /// Counters of what this locker did so far.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics.snapshot()
    }

    /// Each node as this locker last saw it, in the order the nodes were given: up or
    /// down, since when, and its latest error. Every call to a node updates it, also
    /// those a round no longer waits for, so a node that went down reads
    /// [`NodeStatus::Down`] after the next operation that reached for it, even while a
    /// quorum still grants every lease. Each change is also logged once.
    pub fn node_states(&self) -> Vec<NodeState> {
        self.shared.nodes.states()
    }

    /// One attempt, no waiting: a lease, or [`LockError::Held`] when someone holds the
    /// resource (also when a caller of this process holds it or queues for it).
    pub async fn try_acquire(&self, resource: impl Into<Resource>) -> Result<Lease, LockError> {
        self.try_acquire_as(resource, LockMode::Exclusive).await
    }

    /// Whether this locker can take leases in `mode`: for [`LockMode::Shared`] and
    /// [`LockMode::Counted`] every node must keep shared holders
    /// ([`Capabilities::shared_modes`](crate::node::Capabilities::shared_modes)); the Redis nodes and the
    /// [`MemoryNode`] do, an etcd node does not. A [`LockLayer`](crate::http::LockLayer)
    /// in such a mode checks it when built.
    pub fn check_mode(&self, mode: LockMode) -> Result<(), ConfigError> {
        if mode.is_exclusive() {
            return Ok(());
        }
        self.shared.nodes.require(
            |node| node.capabilities().shared_modes,
            &format!(
                "{mode:?} leases need nodes that keep shared holders, and these do not \
                 (Capabilities::shared_modes is false)"
            ),
        )
    }

    /// [`try_acquire`](Redlock::try_acquire) in `mode`: one attempt at a shared lease (a
    /// reader, refused while a writer holds the resource or waits for it), a counted one
    /// (one of `n` permits, refused while `n` are held), or with
    /// [`LockMode::Exclusive`] the exclusive one. A refusal is [`LockError::Held`].
    ///
    /// ```
    /// use tower_redlock::{LockMode, Redlock};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_redlock::LockError> {
    /// let locker = Redlock::in_memory();
    /// let first = locker.try_acquire_as("report:7", LockMode::Shared).await?;
    /// let second = locker.try_acquire_as("report:7", LockMode::Shared).await?;
    /// assert!(locker.try_acquire("report:7").await.is_err()); // a writer waits for both
    /// # drop((first, second));
    /// # Ok(()) }
    /// ```
    pub async fn try_acquire_as(
        &self,
        resource: impl Into<Resource>,
        mode: LockMode,
    ) -> Result<Lease, LockError> {
        let started = metrics::started();
        let single = Target::one(&self.shared.options.key_prefix, resource.into(), mode);
        let result = self.try_once(single).await;
        metrics::acquisition(&result, started);
        result
    }

    /// [`acquire`](Redlock::acquire) in `mode`: waits up to `timeout` for a shared or
    /// counted lease, or (with [`LockMode::Exclusive`]) the exclusive one. A shared or
    /// counted waiter is woken by the releases of the resource; an exclusive waiter that
    /// meets shared holders keeps new ones out until it is served (writer preference).
    pub async fn acquire_as(
        &self,
        resource: impl Into<Resource>,
        mode: LockMode,
        timeout: Duration,
    ) -> Result<Lease, LockError> {
        let started = Instant::now();
        let target = Target::one(&self.shared.options.key_prefix, resource.into(), mode);
        self.wait_for(target, started, acquire::after(started, timeout))
            .await
    }

    /// Waits up to `timeout` for the resource; see [`acquire_until`](Redlock::acquire_until).
    pub async fn acquire(
        &self,
        resource: impl Into<Resource>,
        timeout: Duration,
    ) -> Result<Lease, LockError> {
        self.acquire_as(resource, LockMode::Exclusive, timeout)
            .await
    }

    /// Waits until `deadline` for the resource.
    ///
    /// Callers of this process queue first-in first-out, and only the head of the queue
    /// contends at the nodes. The head retries at once when a release is published on
    /// any node, and otherwise after the [`RetryPolicy`]'s delay. Fails with
    /// [`LockError::WaitTimeout`] at the deadline, [`LockError::QueueFull`] when
    /// [`LockOptions::max_waiters`] callers already wait, at once with
    /// [`LockError::Unavailable`] when too few nodes answer, and with
    /// [`LockError::Draining`] as soon as [`drain`](Redlock::drain) begins.
    ///
    /// Cancellation-safe: dropping the future leaves no queue entry and no lock behind.
    pub async fn acquire_until(
        &self,
        resource: impl Into<Resource>,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let prefix = &self.shared.options.key_prefix;
        let target = Target::one(prefix, resource.into(), LockMode::Exclusive);
        self.wait_for(target, Instant::now(), deadline).await
    }
}

impl fmt::Debug for Redlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redlock")
            .field("nodes", &self.shared.nodes.len())
            .field("quorum", &self.shared.nodes.quorum())
            .field("options", &self.shared.options)
            .finish()
    }
}
