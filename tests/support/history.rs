//! A history of critical sections and a fenced storage, with a checker that fails on
//! any breach of mutual exclusion the storage let through.
//!
//! Every holder records its critical section from its own point of view:
//!
//! ```ignore
//! let history = History::new("s1_baseline");
//! let lease = locker.acquire("hot:1", wait).await?;
//! let mut section = history.begin("hot:1", lease.fencing_token().get(), "locker 0");
//! // ... work ...
//! section.write();             // the storage accepts it only with a newer token
//! section.end(lease.is_held()); // also recorded on drop (an aborted holder)
//! lease.release().await;
//! let summary = history.check(); // panics on a violation
//! println!("{summary}");
//! ```
//!
//! Time is a global sequence number (one atomic counter, `SeqCst`), so "ends before"
//! and "starts after" are a total order consistent with every happens-before relation
//! between the holders.
//!
//! The storage models what fencing tokens protect: for each resource it accepts a
//! write only with a token greater than the last token it accepted, and counts the
//! rejected (stale) writes.
//!
//! The checker ([`History::check`]) fails, with the offending sections, on
//! 1. two critical sections of one resource that overlap in time and whose writes were
//!    **both accepted** by the storage (mutual exclusion broken, fencing did not save
//!    it);
//! 2. an accepted token that is not greater than the one accepted before it;
//! 3. a section that started after another section of the same resource had ended but
//!    got a token that is not greater (the lock's fencing order is broken);
//! 4. any failure recorded with [`History::fail`] (e.g. a critical section that ran
//!    while no quorum was reachable).
//!
//! A scenario whose faults may legitimately break mutual exclusion (a node that comes
//! back without lock keys it had granted, restarted before the ttl has passed) claims
//! fencing only: [`History::without_exclusion`] turns check 1 into a figure
//! (`overlaps_accepted`), while checks 2–4 still fail.
#![allow(dead_code)]

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// What the storage did with a section's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// The holder did not write (e.g. it saw its lease was lost).
    None,
    Accepted,
    /// The token was not greater than the last accepted one.
    Rejected,
}

/// One critical section, from its holder's point of view.
#[derive(Debug, Clone)]
pub struct Section {
    pub id: usize,
    pub resource: String,
    pub token: u64,
    pub holder: String,
    /// Sequence number when the holder got the lease.
    pub start: u64,
    /// Sequence number when the holder left the section; `None` while inside.
    pub end: Option<u64>,
    /// Wall time since the history began, for messages.
    pub started_at: Duration,
    pub ended_at: Option<Duration>,
    pub write: Write,
    /// The holder saw its lease lost by the end of the section.
    pub lost: bool,
}

impl fmt::Display for Section {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "#{} `{}` token {} by {} [seq {}..{}, {:?}..{}] write {:?}{}",
            self.id,
            self.resource,
            self.token,
            self.holder,
            self.start,
            self.end.map_or("open".to_owned(), |e| e.to_string()),
            self.started_at,
            self.ended_at
                .map_or("open".to_owned(), |e| format!("{e:?}")),
            self.write,
            if self.lost { " (lease lost)" } else { "" }
        )
    }
}

/// A shared, cloneable history plus fenced storage.
#[derive(Clone)]
pub struct History {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    origin: Instant,
    clock: AtomicU64,
    sections: Mutex<Vec<Section>>,
    storage: Mutex<Storage>,
    failures: Mutex<Vec<String>>,
    /// Completed critical sections.
    cycles: watch::Sender<u64>,
    lost: AtomicU64,
    unavailable: AtomicU64,
    contended: AtomicU64,
    skipped_writes: AtomicU64,
    other_errors: AtomicU64,
    /// Check 1 fails the history (else it is only counted).
    exclusion: AtomicBool,
}

#[derive(Default)]
struct Storage {
    /// Last accepted token per resource.
    last: HashMap<String, u64>,
    /// Every accepted write, in the order the storage accepted them.
    accepted: Vec<(String, u64, usize)>,
    rejected: u64,
}

impl History {
    pub fn new(name: impl Into<String>) -> History {
        History {
            inner: Arc::new(Inner {
                name: name.into(),
                origin: Instant::now(),
                clock: AtomicU64::new(0),
                sections: Mutex::default(),
                storage: Mutex::default(),
                failures: Mutex::default(),
                cycles: watch::Sender::new(0),
                lost: AtomicU64::new(0),
                unavailable: AtomicU64::new(0),
                contended: AtomicU64::new(0),
                skipped_writes: AtomicU64::new(0),
                other_errors: AtomicU64::new(0),
                exclusion: AtomicBool::new(true),
            }),
        }
    }

    /// Claims fencing only: overlapping sections whose writes were both accepted are
    /// counted (`overlaps_accepted` in the summary) instead of failing the check. For
    /// faults under which exclusion is not promised (see the module docs).
    pub fn without_exclusion(self) -> History {
        self.inner.exclusion.store(false, Ordering::Relaxed);
        self
    }

    fn tick(&self) -> u64 {
        self.inner.clock.fetch_add(1, Ordering::SeqCst)
    }

    /// Records the start of a critical section: call right after the lease is granted.
    pub fn begin(
        &self,
        resource: impl Into<String>,
        token: u64,
        holder: impl Into<String>,
    ) -> CriticalSection {
        let mut sections = lock(&self.inner.sections);
        let id = sections.len();
        sections.push(Section {
            id,
            resource: resource.into(),
            token,
            holder: holder.into(),
            start: self.tick(),
            end: None,
            started_at: self.inner.origin.elapsed(),
            ended_at: None,
            write: Write::None,
            lost: false,
        });
        CriticalSection {
            history: self.clone(),
            id,
            ended: false,
        }
    }

    /// The storage write of section `id`: accepted only with a token greater than the
    /// last accepted one for the resource.
    fn write(&self, id: usize) -> bool {
        let (resource, token) = {
            let sections = lock(&self.inner.sections);
            (sections[id].resource.clone(), sections[id].token)
        };
        let accepted = {
            let mut storage = lock(&self.inner.storage);
            let last = storage.last.get(&resource).copied();
            if last.is_some_and(|last| token <= last) {
                storage.rejected += 1;
                false
            } else {
                storage.last.insert(resource.clone(), token);
                storage.accepted.push((resource, token, id));
                true
            }
        };
        lock(&self.inner.sections)[id].write = if accepted {
            Write::Accepted
        } else {
            Write::Rejected
        };
        accepted
    }

    fn end(&self, id: usize, lost: bool) {
        let seq = self.tick();
        {
            let mut sections = lock(&self.inner.sections);
            let section = &mut sections[id];
            section.end = Some(seq);
            section.ended_at = Some(self.inner.origin.elapsed());
            section.lost = lost;
        }
        if lost {
            self.inner.lost.fetch_add(1, Ordering::Relaxed);
        }
        self.inner.cycles.send_modify(|n| *n += 1);
    }

    /// Completed critical sections so far.
    pub fn cycles(&self) -> u64 {
        *self.inner.cycles.borrow()
    }

    /// Returns once at least `n` critical sections completed.
    pub async fn cycles_reached(&self, n: u64) {
        let mut rx = self.inner.cycles.subscribe();
        let _ = rx.wait_for(|done| *done >= n).await;
    }

    /// Counts an attempt answered with "no quorum".
    pub fn unavailable(&self) {
        self.inner.unavailable.fetch_add(1, Ordering::Relaxed);
    }

    pub fn unavailable_count(&self) -> u64 {
        self.inner.unavailable.load(Ordering::Relaxed)
    }

    /// Counts an attempt that found the resource held (or timed out waiting).
    pub fn contended(&self) {
        self.inner.contended.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a write the holder skipped because its lease was (nearly) gone.
    pub fn skipped_write(&self) {
        self.inner.skipped_writes.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts another, tolerated error.
    pub fn other_error(&self) {
        self.inner.other_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Rejected stale writes so far.
    pub fn rejected(&self) -> u64 {
        lock(&self.inner.storage).rejected
    }

    /// Records a failure; [`check`](History::check) will panic with it.
    pub fn fail(&self, message: impl Into<String>) {
        lock(&self.inner.failures).push(message.into());
    }

    /// A copy of every section recorded so far.
    pub fn sections(&self) -> Vec<Section> {
        lock(&self.inner.sections).clone()
    }

    /// Checks the history; panics with every violation found, else returns the summary.
    pub fn check(&self) -> Summary {
        let sections = self.sections();
        let storage = lock(&self.inner.storage);
        let mut violations: Vec<String> = lock(&self.inner.failures).clone();
        let exclusion = self.inner.exclusion.load(Ordering::Relaxed);
        let mut overlaps_accepted = 0u64;

        let mut by_resource: HashMap<&str, Vec<&Section>> = HashMap::new();
        for s in &sections {
            by_resource.entry(s.resource.as_str()).or_default().push(s);
        }
        let end_of = |s: &Section| s.end.unwrap_or(u64::MAX);

        for list in by_resource.values() {
            // 1. Overlapping sections whose writes were both accepted.
            let mut accepted: Vec<&Section> = list
                .iter()
                .copied()
                .filter(|s| s.write == Write::Accepted)
                .collect();
            accepted.sort_by_key(|s| s.start);
            let mut latest: Option<&Section> = None;
            for s in accepted {
                if let Some(prev) = latest {
                    if s.start < end_of(prev) && !exclusion {
                        overlaps_accepted += 1;
                    } else if s.start < end_of(prev) {
                        violations.push(format!(
                            "overlapping critical sections, both writes accepted:\n    {prev}\n    {s}"
                        ));
                    }
                }
                if latest.is_none_or(|prev| end_of(s) > end_of(prev)) {
                    latest = Some(s);
                }
            }

            // 3. A section that started after another ended must have a greater token.
            let mut by_start = list.clone();
            by_start.sort_by_key(|s| s.start);
            let mut by_end: Vec<&Section> =
                list.iter().copied().filter(|s| s.end.is_some()).collect();
            by_end.sort_by_key(|s| end_of(s));
            let mut ended = by_end.iter().peekable();
            let mut max_before: Option<&Section> = None;
            for s in by_start {
                while let Some(e) = ended.next_if(|e| end_of(e) < s.start) {
                    if max_before.is_none_or(|m| e.token > m.token) {
                        max_before = Some(e);
                    }
                }
                if let Some(m) = max_before
                    && s.token <= m.token
                {
                    violations.push(format!(
                            "fencing order broken: a later holder got a token not greater than an earlier one:\n    {m}\n    {s}"
                        ));
                }
            }
        }

        // 2. Accepted tokens strictly increase per resource, in acceptance order.
        let mut last: HashMap<&str, (u64, usize)> = HashMap::new();
        for (resource, token, id) in &storage.accepted {
            if let Some(&(prev, prev_id)) = last.get(resource.as_str())
                && *token <= prev
            {
                violations.push(format!(
                        "non-increasing accepted token on `{resource}`: {prev} (#{prev_id}) then {token} (#{id})"
                    ));
            }
            last.insert(resource, (*token, *id));
        }

        if !violations.is_empty() {
            let shown = violations.len().min(20);
            panic!(
                "history checker `{}`: {} violation(s) in {} critical sections (first {shown}):\n  - {}",
                self.inner.name,
                violations.len(),
                sections.len(),
                violations[..shown].join("\n  - ")
            );
        }

        let summary = Summary {
            scenario: self.inner.name.clone(),
            cycles: sections.iter().filter(|s| s.end.is_some()).count() as u64,
            lost_leases: self.inner.lost.load(Ordering::Relaxed),
            rejected_stale_writes: storage.rejected,
            unavailable: self.inner.unavailable.load(Ordering::Relaxed),
            contended: self.inner.contended.load(Ordering::Relaxed),
            skipped_writes: self.inner.skipped_writes.load(Ordering::Relaxed),
            other_errors: self.inner.other_errors.load(Ordering::Relaxed),
            accepted_writes: storage.accepted.len() as u64,
            violations: 0,
            elapsed: self.inner.origin.elapsed(),
            notes: Vec::new(),
        };
        if exclusion {
            summary
        } else {
            summary.note("overlaps_accepted", overlaps_accepted)
        }
    }
}

/// A critical section in progress. Recording its end on drop covers a holder whose
/// task was aborted inside it.
pub struct CriticalSection {
    history: History,
    id: usize,
    ended: bool,
}

impl CriticalSection {
    /// The section's id in the history.
    pub fn id(&self) -> usize {
        self.id
    }

    /// Writes to the fenced storage; returns whether it was accepted.
    pub fn write(&mut self) -> bool {
        self.history.write(self.id)
    }

    /// Leaves the section; `lost` says whether the holder saw its lease lost.
    pub fn end(mut self, lost: bool) {
        self.ended = true;
        self.history.end(self.id, lost);
    }
}

impl Drop for CriticalSection {
    fn drop(&mut self) {
        if !self.ended {
            self.history.end(self.id, false);
        }
    }
}

/// The figures of one scenario, printed at its end.
#[derive(Debug, Clone)]
pub struct Summary {
    pub scenario: String,
    /// Completed critical sections.
    pub cycles: u64,
    /// Critical sections whose holder saw its lease lost.
    pub lost_leases: u64,
    pub rejected_stale_writes: u64,
    /// Attempts answered with "no quorum" (`LockError::Unavailable`).
    pub unavailable: u64,
    /// Attempts that found the resource held or timed out waiting.
    pub contended: u64,
    /// Writes skipped by holders that saw their lease (nearly) gone.
    pub skipped_writes: u64,
    pub other_errors: u64,
    pub accepted_writes: u64,
    /// Always 0: the checker panics otherwise.
    pub violations: usize,
    pub elapsed: Duration,
    /// Scenario-specific figures.
    pub notes: Vec<(String, String)>,
}

impl Summary {
    /// Adds a scenario-specific figure.
    pub fn note(mut self, name: impl Into<String>, value: impl fmt::Display) -> Self {
        self.notes.push((name.into(), value.to_string()));
        self
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[faults] {}: cycles={} lost_leases={} rejected_stale_writes={} unavailable={} contended={} skipped_writes={} other_errors={} accepted_writes={} violations={} elapsed={:.2}s",
            self.scenario,
            self.cycles,
            self.lost_leases,
            self.rejected_stale_writes,
            self.unavailable,
            self.contended,
            self.skipped_writes,
            self.other_errors,
            self.accepted_writes,
            self.violations,
            self.elapsed.as_secs_f64()
        )?;
        for (name, value) in &self.notes {
            write!(f, " {name}={value}")?;
        }
        Ok(())
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
