//! The markers the layer leaves in requests and responses.

use std::fmt;
use std::sync::Arc;

use crate::FencingToken;
use crate::{LeaseHandle, LockMode, LostCause, Redlock, Resource};

/// The lease was lost, and why.
///
/// A response extension when the handler's response was passed on anyway
/// ([`OnLost::Continue`](super::OnLost::Continue), or a handler that finished just as
/// the loss was noticed); the error a [`LeaseBody`](super::LeaseBody) ends with when
/// its lease is lost mid-stream under [`OnLost::Abort`](super::OnLost::Abort).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLost(pub LostCause);

impl fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the lease was lost: {}", self.0)
    }
}

impl std::error::Error for LeaseLost {}

/// A request extension: the key [`LockLayer`](super::LockLayer) found in this request and locked on, as
/// the extractor read it (for `Idempotency-Key`, without the quotes of the structured
/// form; for a JSON field, a number as its decimal text).
///
/// Handlers should use it rather than read the key again from the request: a second
/// reading can differ from the layer's (a number read as a string, a quoted header),
/// and then the handler acts on another key than the one the lock protects.
///
/// ```
/// use axum::Extension;
/// use tower_redlock::http::RequestKey;
///
/// async fn handler(Extension(key): Extension<RequestKey>) -> String {
///     format!("processing {}", key.as_str())
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestKey(pub Arc<str>);

impl RequestKey {
    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A request extension under [idempotent replay](super::replay): an earlier attempt
/// with this request's key was interrupted — its lease lost, its process gone — before
/// it recorded a response, and this request runs the handler again.
///
/// Whether the interrupted attempt took effect is unknown: a payment handler that
/// charges before its slow part may have charged. Ask your own store, by the attempt's
/// fencing token (which the attempt wrote with its effects), before repeating it: the
/// [replay guide](crate::guide::replay) shows how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InterruptedAttempt {
    token: FencingToken,
}

impl InterruptedAttempt {
    pub(crate) fn new(token: FencingToken) -> Self {
        InterruptedAttempt { token }
    }

    /// The interrupted attempt's fencing token (the one its handler saw).
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// When the interrupted attempt took its lock, to the millisecond, read from its
    /// token: with fencing on, the default, a token is made from the acquiring
    /// client's clock (see [`fencing`](crate::fencing)). `None` for a token that
    /// does not carry a time (etcd's revisions, `LockOptions::fencing(false)`).
    pub fn started_at(&self) -> Option<std::time::SystemTime> {
        // A clock floor is `unix_ms × 2¹⁰`; tokens below 2020 carry no time.
        const SINCE_2020_MS: u64 = 1_577_836_800_000;
        let unix_ms = self.token.get() >> 10;
        (unix_ms >= SINCE_2020_MS)
            .then(|| std::time::UNIX_EPOCH + std::time::Duration::from_millis(unix_ms))
    }
}

/// A request extension: the handler runs without a lock, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unlocked {
    /// The request has no key and the layer lets such requests through
    /// ([`MissingKey::Bypass`](super::MissingKey::Bypass)).
    MissingKey,
    /// The lock store could not decide and the layer fails open
    /// ([`Unavailable::FailOpen`](super::Unavailable::FailOpen)).
    StoreUnavailable,
}

/// A request extension: the keys a multi-key extractor found in this request and the
/// layer locked, each with the [`Resource`] it names, in the extractor's order (a key
/// given twice appears once). A single-key extractor leaves a [`RequestKey`] instead.
///
/// The handler finds each resource's fencing token on the lease,
/// `lease.fencing_token_of(keys.resource("acct-1")?)` (see the [module
/// documentation](super#several-keys-per-request)), or, for resources the request held
/// already, with [`RequestLeases::fencing_token_of`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestKeys(Arc<[(Arc<str>, Resource)]>);

impl RequestKeys {
    pub(crate) fn new(keys: Vec<(Arc<str>, Resource)>) -> Self {
        RequestKeys(keys.into())
    }

    /// The keys and their resources.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &Resource)> + '_ {
        self.0.iter().map(|(key, resource)| (&**key, resource))
    }

    /// The resource `key` names, when it is one of the keys.
    pub fn resource(&self, key: &str) -> Option<&Resource> {
        self.0
            .iter()
            .find(|(found, _)| &**found == key)
            .map(|(_, resource)| resource)
    }

    /// The number of keys.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// `true` when there is no key (never, for a request the layer locked).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A request extension: every lease this request holds, taken by a
/// [`LockLayer`](super::LockLayer) or by a `Locked` extractor (feature `axum`), in the
/// order they were taken.
///
/// It makes locks reentrant within a request: a layer or extractor asked for resources
/// that a lease of this request already holds — granted by the same locker (or a clone
/// of it), and named the same, so under the same [`Scope`](super::Scope) — reuses that
/// lease: no second acquisition, no waiting for itself, and the lease is released with
/// its owner (the layer's when its response ends, the extractor's with the handler).
/// Resources no lease of the request holds are acquired as usual.
///
/// Handlers read the fencing token of any resource the request holds here
/// ([`fencing_token_of`](Self::fencing_token_of)).
#[derive(Clone, Default)]
pub struct RequestLeases {
    // Most requests hold one lease: it is kept inline, without allocating.
    first: Option<LeaseHandle>,
    more: Vec<LeaseHandle>,
}

impl RequestLeases {
    /// The leases, in the order they were taken.
    pub fn iter(&self) -> impl Iterator<Item = &LeaseHandle> + '_ {
        self.first.iter().chain(&self.more)
    }

    /// The fencing token of `resource`, when a lease of this request holds it.
    pub fn fencing_token_of(&self, resource: &Resource) -> Option<FencingToken> {
        self.iter()
            .find_map(|lease| lease.fencing_token_of(resource))
    }

    /// The leases of this request granted by `locker` that serve `mode`: held in it, or
    /// exclusively (a request holding a reader's lease cannot write under it).
    fn serving<'a>(
        &'a self,
        locker: &'a Redlock,
        mode: LockMode,
    ) -> impl Iterator<Item = &'a LeaseHandle> + 'a {
        let serves = move |lease: &&LeaseHandle| {
            locker.granted(lease) && (lease.mode().is_exclusive() || lease.mode() == mode)
        };
        self.iter().filter(serves)
    }

    /// The lease of this request, granted by `locker`, that holds every resource of
    /// `resources` in `mode` or exclusively, if there is one.
    pub(crate) fn covering<'a>(
        &'a self,
        locker: &'a Redlock,
        resources: &[Resource],
        mode: LockMode,
    ) -> Option<&'a LeaseHandle> {
        self.serving(locker, mode).find(|lease| {
            resources
                .iter()
                .all(|r| lease.fencing_token_of(r).is_some())
        })
    }

    /// The leases of this request, granted by `locker`, that hold some of `resources`
    /// in `mode` or exclusively.
    pub(crate) fn holding<'a>(
        &'a self,
        locker: &'a Redlock,
        resources: &'a [Resource],
        mode: LockMode,
    ) -> impl Iterator<Item = &'a LeaseHandle> + 'a {
        self.serving(locker, mode).filter(move |lease| {
            resources
                .iter()
                .any(|r| lease.fencing_token_of(r).is_some())
        })
    }

    /// Adds `lease`, unless it is there already.
    pub(crate) fn add(&mut self, lease: &LeaseHandle) {
        if self
            .iter()
            .any(|held| std::ptr::eq(held.lease_inner(), lease.lease_inner()))
        {
            return;
        }
        match self.first {
            None => self.first = Some(lease.clone()),
            Some(_) => self.more.push(lease.clone()),
        }
    }
}

impl fmt::Debug for RequestLeases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Records `lease` among the leases of the request with `extensions`.
pub(crate) fn add_request_lease(extensions: &mut http::Extensions, lease: &LeaseHandle) {
    match extensions.get_mut::<RequestLeases>() {
        Some(leases) => leases.add(lease),
        None => {
            let mut leases = RequestLeases::default();
            leases.add(lease);
            extensions.insert(leases);
        }
    }
}

/// Every lease of the request, each resource with its token: a guarded write under
/// [`RequestLeases`] advances the fence of every resource the request holds.
impl crate::fence::Fenced for RequestLeases {
    fn tokens(&self) -> Vec<(Resource, FencingToken)> {
        let mut tokens: Vec<(Resource, FencingToken)> = Vec::new();
        for lease in self.iter() {
            for (resource, token) in lease.fencing_tokens() {
                if !tokens.iter().any(|(held, _)| held == resource) {
                    tokens.push((resource.clone(), token));
                }
            }
        }
        tokens
    }

    fn mode(&self) -> LockMode {
        self.iter()
            .map(|lease| lease.mode())
            .find(|mode| !mode.is_exclusive())
            .unwrap_or_default()
    }
}
