//! axum extractors: take a lease inside a handler ([`Locked`]), or read the lease a
//! [`LockLayer`](crate::http::LockLayer) took for the request ([`LayerLease`]).
//!
//! [`LockLayer`](crate::http::LockLayer) is the usual way to lock a route: the lease is
//! taken before the handler runs and held until the response body has been sent, and
//! the handler is stopped if the lease is lost
//! ([`OnLost::Abort`](crate::http::OnLost::Abort)).
//! The extractors cover the rest:
//!
//! - [`Locked<K>`] takes the lease itself, as the handler's argument. The key comes
//!   from the request through the same [`KeyFromParts`] extractors the layer uses,
//!   named by a marker type that implements [`LockKey`] (settings in the code) or
//!   [`LockSpec`] (settings from the state); the locker comes from the
//!   router's state (`Redlock: FromRef<S>`). The lease is the handler's to use: it is
//!   released when the handler's future ends (or earlier, with
//!   [`Lease::release`](crate::Lease::release)), and the handler itself decides what
//!   to do when the lease is lost ([`LeaseHandle::lost`]).
//! - [`LayerLease`] hands the handler the [`LeaseHandle`] that
//!   [`LockLayer`](crate::http::LockLayer) put in the request extensions, and fails
//!   loudly (500 `lock-layer-missing`) when there is none, instead of letting a handler
//!   believe it runs under a lock.
//!
//! Refusals are [`LockRejection`]s: the same RFC 9457 problem responses, with the same
//! status codes, as the layer's (see [`problem`]).
//!
//! Do not build a guard on `axum::middleware::from_extractor::<Locked<K>>`: it drops the
//! extracted value, and with it the lease, before the handler runs.
//!
//! ```
//! use axum::{extract::State, routing::post, Router};
//! use http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_redlock::axum::{LockKey, Locked};
//! use tower_redlock::http::{path_param, PathParam};
//! use tower_redlock::Redlock;
//!
//! /// One lock per invoice id, per route (the default scope).
//! struct InvoiceId;
//!
//! impl LockKey for InvoiceId {
//!     type Extractor = PathParam;
//!
//!     fn extractor() -> PathParam {
//!         path_param("id")
//!     }
//! }
//!
//! async fn send_invoice(invoice: Locked<InvoiceId>) -> String {
//!     // ... write with the fencing token ...
//!     format!("sent under token {}", invoice.fencing_token())
//! } // the lease is released here, in the background
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new()
//!     .route("/invoices/{id}/send", post(send_invoice))
//!     .with_state(Redlock::in_memory());
//!
//! let request = Request::post("/invoices/7/send").body(axum::body::Body::empty()).unwrap();
//! let response = app.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! # }
//! ```

use std::convert::Infallible;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;

use ::axum::body::Body;
use ::axum::extract::{FromRef, FromRequestParts, MatchedPath, OptionalFromRequestParts};
use ::axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use http::header::HeaderValue;
use http::request::Parts;
use http::{Request, StatusCode};

use crate::error::LockError;
use crate::http::key::{validate, KeyFromParts, KeyRejection};
use crate::http::problem::{self, lock_error_problem, DefaultRenderer, Problem, ProblemKind};
use crate::http::{Contention, Scope, Unlocked, DEFAULT_MAX_KEY_LEN, FENCING_TOKEN};
use crate::lock::fencing::FencingToken;
use crate::lock::{Lease, LeaseHandle, Redlock, Resource};

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
/// use tower_redlock::http::{header, Contention, Header, Scope};
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
pub trait LockKey: Send + Sync + 'static {
    /// The type of [`extractor`](LockKey::extractor): a built-in such as
    /// [`Header`](crate::http::Header) or [`PathParam`](crate::http::PathParam), a
    /// tuple of them, an [`Or`](crate::http::Or), or your own [`KeyFromParts`].
    /// Body keys ([`json_field`](crate::http::json_field)) need the whole request:
    /// use [`LockLayer`](crate::http::LockLayer) for them.
    type Extractor: KeyFromParts;

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

    /// The longest key accepted, in bytes (default
    /// [`DEFAULT_MAX_KEY_LEN`]).
    fn max_key_len() -> usize {
        DEFAULT_MAX_KEY_LEN
    }
}

/// The lock a [`Locked`] extractor takes, configured from the router's state `S` at
/// run time: the general form of [`LockKey`], whose settings are fixed in the code.
///
/// Every [`LockKey`] is a `LockSpec<S>` for any state. Implement `LockSpec` instead when
/// the scope, the wait timeout or the key limit come from configuration read at start
/// (environment, a file): they are read from the state on every request.
///
/// ```
/// use std::time::Duration;
/// use axum::extract::FromRef;
/// use tower_redlock::axum::{LockSpec, Locked};
/// use tower_redlock::http::{path_param, Contention, PathParam, Scope};
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
///
/// async fn transfer(lock: Locked<AccountId>) -> String {
///     format!("under token {}", lock.fencing_token())
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// # let _: axum::Router = axum::Router::new()
/// #     .route("/accounts/{id}/transfer", axum::routing::post(transfer))
/// #     .with_state(AppState { locker: Redlock::in_memory(), transfer_wait: Duration::from_secs(1) });
/// # }
/// ```
pub trait LockSpec<S>: Send + Sync + 'static {
    /// The type of [`extractor`](LockSpec::extractor) (see [`LockKey::Extractor`]).
    type Extractor: KeyFromParts;

    /// Finds the key in the request head. Called once per request.
    fn extractor(state: &S) -> Self::Extractor;

    /// Which requests share a lock (default [`Scope::Route`]).
    fn scope(_state: &S) -> Scope {
        Scope::Route
    }

    /// Whether to refuse or to wait when the lock is held (default
    /// [`Contention::Reject`]).
    fn contention(_state: &S) -> Contention {
        Contention::Reject
    }

    /// The longest key accepted, in bytes (default [`DEFAULT_MAX_KEY_LEN`]).
    fn max_key_len(_state: &S) -> usize {
        DEFAULT_MAX_KEY_LEN
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
}

/// An extractor that holds a lease on the lock named by `K` while the handler runs.
///
/// The locker comes from the router's state (`Redlock: FromRef<S>`: the state is a
/// [`Redlock`], or a struct with a `#[derive(FromRef)]` or a hand-written
/// [`FromRef`] impl). The derive is behind axum's `macros` feature, which axum does not
/// enable by default: add `axum = { version = "0.8", features = ["macros"] }` to use it,
/// or write the impl by hand (see [`LockSpec`]'s example); without it the compiler
/// reports that `FromRef` is not a derive macro and that `Redlock: FromRef<AppState>`
/// does not hold. The key is read from the request head by
/// [`K::extractor`](LockKey::extractor) and checked like the layer checks it; the
/// resource is [`K::scope`](LockKey::scope)'s, and the lease is acquired as
/// [`K::contention`](LockKey::contention) says.
///
/// `Locked` derefs to the [`Lease`] (and so to its [`LeaseHandle`]): the fencing
/// token, the validity left, the lost signal. Dropping it — which happens when the
/// handler's future ends — releases the lease in the background; take it with
/// [`into_lease`](Locked::into_lease) to release it earlier and await the outcome.
/// Unlike the layer, the extractor cannot stop the handler when the lease is lost:
/// race the critical section against [`lost`](LeaseHandle::lost), as below, and pass
/// the fencing token to the storage.
///
/// Nor does it add a `Fencing-Token` header by itself: the handler's response is built
/// after the extractor ran. Return the token with the response — [`FencingToken`]
/// implements [`IntoResponseParts`] — as `(lock.fencing_token(), body)`, and the
/// response carries `Fencing-Token: <n>` like the layer's.
///
/// The key's settings are `K`'s: a [`LockKey`] fixes them in the code, a [`LockSpec`]
/// reads them from the state on every request.
///
/// Refusals, all as [`LockRejection`] with the layer's problem bodies: 400
/// `key-missing` / `key-invalid`, 409 `lock-held` / `lock-wait-timeout`, 503
/// `lock-unavailable` / `lock-queue-full`.
///
/// ```
/// use axum::{extract::{FromRef, State}, http::StatusCode, routing::post, Json, Router};
/// use serde_json::{json, Value};
/// use tower_redlock::axum::{LockKey, Locked};
/// use tower_redlock::http::{header, Header};
/// use tower_redlock::{FencingToken, Redlock};
///
/// // `derive(FromRef)` needs axum's `macros` feature.
/// #[derive(Clone, FromRef)]
/// struct AppState {
///     locker: Redlock,
///     // ... database pool, configuration ...
/// }
///
/// struct IdempotencyKey;
///
/// impl LockKey for IdempotencyKey {
///     type Extractor = Header;
///
///     fn extractor() -> Header {
///         header("Idempotency-Key")
///     }
/// }
///
/// async fn charge(
///     State(_state): State<AppState>,
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
///     .with_state(AppState { locker: Redlock::in_memory() });
/// # let _ = app;
/// # }
/// ```
pub struct Locked<K> {
    lease: Lease,
    // `fn() -> K`: the marker is never stored, so it does not decide Send or Sync.
    key: PhantomData<fn() -> K>,
}

impl<K> Locked<K> {
    /// The lease.
    ///
    /// ```
    /// # use tower_redlock::axum::{LockKey, Locked};
    /// # use tower_redlock::http::{header, Header};
    /// # struct Key;
    /// # impl LockKey for Key {
    /// #     type Extractor = Header;
    /// #     fn extractor() -> Header { header("x-key") }
    /// # }
    /// async fn handler(lock: Locked<Key>) -> String {
    ///     format!("{:?} left", lock.lease().remaining())
    /// }
    /// ```
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The lease, to keep beyond the handler or to release early and await the outcome.
    ///
    /// ```
    /// # use tower_redlock::axum::{LockKey, Locked};
    /// # use tower_redlock::http::{header, Header};
    /// # struct Key;
    /// # impl LockKey for Key {
    /// #     type Extractor = Header;
    /// #     fn extractor() -> Header { header("x-key") }
    /// # }
    /// async fn handler(lock: Locked<Key>) -> &'static str {
    ///     // ... the critical section ...
    ///     let outcome = lock.into_lease().release().await;
    ///     // ... work that needs no lock ...
    ///     # let _ = outcome;
    ///     "done"
    /// }
    /// ```
    pub fn into_lease(self) -> Lease {
        self.lease
    }
}

impl<K> Deref for Locked<K> {
    type Target = Lease;

    fn deref(&self) -> &Lease {
        &self.lease
    }
}

impl<K> fmt::Debug for Locked<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Locked").field(&self.lease).finish()
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
        let extractor = K::extractor(state);
        let key = match extractor.key(parts) {
            Ok(Some(key)) => key,
            Ok(None) => {
                let detail = format!("no lock key: expected {}", extractor.describe());
                return Err(refuse(Problem::new(ProblemKind::KeyMissing, detail)));
            }
            Err(rejection) => return Err(refuse(rejection.into())),
        };
        if let Err(detail) = validate(&key, K::max_key_len(state)) {
            return Err(refuse(Problem::new(ProblemKind::KeyInvalid, detail)));
        }
        let resource = resource_of(&K::scope(state), parts, &key);
        let locker = Redlock::from_ref(state);
        let acquired = match K::contention(state) {
            Contention::Reject => locker.try_acquire(resource.clone()).await,
            Contention::Wait { timeout } => locker.acquire(resource.clone(), timeout).await,
        };
        match acquired {
            Ok(lease) => {
                let token = lease.fencing_token();
                tracing::debug!(%resource, %token, "lease acquired by the Locked extractor");
                Ok(Locked {
                    lease,
                    key: PhantomData,
                })
            }
            Err(error) => Err(refuse(lock_error_problem(&error, resource))),
        }
    }
}

fn refuse(problem: Problem) -> LockRejection {
    tracing::debug!(%problem, "request refused by the Locked extractor");
    crate::lock::metrics::refusal(problem.kind().code());
    LockRejection { problem }
}

/// The resource `scope` names for `key`, exactly as the layer computes it.
fn resource_of(scope: &Scope, parts: &Parts, key: &str) -> Resource {
    // `Scope::resource` reads the method, the URI path and axum's `MatchedPath`: hand
    // it a request head with just those, rather than cloning every extension.
    let mut head = Request::new(());
    *head.method_mut() = parts.method.clone();
    *head.uri_mut() = parts.uri.clone();
    if let Some(path) = parts.extensions.get::<MatchedPath>() {
        head.extensions_mut().insert(path.clone());
    }
    scope.resource(&head, key)
}

/// An extractor for the lease that [`LockLayer`](crate::http::LockLayer) took for this
/// request.
///
/// Derefs to the [`LeaseHandle`]: the fencing token, the validity left, the lost
/// signal. The same as `Extension<LeaseHandle>`, with a rejection that says what is
/// wrong: without a lease in the request — the route has no
/// [`LockLayer`](crate::http::LockLayer), or its layer let the request through unlocked
/// ([`MissingKey::Bypass`](crate::http::MissingKey::Bypass),
/// [`Unavailable::FailOpen`](crate::http::Unavailable::FailOpen)) — the handler does not
/// run and the client gets 500 `lock-layer-missing`. Handlers that may run unlocked
/// take `Option<LayerLease>`.
///
/// ```
/// use axum::{routing::post, Router};
/// use http::{Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_redlock::axum::LayerLease;
/// use tower_redlock::http::{header, LockLayer};
/// use tower_redlock::Redlock;
///
/// async fn pay(lease: LayerLease) -> String {
///     format!("paid under token {}", lease.fencing_token())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app = Router::new()
///     .route("/pay", post(pay))
///     .route_layer(LockLayer::new(Redlock::in_memory(), header("Idempotency-Key")));
///
/// let request = Request::post("/pay")
///     .header("Idempotency-Key", "k1")
///     .body(axum::body::Body::empty())
///     .unwrap();
/// let response = app.oneshot(request).await.unwrap();
/// assert_eq!(response.status(), StatusCode::OK);
///
/// // Forgot the layer: 500 `lock-layer-missing`, the handler never runs.
/// let unlocked = Router::new().route("/pay", post(pay));
/// let request = Request::post("/pay").body(axum::body::Body::empty()).unwrap();
/// let response = unlocked.oneshot(request).await.unwrap();
/// assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct LayerLease(pub LeaseHandle);

impl Deref for LayerLease {
    type Target = LeaseHandle;

    fn deref(&self) -> &LeaseHandle {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for LayerLease {
    type Rejection = LockRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        if let Some(handle) = parts.extensions.get::<LeaseHandle>() {
            return Ok(LayerLease(handle.clone()));
        }
        let detail = match parts.extensions.get::<Unlocked>() {
            None => {
                "this route has no LockLayer, but its handler needs the lease one takes \
                 (LayerLease): add the layer to the route (route_layer), or take the lease \
                 in the handler with Locked"
            }
            Some(Unlocked::MissingKey) => {
                "the LockLayer of this route let the request through without a lock \
                 (no key, MissingKey::Bypass), but its handler needs the lease (LayerLease): \
                 take Option<LayerLease> in handlers that may run unlocked"
            }
            Some(Unlocked::StoreUnavailable) => {
                "the LockLayer of this route let the request through without a lock \
                 (lock store unavailable, Unavailable::FailOpen), but its handler needs \
                 the lease (LayerLease): take Option<LayerLease> in handlers that may run \
                 unlocked"
            }
        };
        tracing::error!(path = %parts.uri.path(), "{detail}");
        Err(LockRejection {
            problem: Problem::new(ProblemKind::LockLayerMissing, detail),
        })
    }
}

/// `Option<LayerLease>`: `None` when the request carries no lease, for handlers that
/// also run unlocked ([`MissingKey::Bypass`](crate::http::MissingKey::Bypass),
/// [`Unavailable::FailOpen`](crate::http::Unavailable::FailOpen)).
///
/// ```
/// use tower_redlock::axum::LayerLease;
///
/// async fn handler(lease: Option<LayerLease>) -> String {
///     match lease {
///         Some(lease) => format!("locked, token {}", lease.fencing_token()),
///         None => "unlocked".to_owned(),
///     }
/// }
/// ```
impl<S: Send + Sync> OptionalFromRequestParts<S> for LayerLease {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<LeaseHandle>()
            .cloned()
            .map(LayerLease))
    }
}

/// Why [`Locked`] or [`LayerLease`] refused a request: a [`Problem`], answered as the
/// layer answers it (`application/problem+json` by [`DefaultRenderer`],
/// `Cache-Control: no-store`, `Retry-After` when known).
///
/// Take `Result<Locked<K>, LockRejection>` in the handler to answer in another format:
///
/// ```
/// use axum::http::StatusCode;
/// use tower_redlock::axum::{LockKey, LockRejection, Locked};
/// use tower_redlock::http::{header, Header};
///
/// struct Key;
/// impl LockKey for Key {
///     type Extractor = Header;
///     fn extractor() -> Header {
///         header("x-key")
///     }
/// }
///
/// async fn handler(lock: Result<Locked<Key>, LockRejection>) -> (StatusCode, String) {
///     match lock {
///         Ok(_lock) => (StatusCode::OK, "done".to_owned()),
///         Err(rejection) => (rejection.status(), rejection.problem().detail().to_owned()),
///     }
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockRejection {
    problem: Problem,
}

impl LockRejection {
    /// The problem.
    ///
    /// ```
    /// use tower_redlock::axum::LockRejection;
    /// use tower_redlock::{Problem, ProblemKind};
    ///
    /// let rejection = LockRejection::from(Problem::new(ProblemKind::LockHeld, "busy"));
    /// assert_eq!(rejection.problem().kind(), ProblemKind::LockHeld);
    /// ```
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// The problem, by value.
    ///
    /// ```
    /// use tower_redlock::axum::LockRejection;
    /// use tower_redlock::{Problem, ProblemKind};
    ///
    /// let rejection = LockRejection::from(Problem::new(ProblemKind::LockHeld, "busy"));
    /// assert_eq!(rejection.into_problem().detail(), "busy");
    /// ```
    pub fn into_problem(self) -> Problem {
        self.problem
    }

    /// The HTTP status of the response.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_redlock::axum::LockRejection;
    /// use tower_redlock::{Problem, ProblemKind};
    ///
    /// let rejection = LockRejection::from(Problem::new(ProblemKind::LockHeld, "busy"));
    /// assert_eq!(rejection.status(), StatusCode::CONFLICT);
    /// ```
    pub fn status(&self) -> StatusCode {
        self.problem.status()
    }
}

impl From<Problem> for LockRejection {
    fn from(problem: Problem) -> Self {
        LockRejection { problem }
    }
}

impl From<KeyRejection> for LockRejection {
    fn from(rejection: KeyRejection) -> Self {
        LockRejection {
            problem: rejection.into(),
        }
    }
}

impl fmt::Display for LockRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.problem, f)
    }
}

impl std::error::Error for LockRejection {}

impl IntoResponse for LockRejection {
    fn into_response(self) -> Response {
        problem::render(&DefaultRenderer, &self.problem)
            .map(Body::from)
            .into_response()
    }
}

impl IntoResponse for Problem {
    /// The problem as the layer sends it: [`DefaultRenderer`]'s
    /// `application/problem+json`, `Retry-After` when known, `Cache-Control: no-store`.
    fn into_response(self) -> Response {
        problem::render(&DefaultRenderer, &self)
            .map(Body::from)
            .into_response()
    }
}

impl IntoResponse for LockError {
    /// The response the layer sends for this error (see
    /// [`problem_response`](crate::http::problem::problem_response)), so a handler that
    /// locks by hand can use `?`:
    ///
    /// ```
    /// use tower_redlock::{LockError, Redlock, Resource};
    ///
    /// async fn ship(locker: Redlock, order: String) -> Result<String, LockError> {
    ///     let lease = locker.try_acquire(Resource::new("order").join(&order)).await?;
    ///     Ok(format!("shipped under token {}", lease.fencing_token()))
    /// }
    /// ```
    fn into_response(self) -> Response {
        Problem::from(&self).into_response()
    }
}

impl IntoResponseParts for FencingToken {
    type Error = Infallible;

    /// Adds `Fencing-Token: <n>` (the layer's [`FENCING_TOKEN`] header) to the
    /// response; nothing for token 0 (a locker without fencing), as the layer does.
    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Infallible> {
        if self.get() > 0 {
            parts
                .headers_mut()
                .insert(FENCING_TOKEN, HeaderValue::from(self.get()));
        }
        Ok(parts)
    }
}
