//! What tests that call a node directly (its connection, its order of commands) need
//! from outside the crate: owner values, a resource's keys, and the calls' arguments;
//! and [`Forwarding`], a real node with one behaviour changed.

use std::sync::Arc;
use std::time::Duration;

use tower_redlock::node::{
    Acquire, Hold, Node, NodeFuture, Owner, Release, ReleaseSignal, ResourceKeys, Vote,
};
use tower_redlock::{LockMode, LockOptions, MemoryNode, NodeError, Redlock};

/// One lease's owner value, to be taken on as many node indices as a test has callers
/// (`Owner::for_node`), as tests outside the crate can make them.
pub async fn owners() -> Owner {
    let locker = Redlock::new([MemoryNode::new()], LockOptions::default()).unwrap();
    let lease = locker.try_acquire("owners").await.unwrap();
    lease.handle().owner_on(0)
}

/// The keys of the lock key `lock`, named as the crate names them.
pub fn keys(lock: String) -> ResourceKeys {
    ResourceKeys {
        fence: format!("{lock}:fence"),
        channel: format!("{lock}:released"),
        lock,
    }
}

/// An acquire of `keys` by `owner` in `mode`, with the settings these tests use: ttl
/// 10 s, fence counters for an hour, fencing on with floor 1, no waiter.
pub fn acquire<'a>(keys: &'a [ResourceKeys], owner: &'a Owner, mode: LockMode) -> Acquire<'a> {
    Acquire {
        keys,
        owner,
        mode,
        ttl: Duration::from_secs(10),
        fencing: true,
        fence_ttl: Duration::from_secs(3600),
        fence_floor: 1,
        seed_only_when_missing: false,
        waiter: None,
    }
}

/// What `owner` holds of `keys` in `mode`, for extend and release.
pub fn hold<'a>(keys: &'a [ResourceKeys], owner: &'a Owner, mode: LockMode) -> Hold<'a> {
    Hold { keys, owner, mode }
}

/// Whether a vote granted every key.
pub fn granted(vote: &Vote) -> bool {
    matches!(vote, Vote::Granted { .. })
}

/// Today's clock floor (ms × 2¹⁰), as the locker computes it.
pub fn clock_floor() -> u64 {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    u64::try_from(ms).unwrap() * 1024
}

/// Makes every node's fence counter different, so that any majority needs the
/// write-back: the counters are set ahead of the clock floor (as after a burst of more
/// than 1,024 acquisitions per ms), which would otherwise overtake them all alike.
pub fn diverge_counters(nodes: &[MemoryNode], resource: &str) {
    let ahead = clock_floor() + 1_000_000_000;
    nodes[0].set(
        &format!("redlock:{{{resource}}}:fence"),
        &(ahead + 1).to_string(),
    );
    nodes[1].set(
        &format!("redlock:{{{resource}}}:fence"),
        &(ahead + 2).to_string(),
    );
}

/// Which call a [`Forwarding`] node is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Acquire,
    Extend,
    Release,
    RaiseFences,
    Subscribe,
}

type ReleaseWith = Arc<dyn Fn(&Hold<'_>) -> NodeFuture<bool> + Send + Sync>;

/// A node that forwards its calls to a real node, `inner`, for tests that need a node
/// with one thing changed: `before` sees each call first (to count calls, or to panic as
/// a node with a bug would), and a release answered by `release_with` replaces the
/// inner node's.
#[derive(Clone)]
pub struct Forwarding<N> {
    pub inner: N,
    before: Arc<dyn Fn(Call) + Send + Sync>,
    release: Option<ReleaseWith>,
}

impl<N: Node> Forwarding<N> {
    pub fn new(inner: N) -> Self {
        Forwarding {
            inner,
            before: Arc::new(|_| {}),
            release: None,
        }
    }

    pub fn before(mut self, before: impl Fn(Call) + Send + Sync + 'static) -> Self {
        self.before = Arc::new(before);
        self
    }

    pub fn release_with(
        mut self,
        release: impl Fn(&Hold<'_>) -> NodeFuture<bool> + Send + Sync + 'static,
    ) -> Self {
        self.release = Some(Arc::new(release));
        self
    }
}

impl<N: Node> Node for Forwarding<N> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn acquire(&self, request: &Acquire<'_>) -> NodeFuture<Vote> {
        (self.before)(Call::Acquire);
        self.inner.acquire(request)
    }

    fn extend(
        &self,
        holds: &[Hold<'_>],
        ttl: Duration,
    ) -> NodeFuture<Vec<Result<bool, NodeError>>> {
        (self.before)(Call::Extend);
        self.inner.extend(holds, ttl)
    }

    fn release(&self, hold: &Hold<'_>, how: Release<'_>) -> NodeFuture<bool> {
        (self.before)(Call::Release);
        match &self.release {
            Some(release) => release(hold),
            None => self.inner.release(hold, how),
        }
    }

    fn raise_fences(
        &self,
        keys: &[ResourceKeys],
        tokens: &[u64],
        fence_ttl: Duration,
    ) -> NodeFuture<()> {
        (self.before)(Call::RaiseFences);
        self.inner.raise_fences(keys, tokens, fence_ttl)
    }

    fn subscribe(&self, keys: &ResourceKeys) -> NodeFuture<ReleaseSignal> {
        (self.before)(Call::Subscribe);
        self.inner.subscribe(keys)
    }
}
