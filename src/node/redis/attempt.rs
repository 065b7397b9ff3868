//! What every Redis node waits for before it can send (a connection, a Sentinel
//! master, a cluster connection) and the callers that wait for it, in order: one
//! primitive for the standalone, Sentinel and Cluster nodes.
//!
//! [`Attempts`] holds the current attempt to get that value, numbered by a generation
//! and run in a task of its own (so that it completes for the next caller even when
//! every caller waiting gave up: their per-node timeout is shorter than an attempt),
//! and the earliest time the next may start (failing attempts are not made in a loop).
//!
//! # The callers' order
//!
//! Woken together when an attempt ends, the callers that waited would hand their
//! commands over in the order the scheduler runs them: a waiter's leave could overtake
//! the attempt that queued it, leaving its entry in the wait queue. So a caller that
//! waits takes a place in line ([`Place`], at its first poll) and hands its command over
//! ([`in_turn`]) only after the callers before it; while anyone is in line, later
//! callers join it. A dropped caller gives up its place (its command is never sent); one
//! kept unpolled holds up the ones behind it, which the engine's node timeout bounds.
//!
//! # Failures
//!
//! A failed attempt fails only the callers that waited for it: a later caller starts a
//! new one rather than being handed an old refusal (from while the server was down).

use std::collections::BTreeSet;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use tokio::sync::watch;
use tokio::time::Instant;

type Attempt<T, E> = Shared<BoxFuture<'static, Result<T, E>>>;

/// Makes one attempt, given the value the previous one made (a Sentinel lookup keeps
/// the master's connection when its address did not change).
pub(crate) type Connect<T, E> =
    Box<dyn Fn(Option<T>) -> BoxFuture<'static, Result<T, E>> + Send + Sync>;

/// One node's attempts and the callers waiting for them (see the module docs).
pub(crate) struct Attempts<T, E> {
    state: Mutex<State<T, E>>,
    connect: Connect<T, E>,
    runtime: tokio::runtime::Handle,
    /// Least time between the starts of two attempts.
    min_interval: Duration,
}

struct State<T, E> {
    generation: u64,
    /// When the current attempt started (or may start); `None` before the first.
    started: Option<Instant>,
    attempt: Option<Attempt<T, E>>,
    line: Line,
}

/// The callers in line.
struct Line {
    /// The place the next caller to join gets.
    next: u64,
    /// The place whose caller may hand its command over now; `next` when nobody waits.
    serving: u64,
    /// `serving`, for the callers waiting for their turn.
    turn: watch::Sender<u64>,
    /// Places whose callers were dropped before their turn, skipped when it comes.
    abandoned: BTreeSet<u64>,
}

/// What a caller got: the value (or the error of the attempt it waited for), the
/// attempt's generation (for [`Attempts::renew`]) and, if it had to wait, its place in
/// line, for [`in_turn`].
pub(crate) struct Got<'a, T, E> {
    pub(crate) value: Result<T, E>,
    pub(crate) generation: u64,
    pub(crate) place: Option<Place<'a, T, E>>,
}

impl<T, E> Attempts<T, E>
where
    T: Clone + Send + Sync + 'static,
    E: Clone + Send + Sync + 'static,
{
    /// No attempt yet: the first caller (or [`start_now`](Self::start_now)) makes one.
    pub(crate) fn new(
        runtime: tokio::runtime::Handle,
        min_interval: Duration,
        connect: Connect<T, E>,
    ) -> Self {
        Attempts {
            state: Mutex::new(State {
                generation: 0,
                started: None,
                attempt: None,
                line: Line {
                    next: 0,
                    serving: 0,
                    turn: watch::channel(0).0,
                    abandoned: BTreeSet::new(),
                },
            }),
            connect,
            runtime,
            min_interval,
        }
    }

    fn state(&self) -> MutexGuard<'_, State<T, E>> {
        crate::lock_unpoisoned(&self.state)
    }

    /// Starts the first attempt, in the background.
    #[cfg(any(feature = "cluster", feature = "sentinel"))]
    pub(crate) fn start_now(&self) {
        let mut state = self.state();
        if state.attempt.is_none() {
            self.start(&mut state, None);
        }
    }

    /// The value, at once if the current attempt made it and nobody is in line (then
    /// without a place); otherwise waiting, in line, for the attempt under way, or for
    /// a new one when there is none or the last one failed.
    pub(crate) async fn get(&self) -> Got<'_, T, E> {
        let (attempt, generation, place) = {
            let mut state = self.state();
            let nobody_waits = state.line.serving == state.line.next;
            match state.attempt.as_ref().map(Shared::peek) {
                Some(Some(Ok(value))) if nobody_waits => {
                    return Got {
                        value: Ok(value.clone()),
                        generation: state.generation,
                        place: None,
                    }
                }
                Some(Some(Err(_))) | None => self.start(&mut state, None),
                Some(_) => {}
            }
            let Some(attempt) = state.attempt.clone() else {
                unreachable!("an attempt was started above");
            };
            (attempt, state.generation, self.join(&mut state))
        };
        Got {
            value: attempt.await,
            generation,
            place: Some(place),
        }
    }

    /// The current attempt's generation and its outcome (`None`: under way).
    #[cfg(feature = "sentinel")]
    pub(crate) fn outcome(&self) -> (u64, Option<Result<T, E>>) {
        let state = self.state();
        let outcome = state.attempt.as_ref().and_then(|a| a.peek().cloned());
        (state.generation, outcome)
    }

    /// The value of attempt `generation` is of no further use (its connection broke,
    /// the master may have moved): starts a new attempt, unless one started since or
    /// that one is still under way.
    pub(crate) fn renew(&self, generation: u64) {
        let mut state = self.state();
        if state.generation != generation {
            return;
        }
        let previous = match state.attempt.as_ref().map(Shared::peek) {
            Some(Some(Ok(value))) => Some(value.clone()),
            Some(Some(Err(_))) | None => None,
            Some(None) => return,
        };
        self.start(&mut state, previous);
    }

    /// Starts the next attempt (`state` is this one's, locked), in a task of its own,
    /// not before [`min_interval`](Self::min_interval) after the last one started.
    fn start(&self, state: &mut State<T, E>, previous: Option<T>) {
        let now = Instant::now();
        let not_before = state
            .started
            .map_or(now, |started| (started + self.min_interval).max(now));
        state.generation += 1;
        state.started = Some(not_before);
        let connect = (self.connect)(previous);
        let attempt = async move {
            if not_before > now {
                tokio::time::sleep_until(not_before).await;
            }
            connect.await
        }
        .boxed()
        .shared();
        self.runtime.spawn(attempt.clone());
        state.attempt = Some(attempt);
    }

    fn join(&self, state: &mut State<T, E>) -> Place<'_, T, E> {
        let place = state.line.next;
        state.line.next += 1;
        Place {
            attempts: self,
            place,
            turn: state.line.turn.subscribe(),
        }
    }
}

impl Line {
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

/// A caller's place in line; dropping it lets the next caller go.
pub(crate) struct Place<'a, T, E> {
    attempts: &'a Attempts<T, E>,
    place: u64,
    turn: watch::Receiver<u64>,
}

impl<T, E> Drop for Place<'_, T, E> {
    fn drop(&mut self) {
        let mut state = crate::lock_unpoisoned(&self.attempts.state);
        state.line.leave(self.place);
    }
}

/// Runs `call` in its caller's turn: once the callers before `place` handed their
/// commands over, its first poll hands its own to the connection (which keeps the order
/// it is given commands in), and the next in line may go. `call` is pinned by the
/// caller: an `async fn` keeps a future it is given by value twice (as its argument
/// and where it awaits it), and redis-rs's send futures are over a kilobyte each.
pub(crate) async fn in_turn<F: Future, T, E>(
    place: Option<Place<'_, T, E>>,
    mut call: Pin<&mut F>,
) -> F::Output {
    if let Some(mut place) = place {
        let mine = place.place;
        // The sender lives in the attempts, which outlive the place.
        let _ = place.turn.wait_for(|serving| *serving == mine).await;
        let first = poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
        drop(place);
        if let Poll::Ready(output) = first {
            return output;
        }
    }
    call.await
}
