//! The commands that concurrent callers send to one node, sent together.
//!
//! # Why
//!
//! A node's commands share one multiplexed connection, which redis-rs writes to the
//! socket one by one: with `TCP_NODELAY` every write is a packet, and a read and a reply
//! write on the server, and with 64 tasks acquiring and releasing most of the time went
//! to system calls ("the transport, not the client", BENCHMARKS.md). Nagle's algorithm
//! would coalesce them at up to a round trip per command; here commands are held back
//! only while their caller yields once to the scheduler, and only when an earlier
//! command or batch of the node still waits for its replies.
//!
//! # How
//!
//! A caller that finds nothing of its node in flight and no batch open sends its command
//! alone, at once. Otherwise the first caller to find no batch open opens one and
//! *leads* it; callers that come while it is open join it. The leader sends it (one
//! pipeline, in the order they joined), or the caller that makes it [`MOST_CALLERS`]
//! strong does, at once. When the replies arrive, the first caller still waiting is
//! woken; it collects them, hands each of the others its own and wakes them (waking all
//! at once measured slower: they contend for the batch). No task is spawned per batch,
//! so a caller woken but not polled again holds up the others of its batch until it is
//! polled or dropped, as in a queue of Tokio's own fair primitives.
//!
//! Under Tokio's current-thread runtime nothing is batched: redis-rs's connection task
//! already writes every ready caller's command at once, and holding a leader back only
//! delayed the batch (BENCHMARKS.md).
//!
//! # Order and cancellation
//!
//! * Commands reach the connection in the order they were given to it, as redis-rs
//!   alone guarantees: a batch is closed and handed to the connection in one step,
//!   under the node's lock, so no later batch can overtake it. (A release issued after
//!   a cancelled acquire must not run before it, or the acquire would leave its key
//!   behind.) While the connection is being made, the callers wait for it in line, in
//!   that order (`attempt.rs`).
//! * A caller dropped before its batch was sent takes its commands out: they are never
//!   sent, as redis-rs does not send a request dropped before it took it. A leader
//!   dropped before sending sends the others' commands on its way out (without waiting
//!   for their replies), so they neither wait for a next caller nor lose their place.
//! * A caller dropped after its batch was sent leaves its reply unread; once every
//!   caller of a batch is gone, its replies are not awaited at all.
//! * A batch that finds the connection broken is sent once more as a whole, on the new
//!   connection (`conn.rs`: every command the nodes send tolerates running twice).

use std::future::{poll_fn, Future};
use std::mem;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::task::{Context, Poll, Wake, Waker};

use redis::aio::ConnectionLike;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

use crate::node::redis::conn::{one_result_each, Resending, SendOne};
use send::Replies;
use solo::{alone, Solo};

/// A batch is sent as soon as this many callers joined it, without waiting for its
/// leader: two smaller batches keep Redis and the client busy at the same time where one
/// large one has each wait for the other (measured against no cap, 8, 12 and 24 in
/// BENCHMARKS.md).
const MOST_CALLERS: usize = 16;

/// A node's command connection, batching the commands of concurrent callers (see the
/// module docs). Cheap to clone; every clone shares the batches.
#[derive(Clone)]
pub(crate) struct Batching {
    node: Arc<NodeBatches>,
}

/// What the callers of one node share.
struct NodeBatches {
    conn: Resending,
    /// The batch callers join, until it is sent. The lock also keeps sends in order: a
    /// batch is closed and handed to the connection while it is held.
    open: Mutex<Option<Arc<Batch>>>,
    /// Batches sent whose replies have not all arrived, and commands sent alone (see
    /// [`Solo`]) that have not answered.
    in_flight: AtomicUsize,
    /// Whether to batch at all: only under the multi-thread runtime (module docs).
    batched: bool,
}

/// One caller's commands: a single command, or a pipeline's.
enum Commands {
    One(Cmd),
    Many(Vec<Cmd>),
}

/// One batch. Its waker (`Wake for Batch`) is what the connection wakes when the
/// replies arrive: it wakes the first caller still waiting, to collect them for all.
struct Batch {
    node: Arc<NodeBatches>,
    state: Mutex<BatchState>,
    /// Set by the waker; whoever holds the state's lock when it fires hands the notice
    /// on after unlocking (the waker never blocks on the lock, since the connection
    /// may wake it from inside a poll made under the lock).
    notified: AtomicBool,
}

/// A batch's send, from its first poll (which hands it to the connection) to its replies.
type Sending = Pin<Box<dyn Future<Output = RedisResult<Vec<Value>>> + Send>>;

struct BatchState {
    stage: Stage,
    callers: Vec<Caller>,
    /// The replies of the whole batch, once arrived; each caller takes its own.
    outcome: Option<RedisResult<Vec<Value>>>,
    /// Whether this batch counts in its node's `in_flight`.
    counted: bool,
    /// Callers to wake once the lock is released.
    to_wake: Vec<Waker>,
}

enum Stage {
    /// Gathering callers until its leader sends it.
    Open,
    /// Handed to the connection; awaiting the replies.
    Sent(Sending),
    /// The replies arrived, or nobody waits for them.
    Done,
}

struct Caller {
    /// Until the batch is sent.
    commands: Option<Commands>,
    /// Where this caller's replies start in the batch's, and how many.
    first: usize,
    count: usize,
    /// Sent a single command (not a pipeline): its reply comes unwrapped.
    one: bool,
    waker: Option<Waker>,
    /// Dropped: nothing to send for it (if not sent yet), nobody to hand replies to.
    gone: bool,
}

/// A caller's place in a batch. Dropping it (the caller was cancelled) takes back what
/// it can: see the module docs.
struct Place {
    batch: Arc<Batch>,
    index: usize,
    /// Leads a batch it has not sent yet.
    leads: bool,
    /// Took its replies.
    done: bool,
}

impl Place {
    fn join(node: &Arc<NodeBatches>, commands: Commands) -> Place {
        let mut open = lock(&node.open);
        let caller = Caller {
            count: match &commands {
                Commands::One(_) => 1,
                Commands::Many(cmds) => cmds.len(),
            },
            one: matches!(commands, Commands::One(_)),
            commands: Some(commands),
            first: 0,
            waker: None,
            gone: false,
        };
        if let Some(batch) = open.as_ref().cloned() {
            let mut state = batch.lock();
            state.callers.push(caller);
            let (index, full) = (state.callers.len() - 1, state.callers.len() >= MOST_CALLERS);
            drop(state);
            if full {
                batch.send_open(&mut open);
            }
            return Place {
                batch,
                index,
                leads: false,
                done: false,
            };
        }
        let batch = Arc::new(Batch {
            node: node.clone(),
            state: Mutex::new(BatchState {
                stage: Stage::Open,
                callers: vec![caller],
                outcome: None,
                counted: false,
                to_wake: Vec::new(),
            }),
            notified: AtomicBool::new(false),
        });
        *open = Some(batch.clone());
        Place {
            batch,
            index: 0,
            leads: true,
            done: false,
        }
    }

    /// Sends the batch this caller leads, unless a caller that filled it already did.
    fn send_batch(&mut self) {
        self.leads = false;
        let mut open = lock(&self.batch.node.open);
        if open.as_ref().is_some_and(|b| Arc::ptr_eq(b, &self.batch)) {
            self.batch.send_open(&mut open);
        }
    }

    fn poll_replies(&mut self, cx: &mut Context<'_>) -> Poll<RedisResult<Replies>> {
        let mut state = self.batch.lock();
        loop {
            if let Some(replies) = state.take_replies(self.index) {
                self.done = true;
                return Poll::Ready(replies);
            }
            match &mut state.stage {
                Stage::Sent(send) => {
                    // This poll answers every notice so far; one that comes during it
                    // is handed on when the lock is released.
                    self.batch.notified.store(false, Ordering::SeqCst);
                    let waker = Waker::from(self.batch.clone());
                    match send.as_mut().poll(&mut Context::from_waker(&waker)) {
                        Poll::Ready(outcome) => state.finish(&self.batch.node, outcome),
                        Poll::Pending => {
                            state.callers[self.index].waker = Some(cx.waker().clone());
                            return Poll::Pending;
                        }
                    }
                }
                Stage::Open => {
                    state.callers[self.index].waker = Some(cx.waker().clone());
                    return Poll::Pending;
                }
                // Done without an outcome: every caller was gone, which this one is not.
                Stage::Done => {
                    self.done = true;
                    return Poll::Ready(Err(internal("batch finished without replies")));
                }
            }
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if self.leads {
            // Under the node's lock, so that nobody joins between the look and the close.
            let mut open = lock(&self.batch.node.open);
            if open.as_ref().is_some_and(|b| Arc::ptr_eq(b, &self.batch)) {
                let others_wait = {
                    let mut state = self.batch.lock();
                    state.callers[self.index].gone = true;
                    state.callers.iter().any(|caller| !caller.gone)
                };
                if others_wait && tokio::runtime::Handle::try_current().is_ok() {
                    self.batch.send_open(&mut open);
                } else {
                    // Nothing to send, or no runtime to send it on (it is shutting
                    // down): whoever still waits hears so.
                    let was_open = open.take();
                    let why = "the caller leading this batch was dropped outside a Tokio runtime";
                    self.batch
                        .lock()
                        .finish(&self.batch.node, Err(internal(why)));
                    drop(was_open);
                }
                return;
            }
            // Filled up and sent by another caller: leaves as any caller does.
        }
        let mut state = self.batch.lock();
        let caller = &mut state.callers[self.index];
        caller.gone = true;
        caller.commands = None;
        // Woken, not polled since: it may have been the one to collect the replies.
        let woken = caller.waker.take().is_none();
        if matches!(state.stage, Stage::Sent(_)) {
            if state.callers.iter().all(|c| c.gone) {
                // Nobody waits for the replies: stop awaiting them.
                state.stage = Stage::Done;
                state.uncount(&self.batch.node);
            } else if woken && let Some(next) = state.first_waiting() {
                state.to_wake.push(next);
            }
        }
    }
}

impl Batch {
    fn lock(&self) -> Locked<'_> {
        Locked {
            batch: self,
            state: Some(lock(&self.state)),
        }
    }

    /// Closes the open batch, this one (`open` is the node's, locked), and hands its
    /// commands to the connection.
    fn send_open(self: &Arc<Self>, open: &mut MutexGuard<'_, Option<Arc<Batch>>>) {
        let node = &self.node;
        let was_open = open.take();
        let mut state = self.lock();
        let mut pipe = Pipeline::with_capacity(state.callers.len());
        let mut sent = 0;
        for caller in state.callers.iter_mut() {
            let Some(commands) = caller.commands.take() else {
                continue;
            };
            if caller.gone {
                continue;
            }
            caller.first = sent;
            sent += caller.count;
            match commands {
                Commands::One(cmd) => {
                    pipe.add_command(cmd);
                }
                Commands::Many(cmds) => {
                    for cmd in cmds {
                        pipe.add_command(cmd);
                    }
                }
            }
        }
        if sent == 0 {
            state.finish(node, Err(internal("batch sent without commands")));
            return;
        }
        node.in_flight.fetch_add(1, Ordering::AcqRel);
        state.counted = true;
        let conn = node.conn.clone();
        let mut send: Sending = Box::pin(async move { conn.send_many(&pipe, 0, sent).await });
        // The first poll hands the commands to the connection; made while the node's
        // `open` is held, so that no later batch reaches the connection first.
        self.notified.store(false, Ordering::SeqCst);
        let waker = Waker::from(self.clone());
        match send.as_mut().poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(outcome) => state.finish(node, outcome),
            Poll::Pending => state.stage = Stage::Sent(send),
        }
        drop(state);
        drop(was_open);
    }

    /// Hands on a notice that came while the lock was held (see `notified`).
    fn pass_on_notice(&self) {
        while self.notified.load(Ordering::SeqCst) {
            let mut state = match self.state.try_lock() {
                Ok(state) => state,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                // Its holder hands the notice on when it unlocks.
                Err(TryLockError::WouldBlock) => return,
            };
            let mut driver = None;
            if self.notified.swap(false, Ordering::SeqCst) {
                driver = state.first_waiting();
            }
            drop(state);
            driver.into_iter().for_each(Waker::wake);
        }
    }
}

impl Wake for Batch {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.notified.store(true, Ordering::SeqCst);
        self.pass_on_notice();
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        state.uncount(&self.node);
    }
}

/// The batch's state, locked; unlocking hands on a notice that came meanwhile.
struct Locked<'a> {
    batch: &'a Batch,
    state: Option<MutexGuard<'a, BatchState>>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = BatchState;

    fn deref(&self) -> &BatchState {
        self.state.as_ref().expect("locked until dropped")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut BatchState {
        self.state.as_mut().expect("locked until dropped")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let to_wake = self.state.as_mut().map(|s| mem::take(&mut s.to_wake));
        self.state = None;
        to_wake.into_iter().flatten().for_each(Waker::wake);
        self.batch.pass_on_notice();
    }
}

impl BatchState {
    fn finish(&mut self, node: &NodeBatches, outcome: RedisResult<Vec<Value>>) {
        self.stage = Stage::Done;
        self.outcome = Some(outcome);
        self.uncount(node);
        self.wake_all();
    }

    fn uncount(&mut self, node: &NodeBatches) {
        if mem::take(&mut self.counted) {
            node.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The waker of the first caller (in the order they joined) still waiting: the one
    /// woken to collect the replies for all.
    fn first_waiting(&mut self) -> Option<Waker> {
        self.callers.iter_mut().find_map(|c| c.waker.take())
    }

    /// Wakes every caller waiting, once the lock is released (see `Locked`): woken
    /// under it, a caller on another thread would only find it held.
    fn wake_all(&mut self) {
        let wakers = self.callers.iter_mut().filter_map(|c| c.waker.take());
        self.to_wake.extend(wakers);
    }

    /// Caller `index`'s replies, once the batch's arrived.
    fn take_replies(&mut self, index: usize) -> Option<RedisResult<Replies>> {
        let caller = &self.callers[index];
        let (first, count, one) = (caller.first, caller.count, caller.one);
        let values = match self.outcome.as_mut()? {
            Ok(values) => values,
            Err(e) => return Some(Err(e.clone())),
        };
        let Some(mine) = values.get_mut(first..first + count) else {
            return Some(Err(internal("fewer replies than commands")));
        };
        let take = |value: &mut Value| mem::replace(value, Value::Nil);
        Some(Ok(match (one, mine) {
            (true, [value]) => Replies::One(take(value)),
            (true, _) => return Some(Err(internal("one command, not one reply"))),
            (false, mine) => Replies::Many(mine.iter_mut().map(take).collect()),
        }))
    }
}

use crate::lock_unpoisoned as lock;

/// An error of the client's own making (not the server's, not the network's).
fn internal(what: &'static str) -> RedisError {
    RedisError::from((
        redis::ErrorKind::Client,
        "command batching",
        what.to_owned(),
    ))
}

mod send;
mod solo;
