//! [`LockLayer`]: the builder of the layer's settings (the policies are in `policy.rs`),
//! and the settings its services and futures share.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::Method;
use tower_layer::Layer;

use super::key::{KeyExtractor, OneKey};
use super::policy::{Contention, MissingKey, OnDisconnect, OnLost, Scope, Unavailable};
use super::problem::{DefaultRenderer, Problem, ProblemKind, ProblemRenderer};
use super::replay::{Replay, Replaying};
use super::service::LockService;
use crate::error::ConfigError;
use crate::{LockMode, Redlock};

/// A [`Layer`] that runs each request under a Redlock lease named after its key.
///
/// The lease's time to live, node timeout, watchdog and so on are the locker's
/// ([`LockOptions`](crate::LockOptions)); the layer decides which requests lock what,
/// and what the client hears when they cannot. See the [module documentation](super)
/// for the behaviour and an example.
///
/// Cheap to clone: clones share the locker and the settings.
#[derive(Clone, Debug)]
pub struct LockLayer<K> {
    key: K,
    settings: Arc<Settings>,
}

impl<K> LockLayer<K> {
    /// A layer locking on the keys `key` finds ([`KeyExtractor`]: one resource per key,
    /// several locked together as one lease), with `locker`.
    ///
    /// The defaults are each builder method's (the table of [the
    /// guide](crate::guide::operations#the-layer)).
    pub fn new(locker: Redlock, key: K) -> Self {
        crate::metrics::http_series(ProblemKind::ALL.map(ProblemKind::code), false, "");
        LockLayer {
            key,
            settings: Arc::new(Settings::new(locker)),
        }
    }

    fn settings(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }

    setters!(settings {
        /// Whether to answer or to wait when the lock is held (default [`Contention::Reject`]).
        contention: Contention;

        /// The response header that carries the lease's fencing token (default
        /// `Fencing-Token`, in the format of [Several keys per request](super#several-keys-per-request);
        /// `None` for none). The handler always finds the
        /// [`LeaseHandle`](crate::LeaseHandle), with the token, in the request extensions.
        fencing_header: Option<HeaderName>;

        /// What requests without a key do (default [`MissingKey::Reject`]).
        missing_key: MissingKey;

        /// What happens when the lease is lost while the handler runs (default
        /// [`OnLost::Abort`]).
        on_lost: OnLost;

        /// What happens to a handler holding its lease when the client goes away (default
        /// [`OnDisconnect::Finish`]: it runs to its end, then the lease is released).
        on_disconnect: OnDisconnect;

        /// Keep the lease until the response body has been produced (default `true`; see
        /// [Lease lifetime](super#lease-lifetime)). With `false` the lease is released as
        /// soon as the handler returns its response, before the response is sent.
        hold_through_body: bool;

        /// Which requests share a lock (default [`Scope::Route`]).
        scope: Scope;

        /// The longest key accepted, in bytes (default 255); longer keys get 400 `key-invalid`.
        max_key_len: usize;

        /// What requests do when the lock store cannot decide (default
        /// [`Unavailable::FailClosed`]).
        on_unavailable: Unavailable;

        /// Answers the refusals of the handler's own extractors in the layer's format
        /// (default `false`): a handler response with status 400, 415 or 422, a
        /// `Content-Type` of `text/plain` and a body of at most 4 KiB — what axum's
        /// extractor rejections are — is sent as the problem `bad-request`,
        /// `unsupported-media-type` or `unprocessable-content`, rendered by the layer's
        /// [`problem_renderer`](Self::problem_renderer), with the text as its `detail`
        /// (a handler's own `text/plain` answer with those statuses too: axum's rejections
        /// carry no mark of their own). Not applied to replayed layers, whose responses are
        /// recorded as the handler made them.
        problem_for_rejections: bool;
    });

    /// How every request shares the lock on its key (default [`LockMode::Exclusive`];
    /// [`LockMode::Counted`] refuses with 429 `limit-reached`). Sets the mode of reads
    /// too: call [`read_mode`](Self::read_mode) after it to give them another.
    ///
    /// # Panics
    ///
    /// When a node of the locker cannot keep shared or counted leases
    /// ([`Redlock::check_mode`] says it beforehand), or the layer replays responses
    /// (exclusive locks only).
    #[must_use]
    #[track_caller]
    pub fn mode(mut self, mode: LockMode) -> Self {
        self.check_mode(mode);
        self.settings().modes = Modes {
            safe: mode,
            other: mode,
        };
        self
    }

    /// How requests that only read (`GET`, `HEAD`, `OPTIONS`, `TRACE`) share the lock on
    /// their key; the other methods keep [`mode`](Self::mode)'s (exclusive by default).
    /// With [`LockMode::Shared`], `GET /reports/{id}` runs beside other `GET`s of the
    /// report and never beside a `PUT` regenerating it.
    ///
    /// # Panics
    ///
    /// As [`mode`](Self::mode).
    #[must_use]
    #[track_caller]
    pub fn read_mode(mut self, mode: LockMode) -> Self {
        self.check_mode(mode);
        self.settings().modes.safe = mode;
        self
    }

    #[track_caller]
    fn check_mode(&self, mode: LockMode) {
        if let Err(error) = self.settings.locker.check_mode(mode) {
            panic!("LockLayer::mode: {error}");
        }
        if !mode.is_exclusive() && self.settings.replay.is_some() {
            panic!(
                "LockLayer::mode: a replaying layer takes exclusive locks only (one execution \
                 per key is what it records); {mode:?} locks cannot be replayed"
            );
        }
    }

    /// How many requests of this process may wait for one resource at once under
    /// [`Contention::Wait`]; more get 503 `lock-queue-full`. Default: the locker's
    /// [`LockOptions::max_waiters`](crate::LockOptions::max_waiters), 1000 unless set.
    #[must_use]
    pub fn queue_limit(mut self, limit: usize) -> Self {
        let settings = self.settings();
        settings.locker = settings.locker.with_max_waiters(limit);
        self
    }

    /// Names this layer in the metrics it records (the `layer` label of
    /// `tower_redlock_http_refusals_total`, see [`metrics`](crate::metrics)), so that an
    /// operator sees which endpoint is contended or refused. A bounded name the
    /// application chooses ("exports", "payments"), never a key; default empty.
    #[must_use]
    pub fn name(mut self, name: impl Into<Arc<str>>) -> Self {
        let name = name.into();
        crate::metrics::http_series(ProblemKind::ALL.map(ProblemKind::code), false, &name);
        self.settings().name = name;
        self
    }

    /// Renders the problem responses (default [`DefaultRenderer`](super::problem::DefaultRenderer), RFC 9457 JSON):
    /// the layer's, and those of the [`Locked`](crate::axum::Locked) extractors of the
    /// handlers behind it.
    #[must_use]
    pub fn problem_renderer(mut self, renderer: impl ProblemRenderer) -> Self {
        let settings = self.settings();
        settings.renderer = Arc::new(renderer);
        settings.own_renderer = true;
        self
    }

    /// Turns on idempotent replay (see [`replay`](super::replay) for the behaviour and
    /// [`Replay`] for the options). Replay takes one key per request: a multi-key
    /// extractor does not compile here. The layer reads the request body when the
    /// fingerprint covers it, so its request bodies are `From<Bytes>` with `Bytes` data,
    /// as axum's ([`Replaying`]).
    ///
    /// # Panics
    ///
    /// When [`try_replay`](Self::try_replay) fails, as axum's `Router::route` panics on a
    /// route it cannot add.
    #[track_caller]
    pub fn replay(self, replay: Replay) -> LockLayer<Replaying<K>>
    where
        K: KeyExtractor,
        K::Keys: OneKey,
    {
        match self.try_replay(replay) {
            Ok(layer) => layer,
            Err(error) => panic!("LockLayer::replay: {error}"),
        }
    }

    /// [`replay`](Self::replay), refusing with a [`ConfigError`] what it cannot serve: a
    /// node that stores no outcome records ([`Node::records`](crate::node::Node::records)
    /// is `None`), records in PostgreSQL without fencing tokens, or shared locks.
    pub fn try_replay(self, replay: Replay) -> Result<LockLayer<Replaying<K>>, ConfigError>
    where
        K: KeyExtractor,
        K::Keys: OneKey,
    {
        let ttl = self.settings.locker.options().get_ttl();
        let replay = Arc::new(replay.resolved(ttl));
        if replay.on_nodes() {
            self.settings.locker.check_records()?;
        } else if !self.settings.locker.options().fencing {
            // Records in PostgreSQL tell holders apart by their tokens alone.
            return Err(ConfigError::new(
                "replay's records in PostgreSQL (Replay::records_in) need fencing tokens, \
                 and this locker has none (LockOptions::fencing(false))",
            ));
        }
        if !self.settings.modes.exclusive() {
            return Err(ConfigError::new(
                "a replaying layer takes exclusive locks only (one execution per key is what \
                 it records); this layer shares its locks (LockLayer::mode, read_mode)",
            ));
        }
        let mut layer = LockLayer {
            key: Replaying(self.key),
            settings: self.settings,
        };
        layer.settings().replay = Some(replay);
        crate::metrics::http_series([], true, "");
        Ok(layer)
    }

    /// The key extractor.
    pub fn key(&self) -> &K {
        &self.key
    }

    /// The locker.
    pub fn locker(&self) -> &Redlock {
        &self.settings.locker
    }
}

impl<S, K: Clone> Layer<S> for LockLayer<K> {
    type Service = LockService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService::from_parts(inner, self.key.clone(), self.settings.clone())
    }
}

/// The default [`LockLayer::fencing_header`](super::LockLayer::fencing_header):
/// `Fencing-Token`.
pub const FENCING_TOKEN: HeaderName = HeaderName::from_static("fencing-token");

/// The default [`LockLayer::max_key_len`](super::LockLayer::max_key_len): 255 bytes.
pub(crate) const DEFAULT_MAX_KEY_LEN: usize = 255;

/// Everything the layer's services and futures share.
#[derive(Clone, Debug)]
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
    pub(crate) replay: Option<Arc<Replay>>,
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
