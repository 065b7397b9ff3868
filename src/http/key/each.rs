//! [`Each`] and [`KeysFn`]: multi-key extractors made of single-key ones, or of a
//! closure.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use http::Request;

use super::set::{from_parts, gather};
use super::{
    BoxKeySetFuture, KeyExtractor, KeyFromParts, KeyRejection, KeySetExtractor, KeySetFromParts,
    Keys,
};

/// Several single-key extractors, each key a resource of its own; see [`each`].
#[derive(Debug, Clone)]
pub struct Each<T> {
    members: T,
}

/// A multi-key extractor of two to four single-key extractors: each finds one key, and
/// each key names a resource of its own (unlike a tuple of [`KeyFromParts`], which joins
/// its parts into one key). The request is locked on all of them, as one lease.
///
/// A request without any of the keys has no key (the layer's
/// [`MissingKey`](crate::http::MissingKey) decides); one with some and not others gets
/// 400 `key-missing` naming the missing ones; nothing is locked.
///
/// Members are asked in order, each handed the request the previous one gave back: a
/// [`json_field`](super::json_field) member buffers the body once and the next one reads
/// those bytes again. For several fields of one JSON body,
/// [`json_fields`](super::json_fields) parses it once.
///
/// ```
/// use tower_redlock::http::{key::{each, header, json_field}, LockLayer, Scope};
/// use tower_redlock::Redlock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // A transfer from the account in the `x-account` header to the one in the body:
/// // both accounts locked, one lease.
/// let layer = LockLayer::new(
///     Redlock::in_memory(),
///     each((header("x-account"), json_field("/to"))),
/// )
/// .scope(Scope::shared("account"));
/// # let _ = layer;
/// # }
/// ```
pub fn each<T>(members: T) -> Each<T> {
    Each { members }
}

impl<T> Each<T> {
    /// The member extractors.
    pub fn members(&self) -> &T {
        &self.members
    }
}

macro_rules! each_of {
    ($count:literal; $($name:ident $index:tt),+) => {
        impl<$($name: KeyFromParts),+> KeySetFromParts for Each<($($name,)+)> {
            fn keys(&self, parts: &mut Parts) -> Result<Option<Keys>, KeyRejection> {
                let found = vec![$(self.members.$index.key(parts)?),+];
                gather(found, |index| KeySetFromParts::describe_key(self, index))
            }

            fn describe_keys(&self) -> String {
                [$(KeyFromParts::describe(&self.members.$index)),+].join(" and ")
            }

            fn describe_key(&self, index: usize) -> String {
                match index {
                    $($index => KeyFromParts::describe(&self.members.$index),)+
                    _ => format!("lock key {}", index + 1),
                }
            }
        }

        impl<Body, $($name: KeyExtractor<Body>),+> KeySetExtractor<Body> for Each<($($name,)+)>
        where
            Body: Send + 'static,
        {
            type Future = BoxKeySetFuture<Body>;

            fn extract_keys(&self, request: Request<Body>) -> Self::Future {
                let this = self.clone();
                Box::pin(async move {
                    let mut found = Vec::with_capacity($count);
                    $(
                        let (request, key) = this.members.$index.extract(request).await?;
                        found.push(key);
                    )+
                    let keys =
                        gather(found, |index| KeySetExtractor::<Body>::describe_key(&this, index))?;
                    Ok((request, keys))
                })
            }

            fn describe_keys(&self) -> String {
                [$(KeyExtractor::describe(&self.members.$index)),+].join(" and ")
            }

            fn describe_key(&self, index: usize) -> String {
                match index {
                    $($index => KeyExtractor::describe(&self.members.$index),)+
                    _ => format!("lock key {}", index + 1),
                }
            }
        }
    };
}

each_of!(2; K1 0, K2 1);
each_of!(3; K1 0, K2 1, K3 2);
each_of!(4; K1 0, K2 1, K3 2, K4 3);

/// What [`keys_fn`] reads the keys with.
type ReadKeys = dyn Fn(&Parts) -> Option<Vec<String>> + Send + Sync;

/// The keys are what a closure reads from the request head; see [`keys_fn`].
#[derive(Clone)]
pub struct KeysFn {
    // Type-erased: a multi-key extractor generic over its closure could not be told
    // apart from the single-key closures (`Fn(&Parts) -> Option<String>`) by coherence.
    keys: Arc<ReadKeys>,
}

/// A multi-key extractor from a closure over the request head: each key it returns
/// names a resource of its own. `None` or an empty list is no key (the layer's
/// [`MissingKey`](crate::http::MissingKey) decides). The layer checks each key as it
/// checks one, and a key-invalid problem names it by its position ("lock key 2").
///
/// ```
/// use http::request::Parts;
/// use tower_redlock::http::{key::keys_fn, LockLayer, Scope};
/// use tower_redlock::Redlock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // `x-warehouses: berlin, lyon`: reserve stock in both, one lease.
/// let warehouses = keys_fn(|parts: &Parts| {
///     let list = parts.headers.get("x-warehouses")?.to_str().ok()?;
///     Some(list.split(',').map(|w| w.trim().to_owned()).collect())
/// });
/// let layer = LockLayer::new(Redlock::in_memory(), warehouses).scope(Scope::shared("warehouse"));
/// # let _ = layer;
/// # }
/// ```
pub fn keys_fn<F>(keys: F) -> KeysFn
where
    F: Fn(&Parts) -> Option<Vec<String>> + Send + Sync + 'static,
{
    KeysFn {
        keys: Arc::new(keys),
    }
}

impl fmt::Debug for KeysFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeysFn").finish_non_exhaustive()
    }
}

impl KeySetFromParts for KeysFn {
    fn keys(&self, parts: &mut Parts) -> Result<Option<Keys>, KeyRejection> {
        Ok((self.keys)(parts)
            .filter(|keys| !keys.is_empty())
            .map(Keys::Many))
    }
}

impl<B: Send + 'static> KeySetExtractor<B> for KeysFn {
    type Future = std::future::Ready<super::KeySetResult<B>>;

    fn extract_keys(&self, request: Request<B>) -> Self::Future {
        from_parts(self, request)
    }
}
