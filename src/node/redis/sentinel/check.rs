//! The periodic check of a [`SentinelNode`](crate::SentinelNode): has the master changed?

use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use super::{millis, Sentinels, DEFAULT_CHECK_INTERVAL};

/// Asks the sentinels every `check_interval` whether the master changed.
pub(super) async fn check_task(inner: Weak<Sentinels>) {
    loop {
        let interval = match inner.upgrade() {
            Some(inner) => inner.check_interval_ms.load(Ordering::Relaxed),
            None => return,
        };
        tokio::time::sleep(Duration::from_millis(if interval == 0 {
            millis(DEFAULT_CHECK_INTERVAL)
        } else {
            interval
        }))
        .await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        if inner.check_interval_ms.load(Ordering::Relaxed) == 0 {
            continue;
        }
        let (generation, current) = inner.master.outcome();
        match current {
            // A lookup is in progress.
            None => {}
            // The last lookup failed and no command asked again since: retry.
            Some(Err(_)) => inner.master.renew(generation),
            Some(Ok(master)) => {
                if let Ok(Ok(client)) = inner.ask_sentinels().await
                    && client.get_connection_info().addr().to_string() != master.addr
                {
                    inner.master.renew(generation);
                }
            }
        }
    }
}
