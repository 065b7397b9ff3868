//! The errors below the engine: one node's failure ([`NodeError`], [`NodeFailure`]) and
//! options that cannot work ([`ConfigError`]). Imports nothing from the crate, so every
//! level may use it. The engine's own error, [`LockError`](crate::LockError), lives in
//! `lock/error.rs`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// One node that did not answer, and why.
#[derive(Debug, Clone)]
pub struct NodeFailure {
    /// The node's name (its URL without password, or `memory`).
    pub node: Arc<str>,
    /// What went wrong.
    pub error: NodeError,
}

impl fmt::Display for NodeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.node, self.error)
    }
}

/// A failure of one node's answer. Cheap to clone.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// No answer within the per-node timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection failed or the server is unreachable.
    #[error("connection failed: {0}")]
    Connection(Arc<str>),
    /// The server answered with an error (for example `WRONGTYPE` or `OOM`).
    #[error("server error: {0}")]
    Server(Arc<str>),
    /// The answer had an unexpected shape.
    #[error("unexpected reply: {0}")]
    Protocol(Arc<str>),
    /// The node does not implement the operation (for example outcome records on a
    /// node kind that has no record commands yet).
    #[error("not supported by this node: {0}")]
    Unsupported(Arc<str>),
}

/// Options or node lists that cannot work, rejected when the locker is built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid lock configuration: {0}")]
pub struct ConfigError(pub(crate) String);

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        ConfigError(message.into())
    }
}
