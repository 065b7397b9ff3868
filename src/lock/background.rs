//! The background driver of one locker: a single long-lived task that finishes the
//! node calls no caller waits for any more (the acquire calls that outlived a won
//! round, the cleanup of a failed attempt). Handing a call over costs a channel send,
//! not a task: with three nodes nearly every acquisition leaves its slowest node's call
//! behind. The task starts on first use and ends, once its calls are done, when the
//! locker is dropped.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc;

use crate::lock::metrics;

/// A call to finish in the background, type-erased.
pub(crate) type Leftover = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The sender to a locker's driver task (`None` until first use).
#[derive(Default)]
pub(crate) struct Background(Mutex<Option<mpsc::UnboundedSender<Leftover>>>);

impl Background {
    /// Finishes `call` in the driver task, starting it if needed (or again, when the
    /// runtime it ran on is gone).
    pub(crate) fn finish(&self, call: Leftover) {
        let mut sender = crate::lock_unpoisoned(&self.0);
        let call = match sender.as_ref() {
            Some(tx) => match tx.send(call) {
                Ok(()) => return,
                Err(mpsc::error::SendError(call)) => call,
            },
            None => call,
        };
        // Without a runtime (it is shutting down) the call is dropped.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (tx, rx) = mpsc::unbounded_channel();
        // Cannot fail: the receiver is right here.
        let _ = tx.send(call);
        metrics::spawn(&runtime, drive(rx));
        *sender = Some(tx);
    }
}

async fn drive(mut incoming: mpsc::UnboundedReceiver<Leftover>) {
    let mut calls = FuturesUnordered::new();
    loop {
        tokio::select! {
            call = incoming.recv() => match call {
                Some(call) => calls.push(call),
                // The locker is gone: finish what is left, then stop.
                None => break,
            },
            Some(()) = calls.next(), if !calls.is_empty() => {}
        }
    }
    while calls.next().await.is_some() {}
}
