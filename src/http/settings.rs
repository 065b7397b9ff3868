//! What the layer's services and futures share: the locker and the layer's settings.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::Method;

use super::policy::{Contention, MissingKey, OnDisconnect, OnLost, Scope, Unavailable};
use super::problem::{DefaultRenderer, Problem, ProblemRenderer};
use super::replay::ReplaySettings;
use crate::{LockMode, Redlock};

/// The default [`LockLayer::fencing_header`](super::LockLayer::fencing_header):
/// `Fencing-Token`.
pub const FENCING_TOKEN: HeaderName = HeaderName::from_static("fencing-token");

/// The default [`LockLayer::max_key_len`](super::LockLayer::max_key_len): 255 bytes.
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// Everything the layer's services and futures share.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) locker: Redlock,
    pub(crate) contention: Contention,
    pub(crate) fencing_header: Option<HeaderName>,
    pub(crate) missing_key: MissingKey,
    pub(crate) on_lost: OnLost,
    pub(crate) on_disconnect: OnDisconnect,
    pub(crate) hold_through_body: bool,
    pub(crate) scope: Scope,
    pub(crate) max_key_len: usize,
    pub(crate) on_unavailable: Unavailable,
    pub(crate) renderer: Arc<dyn ProblemRenderer>,
    /// Set by `problem_renderer`: passed on to the `Locked` extractors behind.
    pub(crate) own_renderer: bool,
    pub(crate) problem_for_rejections: bool,
    pub(crate) replay: Option<Arc<ReplaySettings>>,
    pub(crate) modes: Modes,
    pub(crate) sections: Arc<Sections>,
    /// The `layer` label of its metrics.
    pub(crate) name: Arc<str>,
}

/// How a request locks its key, by method: `safe` for the methods that only read
/// (`GET`, `HEAD`, `OPTIONS`, `TRACE`), `other` for the rest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Modes {
    pub(crate) safe: LockMode,
    pub(crate) other: LockMode,
}

impl Modes {
    pub(crate) fn of(&self, method: &Method) -> LockMode {
        if method.is_safe() {
            self.safe
        } else {
            self.other
        }
    }

    pub(crate) fn exclusive(&self) -> bool {
        self.safe.is_exclusive() && self.other.is_exclusive()
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("locker", &self.locker)
            .field("contention", &self.contention)
            .field("fencing_header", &self.fencing_header)
            .field("missing_key", &self.missing_key)
            .field("on_lost", &self.on_lost)
            .field("on_disconnect", &self.on_disconnect)
            .field("hold_through_body", &self.hold_through_body)
            .field("scope", &self.scope)
            .field("max_key_len", &self.max_key_len)
            .field("on_unavailable", &self.on_unavailable)
            .field("replay", &self.replay)
            .field("modes", &self.modes)
            .field("name", &self.name)
            .field("problem_for_rejections", &self.problem_for_rejections)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// The defaults of [`LockLayer::new`](super::LockLayer::new).
    pub(crate) fn new(locker: Redlock) -> Self {
        Settings {
            locker,
            contention: Contention::default(),
            fencing_header: Some(FENCING_TOKEN),
            missing_key: MissingKey::default(),
            on_lost: OnLost::default(),
            on_disconnect: OnDisconnect::default(),
            hold_through_body: true,
            scope: Scope::default(),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            on_unavailable: Unavailable::default(),
            renderer: Arc::new(DefaultRenderer),
            own_renderer: false,
            problem_for_rejections: false,
            replay: None,
            modes: Modes::default(),
            sections: Arc::default(),
            name: Arc::from(""),
        }
    }
}

/// How long the layer's critical sections (its handlers) typically take, in this
/// process: a moving mean in µs (each section weighs 1/8), 0 before the first. A
/// refused client is told to come back then, rather than after the holder's ttl, which
/// renewal keeps near the full ttl while sections are much shorter.
#[derive(Debug, Default)]
pub(crate) struct Sections(AtomicU64);

impl Sections {
    pub(crate) fn record(&self, took: Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
        let mean = |mean: u64| {
            Some(if mean == 0 {
                sample
            } else {
                mean - mean / 8 + sample / 8
            })
        };
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, mean);
    }

    /// A contention refusal's `Retry-After`: the typical section, at least 1 s, never
    /// past the holder's remaining ttl (the problem's delay so far).
    pub(crate) fn retry_after(&self, problem: Problem) -> Problem {
        match (self.0.load(Ordering::Relaxed), problem.retry_after()) {
            (0, _) | (_, None) => problem,
            (mean, Some(holder_ttl)) => {
                let typical = Duration::from_micros(mean).max(Duration::from_secs(1));
                problem.with_retry_after(typical.min(holder_ttl))
            }
        }
    }
}
