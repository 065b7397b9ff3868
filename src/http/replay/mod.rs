//! Idempotent replay: the first response for a key is recorded and replayed.
//!
//! Turned on with [`LockLayer::replay`](super::LockLayer::replay). It follows the IETF
//! draft *The Idempotency-Key HTTP Header Field* and the behaviour Stripe documents for
//! its API; [the replay guide](crate::guide::replay) has the table of what each request
//! gets ([`Fingerprint`], [`UnknownOutcome`], [`Replay::methods`] decide parts of it),
//! what is recorded, and how records survive restarts and failovers. [`Replay::per_client`]
//! and [`Replay::global`] say whose keys they are; `Replay::records_in` (feature
//! `postgres`) keeps the records in the application's PostgreSQL, where a handler's
//! writes through `axum::Tx` commit with its record.
//!
//! # Why it is an option of [`LockLayer`](super::LockLayer)
//!
//! Replay's steps sit on the layer's one path: the record is looked up **before** the
//! lock (retries of finished requests never contend), claimed **under the lease**
//! before the handler runs (a pending marker written in the same atomic step on each
//! node, the record checked again: the holder we waited for may have just written it),
//! and the handler's response is buffered and recorded **under the lease**, with a
//! compare-and-set on the lock's owner value, before it is sent. So the record exists
//! before the client sees a byte, and a holder that lost its lease never writes over a
//! newer outcome. A layer of its own would have to find the key and read the body a
//! second time, and reach into the lock layer's lease for the last two steps.
//! Responses are buffered: not for streaming endpoints. Under
//! [`Unavailable::FailOpen`](super::Unavailable::FailOpen) a request that runs without a
//! lock is neither replayed nor recorded.

mod fingerprint;
#[cfg(feature = "postgres")]
pub(crate) mod handler_tx;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
mod steps;
mod stored;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, CONTENT_TYPE, LOCATION};
use http::request::Parts;
use http::{Method, StatusCode};

use super::key::{HeadOnly, KeyExtractor, KeyRejection};

pub use fingerprint::Fingerprint;
#[cfg(feature = "postgres")]
pub use postgres::PgRecords;
pub(crate) use steps::ReplayStep;

/// The header added to replayed responses: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The default [`Replay::retention`]: 24 hours.
const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The default [`Replay::max_body`] and [`Replay::max_request_body`]: 1 MiB.
const DEFAULT_MAX_BODY: usize = 1024 * 1024;

type ClientFn = Arc<dyn Fn(&mut Parts) -> Result<Option<String>, KeyRejection> + Send + Sync>;

/// The key extractor of a replaying layer, made by
/// [`LockLayer::replay`](super::LockLayer::replay): the layer's own, which finds one key;
/// the layer reads the request body for the fingerprint when it covers the body.
#[derive(Debug, Clone)]
pub struct Replaying<K>(pub K);

impl<K: KeyExtractor<Keys = String>> KeyExtractor for Replaying<K> {
    type Keys = String;
    type Body = Bytes;

    fn keys(&self, parts: &mut Parts, body: &[u8]) -> Result<Option<String>, KeyRejection> {
        self.0.keys(parts, body)
    }

    fn body_limit(&self) -> Option<usize> {
        self.0.body_limit()
    }

    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// Idempotent replay for [`LockLayer::replay`](super::LockLayer::replay); see the
/// [module documentation](self) for the behaviour.
///
/// ```
/// use std::time::Duration;
/// use axum::{http::StatusCode, routing::post, Router};
/// use tower_redlock::http::{key::header, replay::Replay, LockLayer};
/// use tower_redlock::Redlock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { (StatusCode::CREATED, "pay_1") }))
///     .route_layer(
///         LockLayer::new(Redlock::in_memory(), header("Idempotency-Key"))
///             .replay(Replay::per_client(header("Authorization")).retention(Duration::from_secs(3600))),
///     );
/// # let _ = app;
/// # }
/// ```
#[derive(Clone)]
pub struct Replay {
    retention: Duration,
    max_body: usize,
    max_request_body: usize,
    headers: Vec<HeaderName>,
    store_if: Arc<dyn Fn(StatusCode) -> bool + Send + Sync>,
    fingerprint: Fingerprint,
    unknown: Option<UnknownOutcome>,
    client: Option<(ClientFn, String)>,
    pub(crate) methods: Vec<Method>,
    #[cfg(feature = "postgres")]
    records: Option<PgRecords>,
}

impl Replay {
    /// Replay scoped to the client that `client` finds in the request head: e.g.
    /// `header("Authorization")`, or a closure reading the account an authentication
    /// layer put in the extensions. The same key from two clients names two records. The
    /// value is hashed (SHA-256) before it becomes part of the lock's and record's keys,
    /// so credentials never appear there. A request in which `client` finds nothing gets
    /// 400 `key-missing`. The other settings are each builder method's default.
    pub fn per_client<T>(client: T) -> Self
    where
        T: KeyExtractor<Keys = String>,
        T::Body: HeadOnly,
    {
        let describe = client.describe();
        let find: ClientFn = Arc::new(move |parts: &mut Parts| client.keys(parts, &[]));
        Replay::with_client(Some((find, describe)))
    }

    /// Replay with keys shared by every client: a request with a key gets the record of
    /// whoever sent that key first. Only for keys that name one operation whoever sends
    /// them (a single sender's delivery ids, a webhook's event id); for keys that clients
    /// choose, use [`Replay::per_client`].
    pub fn global() -> Self {
        Replay::with_client(None)
    }

    fn with_client(client: Option<(ClientFn, String)>) -> Self {
        Replay {
            retention: DEFAULT_RETENTION,
            max_body: DEFAULT_MAX_BODY,
            max_request_body: DEFAULT_MAX_BODY,
            headers: vec![CONTENT_TYPE, LOCATION],
            store_if: Arc::new(Replay::stored_by_default),
            fingerprint: Fingerprint::default(),
            unknown: None,
            client,
            methods: vec![Method::POST, Method::PATCH],
            #[cfg(feature = "postgres")]
            records: None,
        }
    }

    /// The methods whose requests are recorded and replayed (default `POST` and
    /// `PATCH`, the methods the IETF draft is about: `GET`, `HEAD`, `PUT`, `DELETE` and
    /// `OPTIONS` are idempotent by definition). A request with another method is
    /// locked like any other, and neither looked up nor recorded.
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    setters!({
        /// How long a record is kept (default 24 h); after that the key is new again.
        /// Longer than ten years (up to `Duration::MAX`) is taken as ten years, shorter
        /// than 1 ms as 1 ms.
        retention: Duration;

        /// The largest response body recorded (default 1 MiB). Larger responses are sent
        /// but not recorded (a warning is logged), and a retry runs the handler again.
        max_body: usize;

        /// The largest request body read for the fingerprint (default 1 MiB); larger
        /// requests get 413 `body-too-large` before any lock is taken. Not used when the
        /// fingerprint ignores the body.
        max_request_body: usize;

        /// What makes two requests with the same key "the same request" (default
        /// [`Fingerprint::default`]: method, route, path and query, and the body's SHA-256).
        fingerprint: Fingerprint;
    });

    /// Also records and replays the response header `name` (`Content-Type` and
    /// `Location` are always included). Every value of a repeated header is kept.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    #[must_use]
    pub fn allow_header<N>(mut self, name: N) -> Self
    where
        N: TryInto<HeaderName>,
        N::Error: fmt::Display,
    {
        let name = match name.try_into() {
            Ok(name) => name,
            Err(e) => panic!("invalid header name to replay: {e}"),
        };
        if !self.headers.contains(&name) {
            self.headers.push(name);
        }
        self
    }

    /// Which responses are recorded, by status (default [`Replay::stored_by_default`]). A status
    /// that is not recorded leaves the key free: the next request runs the handler.
    #[must_use]
    pub fn store_if(mut self, policy: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.store_if = Arc::new(policy);
        self
    }

    /// Keeps the records in PostgreSQL instead of the lock nodes, whatever nodes hold
    /// the lock (feature `postgres`; see [`PgRecords`]): as durable as the database,
    /// and the way for a handler's writes to commit with their record
    /// ([`Tx`](crate::axum::Tx), feature `axum`). Handlers that do not take `Tx` keep
    /// the behaviour of records on the nodes. Holders are told apart by their fencing
    /// tokens: [`LockLayer::try_replay`](super::LockLayer::try_replay) refuses a locker
    /// without them (`LockOptions::fencing(false)`).
    #[cfg(feature = "postgres")]
    #[must_use]
    pub fn records_in(mut self, records: PgRecords) -> Self {
        self.records = Some(records);
        self
    }

    /// What the key answers after an attempt whose outcome is unknown (default
    /// [`UnknownOutcome::ReexecuteAfter`] the lock's ttl).
    #[must_use]
    pub fn unknown_outcome(mut self, policy: UnknownOutcome) -> Self {
        self.unknown = Some(policy);
        self
    }
}

impl fmt::Debug for Replay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replay")
            .field("retention", &self.retention)
            .field("max_body", &self.max_body)
            .field("max_request_body", &self.max_request_body)
            .field("headers", &self.headers)
            .field("fingerprint", &self.fingerprint)
            .field("unknown", &self.unknown)
            .field("client", &self.client.as_ref().map(|(_, d)| d))
            .field("methods", &self.methods)
            .finish_non_exhaustive()
    }
}

impl Replay {
    /// The statuses [`Replay`] records by default: 2xx, 3xx, and 4xx except 400, 411,
    /// 413, 415 and 422 (what axum's extractors answer before the handler runs: as Stripe
    /// does, a result is saved only once the endpoint started executing), and 408, 409
    /// and 429 (they say "try again"). 5xx are not recorded, unlike Stripe's 500s; use
    /// [`Replay::store_if`] for other choices.
    pub fn stored_by_default(status: StatusCode) -> bool {
        match status.as_u16() {
            200..=399 => true,
            400 | 411 | 413 | 415 | 422 => false,
            408 | 409 | 429 => false,
            400..=499 => true,
            _ => false,
        }
    }
}

/// What the key answers after an attempt whose outcome is unknown (its lease lost, its
/// process gone, its record not written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnknownOutcome {
    /// 409 `outcome-unknown` for this long after the first request that finds the
    /// interrupted attempt, then run the handler again, telling it which attempt was
    /// interrupted ([`InterruptedAttempt`](super::InterruptedAttempt)). The default,
    /// with the lock's ttl.
    ReexecuteAfter(Duration),
    /// 409 `outcome-unknown` until the retention ends: an operator (or the client,
    /// with a new key after checking) must resolve it.
    Refuse,
}

impl Replay {
    /// This replay with the defaults that depend on the locker filled in, and capped
    /// where the nodes would be asked to keep something longer than they can express
    /// (`Duration::MAX` means "as long as possible").
    pub(crate) fn resolved(mut self, lock_ttl: Duration) -> Self {
        let cap = crate::lock::record::MAX_RECORD_TTL;
        self.retention = self.retention.min(cap);
        self.unknown = Some(match self.unknown {
            None => UnknownOutcome::ReexecuteAfter(lock_ttl.min(cap)),
            Some(UnknownOutcome::ReexecuteAfter(after)) => {
                UnknownOutcome::ReexecuteAfter(after.min(cap))
            }
            Some(UnknownOutcome::Refuse) => UnknownOutcome::Refuse,
        });
        self
    }

    /// `Some`: an interrupted attempt blocks its key this long; `None`: until retention.
    pub(crate) fn unknown_for(&self) -> Option<Duration> {
        match self.unknown {
            Some(UnknownOutcome::ReexecuteAfter(after)) => Some(after),
            _ => None,
        }
    }

    /// How long a pending marker lives: it must outlast the work, and an interrupted
    /// attempt must stay visible until someone finds it.
    pub(crate) fn pending_ttl(&self) -> Duration {
        self.retention.max(self.unknown_for().unwrap_or_default())
    }

    /// The records are kept on the lock nodes (not in PostgreSQL).
    pub(crate) fn on_nodes(&self) -> bool {
        #[cfg(feature = "postgres")]
        return self.records.is_none();
        #[cfg(not(feature = "postgres"))]
        true
    }

    /// Whether a request with `ours` may use a record stored with `stored`.
    pub(crate) fn matches(&self, ours: &[u8], stored: &[u8]) -> bool {
        !self.fingerprint.enabled || ours == stored
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_statuses() {
        for ok in [200, 201, 204, 303, 402, 403, 404, 410] {
            assert!(
                Replay::stored_by_default(StatusCode::from_u16(ok).unwrap()),
                "{ok}"
            );
        }
        for no in [400, 408, 409, 411, 413, 415, 422, 429, 500, 502, 503, 504] {
            assert!(
                !Replay::stored_by_default(StatusCode::from_u16(no).unwrap()),
                "{no}"
            );
        }
    }
}
