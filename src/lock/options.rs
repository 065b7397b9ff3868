//! Options of a [`Redlock`](crate::Redlock), checked when the locker is built.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::ConfigError;

/// Longest lease ttl accepted; keeps every millisecond count far from overflow.
const MAX_TTL: Duration = Duration::from_secs(30 * 24 * 3600);
/// Longest fence-counter ttl accepted.
const MAX_FENCE_TTL: Duration = Duration::from_secs(366 * 24 * 3600);
/// How often a connected locker checks its servers' setup again, by default.
const DEFAULT_SETUP_CHECK_INTERVAL: Duration = Duration::from_secs(60);
/// The shortest interval between two checks of the servers' setup: each asks every
/// server a few commands.
const MIN_SETUP_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// Redis expires keys with 1 ms precision; the drift allowance covers it.
const DRIFT_FLOOR: Duration = Duration::from_millis(2);

/// How a [`Redlock`](crate::Redlock) takes, renews and waits for leases.
///
/// Every setter consumes and returns the options, so they chain:
///
/// ```
/// use std::time::Duration;
/// use tower_redlock::LockOptions;
///
/// let options = LockOptions::default()
///     .ttl(Duration::from_secs(5))
///     .node_timeout(Duration::from_millis(20))
///     .key_prefix("myapp:lock:");
/// assert_eq!(options.get_ttl(), Duration::from_secs(5));
/// ```
#[derive(Clone)]
pub struct LockOptions {
    pub(crate) ttl: Duration,
    pub(crate) node_timeout: Duration,
    pub(crate) drift_factor: f64,
    pub(crate) min_validity: Duration,
    pub(crate) retry: Arc<dyn RetryPolicy>,
    pub(crate) key_prefix: String,
    pub(crate) fence_ttl: Duration,
    pub(crate) watchdog: bool,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) max_waiters: usize,
    pub(crate) fencing: bool,
    pub(crate) seed_only_when_missing: bool,
    pub(crate) accept_evicting_nodes: bool,
    pub(crate) setup_check_interval: Duration,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: Duration::from_secs(10),
            node_timeout: Duration::from_millis(200),
            drift_factor: 0.01,
            min_validity: Duration::from_millis(5),
            retry: Arc::new(Backoff::default()),
            key_prefix: "redlock:".to_owned(),
            fence_ttl: crate::node::DEFAULT_FENCE_TTL,
            watchdog: true,
            max_hold: None,
            max_waiters: 1000,
            fencing: true,
            seed_only_when_missing: false,
            accept_evicting_nodes: false,
            setup_check_interval: DEFAULT_SETUP_CHECK_INTERVAL,
        }
    }
}

/// The setters: each consumes the options, sets one field and returns them.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($arg:ident: $ty:ty) $(=> $field:ident = $value:expr)?;)*) => {
        impl LockOptions {
            $($(#[$doc])*
            pub fn $name(mut self, $arg: $ty) -> Self {
                setters!(@set self, $name, $arg $(, $field, $value)?);
                self
            })*
        }
    };
    (@set $self:ident, $name:ident, $arg:ident) => { $self.$name = $arg };
    (@set $self:ident, $name:ident, $arg:ident, $field:ident, $value:expr) => { $self.$field = $value };
}

setters! {
    /// Lease time to live (default 10 s). A holder that crashes blocks the resource for
    /// at most this long; the watchdog renews live leases every `ttl / 4` to `ttl / 3`
    /// (jittered, so leases taken together do not renew together).
    ttl(ttl: Duration);
    /// How long one node may take to answer (default 200 ms). A slow or paused node
    /// costs at most this per attempt; it should be small against the ttl. A call cut at
    /// this budget marks the node down (logged), so it should also be well above a
    /// healthy node's slowest answers (measurements: the operations guide).
    node_timeout(timeout: Duration);
    /// Clock drift allowance as a fraction of the ttl (default 0.01). The validity of a
    /// lease is `ttl - elapsed - (ttl × drift_factor + 2 ms)`.
    drift_factor(factor: f64);
    /// Least validity a fresh lease must have (default 5 ms); a majority won more slowly
    /// counts as [`LockError::ValidityExpired`](crate::LockError::ValidityExpired).
    min_validity(min: Duration);
    /// Delay between attempts of a waiting acquire when no wake-up arrives
    /// (default [`Backoff::default`]). A waiter in the nodes' wait queues waits at least
    /// until the key it was refused by runs out (at most 1 s) and at most 2.5 s: a
    /// release wakes it (see [Waiting across processes](crate::guide::stores#waiting-across-processes)).
    retry_policy(policy: impl RetryPolicy) => retry = Arc::new(policy);
    /// Prefix of every key (default `redlock:`). Must not contain `{` or `}`.
    key_prefix(prefix: impl Into<String>) => key_prefix = prefix.into();
    /// Time to live of the fence counters, from the last acquisition of their resource
    /// (default 1 hour). Each resource locked keeps one small counter key per node this
    /// long; an expired counter is re-created at the clock floor, still above every
    /// earlier token (see [`fencing`](crate::fencing)).
    fence_ttl(ttl: Duration);
    /// Renew held leases in the background every `ttl / 4` to `ttl / 3` (default on).
    /// One task per locker renews every lease it holds, with one batched call per
    /// node for all the leases due together (see
    /// [`Node::extend`](crate::node::Node::extend)).
    watchdog(enabled: bool);
    /// Stop renewing a lease once it has been held this long (default: no limit): no
    /// renewal, by the watchdog or [`Lease::extend`](crate::Lease::extend), may carry it
    /// past this. A limit too long for the clock to express (`Duration::MAX`) is no
    /// limit.
    max_hold(max: Option<Duration>);
    /// Most callers of this process that may wait for one resource at once (default
    /// 1,000), counting the head of the queue while it contends at the nodes; one more
    /// gets [`LockError::QueueFull`](crate::LockError::QueueFull).
    max_waiters(max: usize);
    /// Keep a fence counter per resource and give every lease a fencing token (default
    /// on). Turning it off makes an acquisition one `SET NX PX` per node, the least a
    /// Redlock can do, and every [`FencingToken`](crate::FencingToken) is 0: only for
    /// users that never hand the token to a storage. Without tokens, nothing protects
    /// the storage from a holder paused past its lease (see [`fencing`](crate::fencing)).
    fencing(enabled: bool);
    /// Accept nodes whose `maxmemory-policy` evicts keys (default `false`: refused by
    /// [`Redlock::connect`](crate::Redlock::connect); accepted, a warning is logged on
    /// every connect). Under memory pressure such a server deletes held lock keys too,
    /// and the next acquirer gets a lease while the first holder's still reports itself
    /// held: prefer `maxmemory-policy noeviction` on the lock servers.
    accept_evicting_nodes(accept: bool);
    /// How often a locker built by [`Redlock::connect`](crate::Redlock::connect) checks
    /// its servers' setup again (default 60 s, at least 100 ms): a server that became a
    /// replica, started evicting or lost a permission since is logged at `warn` and
    /// shows in [`NodeState::setup_warning`](crate::NodeState::setup_warning).
    setup_check_interval(interval: Duration);
}

impl LockOptions {
    /// BROKEN on purpose, for the fault suite only: seed a node's fence counter from the
    /// clock only when it is missing, trusting a counter that came back behind (after an
    /// RDB restart, an AOF tail loss, a restored backup or a failover to a lagging
    /// replica). Tokens then repeat; the fault suite's `BROKEN=1` runs check that its
    /// history checker catches it.
    #[doc(hidden)]
    pub fn unsafe_fence_seed_only_when_missing(mut self) -> Self {
        self.seed_only_when_missing = true;
        self
    }

    /// The lease time to live.
    pub fn get_ttl(&self) -> Duration {
        self.ttl
    }

    /// `ttl × drift_factor + 2 ms`: how much validity is set aside for clock drift.
    pub fn drift(&self) -> Duration {
        self.ttl.mul_f64(self.drift_factor) + DRIFT_FLOOR
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.ttl.is_zero() || self.ttl > MAX_TTL {
            return Err(ConfigError::new(format!(
                "ttl must be between 1 ms and {} days, got {:?}",
                MAX_TTL.as_secs() / 86_400,
                self.ttl
            )));
        }
        if self.node_timeout.is_zero() {
            return Err(ConfigError::new("node_timeout must be greater than zero"));
        }
        if !(0.0..0.5).contains(&self.drift_factor) {
            return Err(ConfigError::new(format!(
                "drift_factor must be in [0, 0.5), got {}",
                self.drift_factor
            )));
        }
        // Checked sums: `Duration::MAX` for either is a configuration error, not a panic.
        let reserved = self
            .drift()
            .checked_add(self.min_validity)
            .and_then(|reserved| reserved.checked_add(self.node_timeout));
        if reserved.is_none_or(|reserved| self.ttl <= reserved) {
            return Err(ConfigError::new(format!(
                "ttl {:?} leaves no validity: drift {:?} + min_validity {:?} + node_timeout {:?} reach it; use a longer ttl",
                self.ttl,
                self.drift(),
                self.min_validity,
                self.node_timeout
            )));
        }
        if self.key_prefix.contains(['{', '}']) {
            return Err(ConfigError::new(format!(
                "key_prefix must not contain braces (they form the Redis Cluster hash tag), got {:?}",
                self.key_prefix
            )));
        }
        if self.fence_ttl < self.ttl || self.fence_ttl > MAX_FENCE_TTL {
            return Err(ConfigError::new(format!(
                "fence_ttl must be at least the ttl and at most 366 days, got {:?}",
                self.fence_ttl
            )));
        }
        if let Some(max) = self.max_hold
            && max.is_zero()
        {
            return Err(ConfigError::new("max_hold must be greater than zero"));
        }
        if self.max_waiters == 0 {
            return Err(ConfigError::new("max_waiters must be at least 1"));
        }
        if self.setup_check_interval < MIN_SETUP_CHECK_INTERVAL {
            return Err(ConfigError::new(format!(
                "setup_check_interval must be at least {MIN_SETUP_CHECK_INTERVAL:?}, got {:?}",
                self.setup_check_interval
            )));
        }
        Ok(())
    }
}

impl fmt::Debug for LockOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockOptions")
            .field("ttl", &self.ttl)
            .field("node_timeout", &self.node_timeout)
            .field("drift_factor", &self.drift_factor)
            .field("min_validity", &self.min_validity)
            .field("key_prefix", &self.key_prefix)
            .field("fence_ttl", &self.fence_ttl)
            .field("watchdog", &self.watchdog)
            .field("max_hold", &self.max_hold)
            .field("max_waiters", &self.max_waiters)
            .field("fencing", &self.fencing)
            .field("seed_only_when_missing", &self.seed_only_when_missing)
            .field("accept_evicting_nodes", &self.accept_evicting_nodes)
            .field("setup_check_interval", &self.setup_check_interval)
            .finish_non_exhaustive()
    }
}

/// How long a waiting acquire sleeps before its next attempt when no release
/// notification arrives (lost message, crashed holder).
///
/// Implemented for closures `Fn(u32, Option<Duration>) -> Duration`.
pub trait RetryPolicy: Send + Sync + 'static {
    /// Delay before attempt `attempt + 1` (`attempt` starts at 1). `holder_ttl` is the
    /// holder's remaining time to live when the nodes reported it.
    fn delay(&self, attempt: u32, holder_ttl: Option<Duration>) -> Duration;
}

impl<F> RetryPolicy for F
where
    F: Fn(u32, Option<Duration>) -> Duration + Send + Sync + 'static,
{
    fn delay(&self, attempt: u32, holder_ttl: Option<Duration>) -> Duration {
        self(attempt, holder_ttl)
    }
}

/// Exponential backoff with full jitter, capped by the holder's remaining ttl:
/// `random(0 ..= min(max, base × 2^(attempt-1), holder_ttl))`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// First delay bound (default 10 ms).
    pub base: Duration,
    /// Largest delay bound (default 500 ms).
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(500),
        }
    }
}

impl RetryPolicy for Backoff {
    fn delay(&self, attempt: u32, holder_ttl: Option<Duration>) -> Duration {
        let exp = attempt.saturating_sub(1).min(20);
        let mut bound = self.base.saturating_mul(1 << exp).min(self.max);
        if let Some(ttl) = holder_ttl {
            // The holder's key is gone by then at the latest; wake up just after.
            bound = bound.min(ttl.saturating_add(Duration::from_millis(1)));
        }
        bound.mul_f64(rand::random::<f64>())
    }
}
