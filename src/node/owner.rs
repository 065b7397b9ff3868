//! [`Owner`], the value that marks one acquisition, and [`ReleaseSignal`], what a
//! subscription to a resource's releases hands its waiters.

use std::fmt;
use std::sync::Arc;

use tokio::sync::watch;

/// The random value that marks one acquisition as the owner of a key: hex-encoded, 40
/// characters. A new value is drawn for every acquisition, so ownership belongs to the
/// lease, never to a task, thread or process.
///
/// Every node gets its own value, [`for_node`](Owner::for_node)`(i)`: the lease's 152
/// random bits followed by the node's index. That is what makes one server count once
/// even when it is listed twice (under two names, or reached twice after a failover or
/// a DNS change): the second `SET NX` there finds another node's value, not its own,
/// and reads as held rather than as a resent grant. Node implementations receive the
/// value for themselves and need not know about it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Owner([u8; 40]);

const HEX: &[u8; 16] = b"0123456789abcdef";

impl Owner {
    /// Most nodes a locker may have: the node index takes the last two hex digits.
    pub(crate) const MAX_NODES: usize = 256;

    pub(crate) fn random() -> Self {
        // 19 random bytes; the 20th is the node index, 0 here (see `for_node`). Filled
        // in one call: `rand::random::<[u8; 19]>()` draws each byte on its own.
        let mut bytes = [0u8; 19];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut bytes);
        let mut out = [b'0'; 40];
        for (i, b) in bytes.iter().enumerate() {
            out[2 * i] = HEX[usize::from(b >> 4)];
            out[2 * i + 1] = HEX[usize::from(b & 0x0f)];
        }
        Owner(out)
    }

    /// The value this acquisition stores on node `index` of its locker (0 is the
    /// lease's own value, [`LeaseHandle::owner`](crate::LeaseHandle::owner)). Indices
    /// wrap at 256, which a locker never reaches: it refuses more nodes.
    pub fn for_node(&self, index: usize) -> Owner {
        let mut out = self.0;
        let index = (index % Self::MAX_NODES) as u8;
        out[38] = HEX[usize::from(index >> 4)];
        out[39] = HEX[usize::from(index & 0x0f)];
        Owner(out)
    }

    /// The value as stored in the lock key.
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever stored.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Owner({})", self.as_str())
    }
}

/// A live subscription to one resource's release notifications.
///
/// Every notification bumps a counter; [`changed`](ReleaseSignal::changed) resolves when
/// the counter moved past the value seen last, so a release that happened between
/// [`mark_seen`](ReleaseSignal::mark_seen) and waiting is never missed.
#[derive(Clone)]
pub struct ReleaseSignal {
    // Declared before the guard, so dropped before it: the guard of the last clone
    // finds no receiver of this signal left (see `MemoryNode`'s subscriptions).
    rx: watch::Receiver<u64>,
    _subscription: Arc<dyn Send + Sync>,
}

impl ReleaseSignal {
    /// Wraps a receiver of release counts and a guard that ends the subscription when
    /// the last clone drops (for [`Node`](crate::node::Node) implementations).
    pub fn new(rx: watch::Receiver<u64>, subscription: Arc<dyn Send + Sync>) -> Self {
        ReleaseSignal {
            rx,
            _subscription: subscription,
        }
    }

    /// Marks every notification so far as seen.
    pub fn mark_seen(&mut self) {
        self.rx.borrow_and_update();
    }

    /// Resolves at the next notification not yet seen. Pending forever if the node
    /// dropped its sender (the fallback retry then takes over).
    pub async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl fmt::Debug for ReleaseSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseSignal")
            .field("releases", &*self.rx.borrow())
            .finish()
    }
}
