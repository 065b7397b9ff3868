//! [`Replaying`]: the key extractor of a replaying layer.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::Request;
use http_body::Body;

use super::super::key::{
    read_limited, BoxKeyFuture, KeyExtractor, KeyRejection, KeySetExtractor, OneKey,
};
use super::super::problem::ProblemKind;
use super::{ReplayRequest, ReplaySettings};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The key extractor of a replaying layer: the layer's own extractor, then the client
/// ([`Replay::per_client`](super::Replay::per_client)) and the fingerprint (reading the body when the fingerprint covers it, and passing
/// the identical bytes on). Made by [`LockLayer::replay`](crate::http::LockLayer::replay).
#[derive(Clone)]
pub struct Replaying<K> {
    key: K,
    settings: Arc<ReplaySettings>,
}

impl<K> Replaying<K> {
    pub(crate) fn new(key: K, settings: Arc<ReplaySettings>) -> Self {
        Replaying { key, settings }
    }

    /// The layer's own key extractor.
    pub fn key(&self) -> &K {
        &self.key
    }
}

impl<K: fmt::Debug> fmt::Debug for Replaying<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replaying")
            .field("key", &self.key)
            .field("replay", &self.settings)
            .finish()
    }
}

impl<K, B> KeyExtractor<B> for Replaying<K>
where
    K: KeyExtractor<B>,
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Future = BoxKeyFuture<B>;

    fn extract(&self, request: Request<B>) -> Self::Future {
        let key = self.key.extract(request);
        let settings = self.settings.clone();
        Box::pin(async move {
            let (request, key) = key.await?;
            // No key, or a method replay is not for: the layer just locks.
            if key.is_none() || !settings.methods.contains(request.method()) {
                return Ok((request, key));
            }
            let (mut parts, body) = request.into_parts();
            let client = match &settings.client {
                None => None,
                Some((find, describe)) => match find(&mut parts)? {
                    Some(client) => Some(client),
                    None => return Err(no_client(describe)),
                },
            };
            let fingerprint = &settings.fingerprint;
            let (fingerprint, body) = if fingerprint.reads_body() {
                let limit = settings.max_request_body;
                let declared = parts
                    .headers
                    .get(CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                let too_large = |n: u64| n > u64::try_from(limit).unwrap_or(u64::MAX);
                if declared.is_some_and(too_large) || too_large(body.size_hint().lower()) {
                    return Err(request_too_large(limit));
                }
                let bytes = read_limited(body, limit).await.map_err(|rejection| {
                    if rejection.kind() == ProblemKind::BodyTooLarge {
                        request_too_large(limit)
                    } else {
                        rejection
                    }
                })?;
                (fingerprint.compute(&parts, &bytes)?, B::from(bytes))
            } else {
                (fingerprint.compute(&parts, &[])?, body)
            };
            parts.extensions.insert(ReplayRequest {
                fingerprint,
                client,
            });
            Ok((Request::from_parts(parts, body), key))
        })
    }

    fn describe(&self) -> String {
        self.key.describe()
    }
}

/// A layer replaying per client cannot tell whose record a request without its client
/// would get: nothing runs.
fn no_client(describe: &str) -> KeyRejection {
    KeyRejection::missing(format!(
        "idempotency keys on this route are kept per client, and the request names \
         none (expected {describe})"
    ))
}

fn request_too_large(limit: usize) -> KeyRejection {
    KeyRejection::with_kind(
        ProblemKind::BodyTooLarge,
        format!("the body is larger than {limit} bytes, the limit for an idempotent request"),
    )
}

impl<K, B> KeySetExtractor<B> for Replaying<K>
where
    K: KeyExtractor<B>,
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Future = OneKey<BoxKeyFuture<B>>;

    fn extract_keys(&self, request: Request<B>) -> Self::Future {
        OneKey::new(KeyExtractor::extract(self, request))
    }

    fn describe_keys(&self) -> String {
        self.key.describe()
    }

    fn describe_key(&self, _index: usize) -> String {
        self.key.describe()
    }
}
