//! The release notifications of a [`SentinelNode`](super::SentinelNode): one channel per
//! resource, fed by a subscription on the current master that follows failovers.

use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::task::AbortHandle;

use super::Master;
use crate::error::NodeError;
use crate::lock_unpoisoned;
use crate::node::{Node, ResourceKeys};

/// One resource's release notifications as the waiters see them, fed by a subscription
/// on the current master that is replaced when the master changes.
pub(super) struct HubChannel {
    pub(super) keys: ResourceKeys,
    pub(super) tx: watch::Sender<u64>,
    pub(super) upstream: Mutex<Option<Upstream>>,
}

/// The subscription on one master, forwarded by a task.
pub(super) struct Upstream {
    pub(super) epoch: u64,
    pub(super) forward: AbortHandle,
}

impl HubChannel {
    pub(super) fn wake(&self) {
        self.tx.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub(super) fn epoch(&self) -> Option<u64> {
        lock_unpoisoned(&self.upstream).as_ref().map(|u| u.epoch)
    }

    /// Subscribes on `master` (unless already subscribed there) and forwards its
    /// notifications, replacing the subscription on an earlier master.
    pub(super) async fn attach(self: &Arc<Self>, master: &Master) -> Result<(), NodeError> {
        if self.epoch() == Some(master.epoch) {
            return Ok(());
        }
        let mut signal = master.node.subscribe(&self.keys).await?;
        let channel = Arc::downgrade(self);
        let forward = tokio::spawn(async move {
            loop {
                signal.changed().await;
                match channel.upgrade() {
                    Some(channel) => channel.wake(),
                    None => return,
                }
            }
        });
        let previous = lock_unpoisoned(&self.upstream).replace(Upstream {
            epoch: master.epoch,
            forward: forward.abort_handle(),
        });
        if let Some(previous) = previous {
            previous.forward.abort();
        }
        Ok(())
    }
}

impl Drop for HubChannel {
    fn drop(&mut self) {
        // Ending the forwarding task drops its subscription on the master.
        if let Some(upstream) = self
            .upstream
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            upstream.forward.abort();
        }
    }
}
