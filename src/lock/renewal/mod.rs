//! Renewal: one scheduler task per locker (spawned when the first lease registers,
//! ended when none is left) sleeps until the earliest lease is due, takes every lease
//! due within a short window, and extends them all with one batched call per node
//! ([`Node::extend`](crate::node::Node::extend)): ten thousand leases cost one task and
//! a few scripts per node per tick. Each lease is decided as a watchdog of its own
//! would decide it. The schedule keeps no lease alive, and a released or dropped lease
//! leaves it at once.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::hash::{BuildHasherDefault, Hasher};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::error::NodeError;
use crate::lock::lease::{ExtendFailure, LeaseInner, LostCause};
use crate::lock::round::OwnerTally;
use crate::lock::{metrics, Shared};
use crate::node::Hold;

/// The renewal schedule of one locker.
#[derive(Default)]
pub(crate) struct Renewals {
    schedule: Mutex<Schedule>,
    /// Wakes the scheduler when a lease registers well ahead of its next wake-up.
    earlier: Notify,
}

#[derive(Default)]
struct Schedule {
    /// What is due when, in order; the `u64` is the registration.
    due: BTreeMap<(Instant, u64), Step>,
    /// Leases registered since the scheduler last looked, unordered, each with when it
    /// is due. Most leases (a request's) are released long before their first renewal:
    /// they leave from here, without an ordered insert and removal in `due` under the
    /// schedule's lock. Entries of leases that left are dropped when the list is next
    /// looked at; it never holds more than [`FRESH_LIMIT`].
    fresh: Vec<(Instant, u64, Step)>,
    /// When the earliest entry of `fresh` is due.
    fresh_first: Option<Instant>,
    /// Every registered lease, and where it is.
    registered: HashMap<u64, Place, BuildHasherDefault<IdHasher>>,
    next_id: u64,
    /// The scheduler task is running.
    running: bool,
    /// When the scheduler wakes up next (`None`: only when woken).
    wake_at: Option<Instant>,
}

/// Hashes the registration ids. They count up from 0 inside this locker and never come
/// from outside, so one multiplication spreads them over the table as well as the
/// default SipHash would, at a fraction of its cost on every registration and release.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64((self.0 << 8) | u64::from(byte));
        }
    }

    fn write_u64(&mut self, id: u64) {
        // Odd, so distinct ids stay distinct in the low bits (the bucket); the high bits
        // (the table's tag) mix them all.
        self.0 = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

struct Step {
    lease: Weak<LeaseInner>,
    kind: Kind,
}

/// Where a registered lease is in its locker's schedule.
enum Place {
    /// In `fresh`.
    Fresh,
    /// In `due`, at this time.
    Due(Instant),
    /// Taken out by the scheduler: a round extends it. The lease is kept here too, so
    /// that a scheduler that fails mid-round can still mark it lost.
    Extending(Weak<LeaseInner>),
}

/// The most entries `fresh` holds: past it, the entries of leases that left are dropped,
/// and if more than half are still live, all move to `due`. Each registration thereby
/// costs a bounded, constant share of that sweep.
const FRESH_LIMIT: usize = 256;

#[derive(Clone, Copy)]
enum Kind {
    /// The regular renewal.
    Renew,
    /// Again after a round without quorum.
    Retry,
    /// Mark the lease lost: its validity ran out without renewal.
    Expire(LostCause),
}

/// A lease's place in its locker's renewal schedule; dropping it (the lease is
/// released or dropped) takes the lease out at once.
pub(crate) struct Registration {
    locker: Arc<Shared>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut schedule = self.locker.renewals.lock();
        // An entry in `fresh` stays until the list is next looked at.
        if let Some(Place::Due(at)) = schedule.registered.remove(&self.id) {
            schedule.due.remove(&(at, self.id));
        }
    }
}

impl Schedule {
    fn add_fresh(&mut self, at: Instant, id: u64, step: Step) {
        if self.fresh.len() >= FRESH_LIMIT {
            let registered = &self.registered;
            self.fresh.retain(|(_, id, _)| registered.contains_key(id));
            if self.fresh.len() > FRESH_LIMIT / 2 {
                self.settle_fresh();
            } else {
                self.fresh_first = self.fresh.iter().map(|&(at, ..)| at).min();
            }
        }
        self.fresh.push((at, id, step));
        self.fresh_first = Some(self.fresh_first.map_or(at, |first| first.min(at)));
    }

    /// Moves the live entries of `fresh` to `due`, and drops the others.
    fn settle_fresh(&mut self) {
        for (at, id, step) in self.fresh.drain(..) {
            if let Some(place) = self.registered.get_mut(&id) {
                *place = Place::Due(at);
                self.due.insert((at, id), step);
            }
        }
        self.fresh_first = None;
    }

    /// When the earliest lease is due (or a lease that left since, which costs only an
    /// early wake-up).
    fn first_due(&self) -> Option<Instant> {
        let due = self.due.first_key_value().map(|(&(at, _), _)| at);
        match (due, self.fresh_first) {
            (Some(due), Some(fresh)) => Some(due.min(fresh)),
            (due, fresh) => due.or(fresh),
        }
    }
}

impl Renewals {
    fn lock(&self) -> MutexGuard<'_, Schedule> {
        // Every update below is a few inserts and removes that leave the maps
        // consistent at each step, so a poisoned lock is safe to use.
        crate::lock_unpoisoned(&self.schedule)
    }
}

/// Puts a fresh lease on its locker's schedule, starting the scheduler if it is idle.
pub(crate) fn register(inner: &Arc<LeaseInner>) -> Registration {
    let locker = &inner.locker;
    let at = renew_at(locker, inner.status().valid_until);
    let mut schedule = locker.renewals.lock();
    let id = schedule.next_id;
    schedule.next_id += 1;
    schedule.registered.insert(id, Place::Fresh);
    let step = Step {
        lease: Arc::downgrade(inner),
        kind: Kind::Renew,
    };
    schedule.add_fresh(at, id, step);
    // Waking the scheduler costs more than the rest of a registration; a renewal may
    // come a tenth of the ttl late (it is due when a quarter to a third of the validity
    // is used up), so only a lease due earlier than that before the scheduler's next
    // wake-up wakes it. With one lease at a time (sequential requests) it never does.
    let slack = locker.options.ttl / 10;
    if !schedule.running {
        schedule.running = true;
        metrics::spawn(&locker.runtime, run(locker.clone()));
    } else if schedule.wake_at.is_none_or(|wake_at| at + slack < wake_at) {
        locker.renewals.earlier.notify_one();
    }
    Registration {
        locker: locker.clone(),
        id,
    }
}

/// When a lease valid until `deadline` is renewed: once a third of its validity is used
/// up, less a random twelfth, so that leases taken together do not stay in lockstep.
/// It may already be past (a slow round): the scheduler takes that as due at once, so
/// the clock need not be read here.
fn renew_at(locker: &Shared, deadline: Instant) -> Instant {
    let options = &locker.options;
    let validity = options.ttl.saturating_sub(options.drift());
    let left = validity.mul_f64(2.0 / 3.0 + rand::random::<f64>() / 12.0);
    deadline.checked_sub(left).unwrap_or(deadline)
}

/// Keys of a batch that one node timeout covers (a Redis node's script chunk).
const KEYS_PER_TIMEOUT: usize = 256;

/// A batch round, applied to its leases when decided.
type Round = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The scheduler of one locker: runs until no lease is registered and no round is in
/// flight.
async fn run(locker: Arc<Shared>) {
    // Should this task end any other way than by the return below (a panic here or in a
    // node's `extend`, the runtime shutting down), nothing renews its leases any
    // more: the guard marks them lost at once rather than letting them count as held,
    // and clears the schedule so that the next registration starts a new scheduler.
    let mut guard = Failed {
        locker: &locker,
        armed: true,
    };
    let locker = guard.locker;
    let renewals = &locker.renewals;
    let mut rounds: FuturesUnordered<Round> = FuturesUnordered::new();
    loop {
        let next = {
            let mut schedule = renewals.lock();
            if schedule.registered.is_empty() && rounds.is_empty() {
                // Checked and cleared under the lock `register` takes: a lease that
                // registers from now on starts a new scheduler. What `fresh` still holds
                // is of leases that left.
                schedule.running = false;
                schedule.fresh.clear();
                schedule.fresh_first = None;
                guard.armed = false;
                return;
            }
            schedule.wake_at = schedule.first_due();
            schedule.wake_at
        };
        tokio::select! {
            Some(()) = rounds.next(), if !rounds.is_empty() => {}
            () = sleep_until(next) => {
                if let Some(round) = take_due(locker) {
                    rounds.push(round);
                }
            }
            () = renewals.earlier.notified() => {}
        }
    }
}

/// Marks every lease of the schedule lost when the scheduler ends without finishing its
/// work (see `run`).
struct Failed<'a> {
    locker: &'a Arc<Shared>,
    armed: bool,
}

impl Drop for Failed<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Nothing is left to renew: a lease that registers from now on starts a new
        // scheduler, and the `Registration`s of these find nothing to remove (the ids go
        // on counting, so none of them names a later lease).
        let old = {
            let mut schedule = self.locker.renewals.lock();
            let next_id = schedule.next_id;
            std::mem::replace(
                &mut *schedule,
                Schedule {
                    next_id,
                    ..Schedule::default()
                },
            )
        };
        let steps = old
            .due
            .into_values()
            .chain(old.fresh.into_iter().map(|(.., step)| step));
        let extending = old
            .registered
            .into_values()
            .filter_map(|place| match place {
                Place::Extending(lease) => Some(lease),
                Place::Fresh | Place::Due(_) => None,
            });
        let leases = steps.map(|step| step.lease).chain(extending);
        let lost = leases
            .filter_map(|lease| lease.upgrade())
            .filter(|inner| inner.mark_lost(LostCause::RenewalFailed))
            .count();
        if std::thread::panicking() {
            tracing::error!(
                leases_lost = lost,
                "the renewal task panicked; its leases are marked lost and renewal restarts with the next lease"
            );
        } else {
            // Dropped unfinished: the runtime is shutting down.
            tracing::debug!(leases_lost = lost, "the renewal task was stopped");
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Takes what is due (renewals a little early: within a tenth of the ttl), marks the
/// leases that ran out, and returns the round that extends the others, if any.
fn take_due(locker: &Arc<Shared>) -> Option<Round> {
    let options = &locker.options;
    let now = Instant::now();
    let horizon = now + options.ttl / 10;
    let taken: Vec<(u64, Step)> = {
        let mut schedule = locker.renewals.lock();
        schedule.settle_fresh();
        let keys: Vec<(Instant, u64)> = schedule
            .due
            .range(..=(horizon, u64::MAX))
            .filter(|&(&(at, _), step)| at <= now || !matches!(step.kind, Kind::Expire(_)))
            .map(|(&key, _)| key)
            .collect();
        keys.into_iter()
            .filter_map(|key| {
                let step = schedule.due.remove(&key)?;
                let lease = step.lease.clone();
                schedule.registered.insert(key.1, Place::Extending(lease));
                Some((key.1, step))
            })
            .collect()
    };
    let mut batch = Vec::with_capacity(taken.len());
    for (id, step) in taken {
        let Some(inner) = step.lease.upgrade() else {
            forget(locker, id);
            continue;
        };
        let status = inner.status();
        if !status.live() {
            forget(locker, id);
            continue;
        }
        match step.kind {
            Kind::Expire(cause) => {
                inner.mark_lost(cause);
                forget(locker, id);
            }
            Kind::Renew if inner.renewal_passes_max_hold(now) => {
                // No renewal may carry the lease past `max_hold`: let the last validity
                // run out.
                schedule(
                    locker,
                    id,
                    &inner,
                    status.valid_until,
                    Kind::Expire(LostCause::MaxHoldReached),
                );
            }
            Kind::Renew | Kind::Retry => batch.push((id, inner)),
        }
    }
    (!batch.is_empty()).then(|| extend(locker.clone(), batch))
}

/// Puts lease `id` back on the schedule, unless it left meanwhile.
fn schedule(locker: &Shared, id: u64, inner: &Arc<LeaseInner>, at: Instant, kind: Kind) {
    let mut schedule = locker.renewals.lock();
    let Some(place) = schedule.registered.get_mut(&id) else {
        return;
    };
    *place = Place::Due(at);
    // Only the scheduler task puts leases back: its loop looks at the schedule again
    // before it sleeps, so it needs no wake-up.
    schedule.due.insert(
        (at, id),
        Step {
            lease: Arc::downgrade(inner),
            kind,
        },
    );
}

/// Takes lease `id` off the schedule for good (lost, released or dropped).
fn forget(locker: &Shared, id: u64) {
    locker.renewals.lock().registered.remove(&id);
}

mod round;
#[cfg(test)]
mod tests;

use round::extend;
