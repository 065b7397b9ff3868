//! What the locker last saw of each node: whether it answers, since when, and its last
//! error. A node going down while a quorum still holds costs no request anything, so
//! nothing else would show it: each change is logged once, and
//! [`Redlock::node_states`](crate::Redlock::node_states) reads the current picture.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::NodeError;

/// Whether a node answers, as the locker last saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NodeStatus {
    /// No call has reached or failed to reach it yet (nodes connect on first use).
    Unknown,
    /// It answered its latest call (possibly with a server error, see
    /// [`NodeState::last_error`]).
    Up,
    /// Its latest call did not reach it: the connection failed or was refused, or no
    /// answer came within the per-node timeout.
    Down,
}

impl fmt::Display for NodeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NodeStatus::Unknown => "unknown",
            NodeStatus::Up => "up",
            NodeStatus::Down => "down",
        })
    }
}

/// One node as the locker last saw it (see [`Redlock::node_states`](crate::Redlock::node_states)).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct NodeState {
    /// The node's name ([`Node::name`](crate::node::Node::name): no credentials).
    pub name: Arc<str>,
    /// Whether it answers.
    pub status: NodeStatus,
    /// When `status` took its current value (for [`NodeStatus::Unknown`], when the
    /// locker was built).
    pub since: Instant,
    /// The latest error of a call to it, if any, even while it is up again.
    pub last_error: Option<NodeError>,
    /// What the latest check of its servers' setup found that puts locks at risk or
    /// slows them down (an evicting `maxmemory-policy`, a replica, a missing
    /// permission), if anything: checked by [`Redlock::connect`](crate::Redlock::connect)
    /// and then periodically (see
    /// [`LockOptions::setup_check_interval`](crate::LockOptions::setup_check_interval)).
    pub setup_warning: Option<Arc<str>>,
}

/// The state of one node, fed with the answer of every call the locker makes to it.
pub(crate) struct Health {
    name: Arc<str>,
    /// The per-node timeout: only a call cut at this budget says the node is slow.
    node_timeout: Duration,
    entry: Mutex<Entry>,
}

struct Entry {
    status: NodeStatus,
    since: Instant,
    /// When the call that set `status` started. Calls overlap, and an answer of a call
    /// started earlier is older news (a command sent just before the node died may fail
    /// after a later one already succeeded on the new connection), so it does not
    /// change the status back.
    decided_by: Instant,
    last_error: Option<NodeError>,
    setup_warning: Option<Arc<str>>,
    /// Calls that did not reach the node since it went down.
    failed: u64,
}

impl Health {
    pub(crate) fn new(name: Arc<str>, node_timeout: Duration) -> Self {
        let now = Instant::now();
        Health {
            name,
            node_timeout,
            entry: Mutex::new(Entry {
                status: NodeStatus::Unknown,
                since: now,
                decided_by: now,
                last_error: None,
                setup_warning: None,
                failed: 0,
            }),
        }
    }

    /// The node's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Records the answer of a call that started at `started`, and logs a change.
    pub(crate) fn observe<T>(&self, started: Instant, answer: &Result<T, NodeError>) {
        let status = match answer {
            Ok(_) => NodeStatus::Up,
            Err(NodeError::Connection(_)) => NodeStatus::Down,
            Err(NodeError::Timeout(budget)) if *budget >= self.node_timeout => NodeStatus::Down,
            // Says nothing: cut by a budget shorter than the node's, or the node lacks
            // the operation.
            Err(NodeError::Timeout(_) | NodeError::Unsupported(_)) => return,
            // It answered, with an error: reachable, and the error is kept.
            Err(_) => NodeStatus::Up,
        };
        let error = answer.as_ref().err();
        let previous = {
            let mut entry = crate::lock_unpoisoned(&self.entry);
            if let Some(error) = error {
                entry.last_error = Some(error.clone());
            }
            if status == NodeStatus::Down {
                entry.failed += 1;
            }
            if started < entry.decided_by {
                return;
            }
            entry.decided_by = started;
            if entry.status == status {
                if let Some(error) = error.filter(|_| status == NodeStatus::Down) {
                    tracing::debug!(node = %self.name, %error, "node still down");
                }
                return;
            }
            let previous = (entry.status, entry.since, std::mem::take(&mut entry.failed));
            entry.status = status;
            entry.since = Instant::now();
            previous
        };
        // Logged outside the lock, once per change.
        match (previous, error) {
            (_, Some(error)) if status == NodeStatus::Down => {
                tracing::warn!(node = %self.name, %error, "node down");
            }
            ((NodeStatus::Down, since, failed_calls), _) => {
                tracing::info!(node = %self.name, down_for = ?since.elapsed(), failed_calls, "node back up");
            }
            _ => tracing::debug!(node = %self.name, "node up"),
        }
    }

    pub(crate) fn state(&self) -> NodeState {
        let entry = crate::lock_unpoisoned(&self.entry);
        NodeState {
            name: self.name.clone(),
            status: entry.status,
            since: entry.since,
            last_error: entry.last_error.clone(),
            setup_warning: entry.setup_warning.clone(),
        }
    }

    /// Records what a check of the node's setup found (`None`: nothing), and logs a
    /// change once: at `warn` when a finding appears or changes, at `info` when it is
    /// gone.
    pub(crate) fn note_setup(&self, warning: Option<String>) {
        let changed = {
            let mut entry = crate::lock_unpoisoned(&self.entry);
            if entry.setup_warning.as_deref() == warning.as_deref() {
                return;
            }
            std::mem::replace(&mut entry.setup_warning, warning.clone().map(Arc::from))
        };
        match warning {
            Some(warning) => {
                tracing::warn!(node = %self.name, %warning, "node setup puts locks at risk")
            }
            None => tracing::info!(node = %self.name, was = ?changed, "node setup fixed"),
        }
    }
}

/// Whether the locker's last rounds found a quorum of nodes answering: a loss and a
/// return are logged once each, with the attempts refused in between, rather than a
/// line per refused request.
#[derive(Debug, Default)]
pub(crate) struct QuorumWatch {
    lost: AtomicBool,
    refused: AtomicU64,
}

impl QuorumWatch {
    /// A round found fewer than `quorum` of `nodes` answering.
    pub(crate) fn refused(
        &self,
        answered: usize,
        nodes: usize,
        quorum: usize,
        why: &dyn fmt::Display,
    ) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        if self.lost.swap(true, Ordering::AcqRel) {
            tracing::debug!(%why, "no quorum");
        } else {
            tracing::warn!(answered, nodes, quorum, %why, "quorum lost: requests for locks are refused until it is back");
        }
    }

    /// A round found a quorum answering (granted or held).
    pub(crate) fn answered(&self) {
        if self.lost.load(Ordering::Relaxed) && self.lost.swap(false, Ordering::AcqRel) {
            let refused = self.refused.swap(0, Ordering::Relaxed);
            tracing::info!(refused, "quorum regained");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health() -> Health {
        Health::new("n".into(), Duration::from_millis(50))
    }

    fn refused() -> Result<(), NodeError> {
        Err(NodeError::Connection("refused".into()))
    }

    #[test]
    fn changes_follow_the_latest_call() {
        let h = health();
        assert_eq!(h.state().status, NodeStatus::Unknown);
        let early = Instant::now();
        let late = early + Duration::from_millis(1);
        h.observe(late, &refused());
        assert_eq!(h.state().status, NodeStatus::Down);
        // An answer to an older call does not undo what a newer one showed.
        h.observe(early, &Ok(()));
        assert_eq!(h.state().status, NodeStatus::Down);
        h.observe(late + Duration::from_millis(1), &Ok(()));
        let state = h.state();
        assert_eq!(state.status, NodeStatus::Up);
        assert!(matches!(state.last_error, Some(NodeError::Connection(_))));
    }

    #[test]
    fn only_the_node_budget_makes_a_timeout_count() {
        let h = health();
        let cut_short: Result<(), _> = Err(NodeError::Timeout(Duration::from_millis(3)));
        h.observe(Instant::now(), &cut_short);
        assert_eq!(h.state().status, NodeStatus::Unknown);
        let slow: Result<(), _> = Err(NodeError::Timeout(Duration::from_millis(50)));
        h.observe(Instant::now(), &slow);
        assert_eq!(h.state().status, NodeStatus::Down);
        let oom: Result<(), _> = Err(NodeError::Server("OOM".into()));
        h.observe(Instant::now(), &oom);
        assert_eq!(h.state().status, NodeStatus::Up);
    }
}
