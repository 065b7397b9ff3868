//! [`Locked`] and the traits that name its lock, [`LockKey`] and [`LockSpec`].

use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;

use ::axum::extract::{FromRef, FromRequestParts};
use http::request::Parts;

use super::LockRejection;
use crate::http::acquire::{missing_key, name, take, Taken};
use crate::http::detach::Critical;
use crate::http::extensions::add_request_lease;
use crate::http::key::{HeadOnly, KeyExtractor};
use crate::http::problem::{LayerRenderer, Problem};
use crate::http::{Contention, Scope, DEFAULT_MAX_KEY_LEN};
use crate::FencingToken;
use crate::{Lease, LeaseHandle, LockMode, Redlock, Resource};

/// Names the lock a [`Locked`] extractor takes: where the key comes from, which
/// requests share the lock, and what to do when it is held.
///
/// Implement it on a marker type; the handler's signature then says which lock it runs
/// under (`Locked<OrderId>`). Only [`extractor`](LockKey::extractor) is required; the
/// defaults are those of [`LockLayer::new`](crate::http::LockLayer::new).
///
/// ```
/// use std::time::Duration;
/// use tower_redlock::axum::LockKey;
/// use tower_redlock::http::{key::{header, Header}, Contention, Scope};
///
/// /// Requests with the same `Idempotency-Key` on any route share one lock, and wait
/// /// up to 2 s for it.
/// struct IdempotencyKey;
///
/// impl LockKey for IdempotencyKey {
///     type Extractor = Header;
///
///     fn extractor() -> Header {
///         header("Idempotency-Key")
///     }
///
///     fn scope() -> Scope {
///         Scope::shared("idempotency")
///     }
///
///     fn contention() -> Contention {
///         Contention::Wait { timeout: Duration::from_secs(2) }
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not name a lock",
    label = "`Locked<{Self}>` needs `{Self}: LockKey`",
    note = "implement `LockKey` for `{Self}` (its `extractor()`, optionally `scope()` and `contention()`), or `LockSpec<S>` to read them from the state",
    note = "see https://docs.rs/tower-redlock/latest/tower_redlock/axum/trait.LockKey.html"
)]
pub trait LockKey: Send + Sync + 'static {
    /// The type of [`extractor`](LockKey::extractor): any
    /// [`KeyExtractor`](crate::http::key::KeyExtractor) of the request head
    /// (`type Body = ()`); body keys need a [`LockLayer`](crate::http::LockLayer).
    type Extractor: KeyExtractor<Body: HeadOnly>;

    /// Finds the key in the request head. Called once per request.
    fn extractor() -> Self::Extractor;

    /// Which requests share a lock (default [`Scope::Route`]: method, matched route and
    /// key, the same resource a [`LockLayer`](crate::http::LockLayer) on that route locks).
    fn scope() -> Scope {
        Scope::Route
    }

    /// Whether to refuse or to wait when the lock is held (default
    /// [`Contention::Reject`]).
    fn contention() -> Contention {
        Contention::Reject
    }

    /// The longest key accepted, in bytes (default 255).
    fn max_key_len() -> usize {
        DEFAULT_MAX_KEY_LEN
    }

    /// How the lease shares its resource (default [`LockMode::Exclusive`]; a multi-key
    /// extractor takes exclusive leases only).
    fn mode() -> LockMode {
        LockMode::Exclusive
    }
}

/// The lock a [`Locked`] extractor takes, configured from the router's state `S` at
/// run time: the general form of [`LockKey`], whose settings are fixed in the code.
///
/// Every [`LockKey`] is a `LockSpec<S>` for any state. Implement `LockSpec` instead when
/// the settings come from configuration read at start: they are read on every request.
///
/// ```
/// use std::time::Duration;
/// use axum::extract::FromRef;
/// use tower_redlock::axum::LockSpec;
/// use tower_redlock::http::{key::{path_param, PathParam}, Contention, Scope};
/// use tower_redlock::Redlock;
///
/// #[derive(Clone)]
/// struct AppState {
///     locker: Redlock,
///     transfer_wait: Duration, // read from the environment at start
/// }
///
/// impl FromRef<AppState> for Redlock {
///     fn from_ref(state: &AppState) -> Redlock {
///         state.locker.clone()
///     }
/// }
///
/// struct AccountId;
///
/// impl LockSpec<AppState> for AccountId {
///     type Extractor = PathParam;
///
///     fn extractor(_state: &AppState) -> PathParam {
///         path_param("id")
///     }
///
///     fn scope(_state: &AppState) -> Scope {
///         Scope::shared("account")
///     }
///
///     fn contention(state: &AppState) -> Contention {
///         Contention::Wait { timeout: state.transfer_wait }
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not name a lock for the state `{S}`",
    label = "`Locked<{Self}>` needs `{Self}: LockKey` (or `LockSpec<{S}>`)",
    note = "implement `LockKey` for `{Self}` (its `extractor()`, optionally `scope()` and `contention()`), or `LockSpec<{S}>` to read them from the state",
    note = "see https://docs.rs/tower-redlock/latest/tower_redlock/axum/trait.LockKey.html"
)]
pub trait LockSpec<S>: Send + Sync + 'static {
    /// [`LockKey::Extractor`].
    type Extractor: KeyExtractor<Body: HeadOnly>;

    /// [`LockKey::extractor`].
    fn extractor(state: &S) -> Self::Extractor;

    /// [`LockKey::scope`].
    fn scope(_state: &S) -> Scope {
        Scope::Route
    }

    /// [`LockKey::contention`].
    fn contention(_state: &S) -> Contention {
        Contention::Reject
    }

    /// [`LockKey::max_key_len`].
    fn max_key_len(_state: &S) -> usize {
        DEFAULT_MAX_KEY_LEN
    }

    /// [`LockKey::mode`].
    fn mode(_state: &S) -> LockMode {
        LockMode::Exclusive
    }
}

impl<K: LockKey, S> LockSpec<S> for K {
    type Extractor = K::Extractor;

    fn extractor(_state: &S) -> K::Extractor {
        K::extractor()
    }

    fn scope(_state: &S) -> Scope {
        K::scope()
    }

    fn contention(_state: &S) -> Contention {
        K::contention()
    }

    fn max_key_len(_state: &S) -> usize {
        K::max_key_len()
    }

    fn mode(_state: &S) -> LockMode {
        K::mode()
    }
}

/// An extractor that holds a lease on the lock named by `K` while the handler runs
/// ([the guide](crate::guide::keys#taking-the-lock-inside-the-handler)).
///
/// The locker comes from the router's state (`Redlock: FromRef<S>`, as in [`LockSpec`]'s
/// example, or `#[derive(FromRef)]`, axum's `macros` feature). The keys are read
/// from the request head by `K`'s extractor and checked, named and refused as the layer
/// does (same resources under the same [`Scope`], same [`LockRejection`] problems,
/// rendered by the [`problem_renderer`](crate::http::LockLayer::problem_renderer) of a
/// layer the request passed through); resources the request already holds are reused.
///
/// `Locked` derefs to the [`LeaseHandle`]; the lease is released in the background when
/// `Locked` drops with the handler's future. Unlike the layer, it cannot stop the
/// handler when the lease is lost (race [`lost`](crate::LeaseHandle::lost), as below),
/// nor does it add a `Fencing-Token` header ([`FencingToken`] implements
/// `IntoResponseParts`). Put [`FinishOnDisconnectLayer`](crate::http::FinishOnDisconnectLayer)
/// on the route so that a client hanging up does not cut the handler in half.
///
/// ```
/// # use tower_redlock::http::key::{header, Header};
/// # struct IdempotencyKey;
/// # impl tower_redlock::axum::LockKey for IdempotencyKey {
/// #     type Extractor = Header;
/// #     fn extractor() -> Header { header("Idempotency-Key") }
/// # }
/// use axum::{http::StatusCode, routing::post, Json, Router};
/// use serde_json::{json, Value};
/// use tower_redlock::axum::Locked;
/// use tower_redlock::{FencingToken, Redlock};
///
/// async fn charge(
///     lock: Locked<IdempotencyKey>,
/// ) -> Result<(FencingToken, Json<Value>), StatusCode> {
///     let token = lock.fencing_token();
///     tokio::select! {
///         // The lock is gone: stop before writing anything else.
///         _ = lock.lost() => Err(StatusCode::SERVICE_UNAVAILABLE),
///         charged = async { /* write, passing `token` to the storage */ 1234 } => {
///             // `token` first: the response gets a `Fencing-Token` header too.
///             Ok((token, Json(json!({ "charged": charged, "fencing_token": token.to_string() }))))
///         }
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app: Router = Router::new()
///     .route("/charges", post(charge))
///     .with_state(Redlock::in_memory());
/// # let _ = app;
/// # }
/// ```
pub struct Locked<K> {
    /// What this extractor acquired; `None` when the request held every resource.
    lease: Option<Lease>,
    /// The lease the handle derefs to: the own one, else the request's reused one.
    handle: LeaseHandle,
    /// The request's leases this lock reuses for resources it already held.
    reused: Vec<LeaseHandle>,
    /// The resources of this lock, in the extractor's order.
    resources: Arc<[Resource]>,
    // `fn() -> K`: the marker is never stored, so it does not decide Send or Sync.
    key: PhantomData<fn() -> K>,
}

impl<K> Locked<K> {
    /// The lease this extractor acquired, or `None` when the request already held all
    /// of its resources (a layer's or another extractor's lease, reused).
    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref()
    }

    /// The lease this extractor acquired, to keep beyond the handler or to release early
    /// and await the outcome; `None` when it reused the request's lease (see
    /// [`lease`](Locked::lease)), which stays its owner's.
    pub fn into_lease(self) -> Option<Lease> {
        self.lease
    }

    /// The leases of this request that this lock reuses for resources the request
    /// already held (empty when it acquired everything itself).
    pub fn reused(&self) -> &[LeaseHandle] {
        &self.reused
    }

    /// The resources of this lock, one per distinct key, in the extractor's order.
    pub fn resources(&self) -> &[Resource] {
        &self.resources
    }

    /// The fencing token of `resource`, when this lock holds it (its own lease or a
    /// reused one).
    pub fn fencing_token_of(&self, resource: &Resource) -> Option<FencingToken> {
        if !self.resources.contains(resource) {
            return None;
        }
        self.lease
            .iter()
            .map(|lease| &**lease)
            .chain(&self.reused)
            .find_map(|lease| lease.fencing_token_of(resource))
    }
}

impl<K> Deref for Locked<K> {
    type Target = LeaseHandle;

    fn deref(&self) -> &LeaseHandle {
        &self.handle
    }
}

impl<K> fmt::Debug for Locked<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locked")
            .field("lease", &self.handle)
            .field("reused", &self.lease.is_none())
            .finish()
    }
}

impl<S, K> FromRequestParts<S> for Locked<K>
where
    K: LockSpec<S>,
    Redlock: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = LockRejection;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        // The layer's path (`crate::http::acquire`): the same checks, the same resources,
        // the same problems.
        let extractor = K::extractor(state);
        let found = extractor
            .keys(parts, &[])
            .map_err(|rejection| refuse(rejection.into(), parts))?;
        let Some(found) = found else {
            return Err(refuse(missing_key(&extractor.describe()), parts));
        };
        let scope = K::scope(state);
        let resource_of =
            |key: &str| scope.resource_of(&parts.method, &parts.uri, &parts.extensions, key);
        let describe = |index| extractor.describe_key(index);
        let (max_len, mode) = (K::max_key_len(state), K::mode(state));
        let (target, _) = name(found, max_len, describe, resource_of, mode)
            .map_err(|problem| refuse(problem, parts))?;
        let (locker, contention) = (Redlock::from_ref(state), K::contention(state));
        let taken = take(&locker, contention, &parts.extensions, &target).await;
        let Taken {
            lease,
            handle,
            reused,
        } = taken.map_err(|error| refuse(target.problem(&error), parts))?;
        if lease.is_some() {
            tracing::debug!(resources = ?target.resources, token = %handle.fencing_token(), "lease acquired by the Locked extractor");
            add_request_lease(&mut parts.extensions, &handle);
            Critical::enter(&parts.extensions);
        } else {
            tracing::debug!(resources = ?target.resources, "the request holds this lock already: reusing its lease");
        }
        Ok(Locked {
            lease,
            handle,
            reused,
            resources: target.resources.into(),
            key: PhantomData,
        })
    }
}

/// A refusal, rendered by the renderer of the [`LockLayer`](crate::http::LockLayer)
/// the request came through, if it has one of its own.
fn refuse(problem: Problem, parts: &Parts) -> LockRejection {
    tracing::debug!(%problem, "request refused by the Locked extractor");
    crate::metrics::refusal(problem.kind().code(), None);
    let renderer = parts.extensions.get::<LayerRenderer>();
    let renderer = renderer.map(|r| r.0.clone());
    LockRejection { problem, renderer }
}

/// The resources of this lock with their tokens (its own lease's and the reused ones'),
/// in the extractor's order: `fence::postgres::advance(&mut tx, &locked)` fences them
/// all.
impl<K> crate::fence::Fenced for Locked<K> {
    fn tokens(&self) -> Vec<(Resource, FencingToken)> {
        self.resources
            .iter()
            .filter_map(|resource| {
                self.fencing_token_of(resource)
                    .map(|token| (resource.clone(), token))
            })
            .collect()
    }

    fn mode(&self) -> crate::LockMode {
        std::iter::once(&self.handle)
            .chain(&self.reused)
            .map(LeaseHandle::mode)
            .find(|mode| !mode.is_exclusive())
            .unwrap_or_default()
    }
}
