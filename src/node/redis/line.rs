//! The callers that wait for what their node needs before it can send (a Sentinel
//! master lookup, a cluster's connection), kept in the order they came.
//!
//! Woken together when the wait ends, they would hand their commands to the connection
//! in the order the scheduler runs them: a waiter's leave could then overtake the
//! straggler attempt that queued it, and its entry would stay behind in the wait queue.
//! So each takes a place in line and hands its command over only after the callers
//! before it did, as `conn.rs` holds the commands given while a connection is made.
//! While anyone is in line, later callers join it even when the wait has ended.
//!
//! As with the batching's callers, a caller kept unpolled but not dropped holds up the
//! ones behind it; every call the engine makes is bounded by its node timeout, which
//! drops it, and a dropped caller gives up its place.

use std::collections::BTreeSet;
use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::Poll;

use tokio::sync::watch;

/// One node's line of callers.
pub(crate) struct Line(Mutex<Places>);

struct Places {
    /// The place the next caller to join gets.
    next: u64,
    /// The place whose caller may hand its command over now; `next` when nobody waits.
    serving: u64,
    /// `serving`, for the callers waiting for their turn.
    turn: watch::Sender<u64>,
    /// Places whose callers were dropped before their turn, skipped when it comes.
    abandoned: BTreeSet<u64>,
}

impl Line {
    pub(crate) fn new() -> Self {
        Line(Mutex::new(Places {
            next: 0,
            serving: 0,
            turn: watch::channel(0).0,
            abandoned: BTreeSet::new(),
        }))
    }

    fn places(&self) -> MutexGuard<'_, Places> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place at the end of the line for a caller that has to wait (`waits`), or that
    /// comes while callers who waited are still in line; `None`: it may send at once.
    pub(crate) fn place(&self, waits: bool) -> Option<Place<'_>> {
        let mut places = self.places();
        if !waits && places.serving == places.next {
            return None;
        }
        let place = places.next;
        places.next += 1;
        Some(Place {
            line: self,
            place,
            turn: places.turn.subscribe(),
        })
    }
}

impl Places {
    /// `place` handed its command over, or gave up its place.
    fn leave(&mut self, place: u64) {
        if place != self.serving {
            self.abandoned.insert(place);
            return;
        }
        self.serving += 1;
        while self.abandoned.remove(&self.serving) {
            self.serving += 1;
        }
        self.turn.send_replace(self.serving);
    }
}

/// A caller's place in a [`Line`]; dropping it lets the next caller go.
pub(crate) struct Place<'a> {
    line: &'a Line,
    place: u64,
    turn: watch::Receiver<u64>,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.line.places().leave(self.place);
    }
}

/// Runs `call` in its caller's turn: once the callers before `place` handed their
/// commands over, its first poll hands its own to the connection (which keeps the order
/// it is given commands in), and the next in line may go.
pub(crate) async fn in_turn<F: Future>(place: Option<Place<'_>>, call: F) -> F::Output {
    let Some(mut place) = place else {
        return call.await;
    };
    let mine = place.place;
    // The sender lives in the line, which outlives the place.
    let _ = place.turn.wait_for(|serving| *serving == mine).await;
    let mut call = pin!(call);
    let first = poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
    drop(place);
    match first {
        Poll::Ready(output) => output,
        Poll::Pending => call.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_given_up_before_its_turn_is_skipped() {
        let line = Line::new();
        assert!(line.place(false).is_none(), "nobody waits: no place");
        let first = line.place(true).unwrap();
        let second = line.place(true).unwrap();
        let third = line
            .place(false)
            .expect("callers in line: a newcomer joins");
        drop(second);
        assert_eq!(*first.turn.borrow(), 0);
        drop(first);
        assert_eq!(*third.turn.borrow(), 2, "the abandoned place was skipped");
        drop(third);
        assert!(line.place(false).is_none(), "the line is empty again");
    }
}
