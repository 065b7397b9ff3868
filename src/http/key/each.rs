//! [`Each`] and [`KeysFn`]: multi-key extractors made of single-key ones, or of a
//! closure.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;

use super::{reads, KeyExtractor, KeyRejection};

/// Several single-key extractors, each key a resource of its own; see [`each`].
#[derive(Debug, Clone)]
pub struct Each<T> {
    members: T,
}

/// A multi-key extractor of two to four single-key extractors: each finds one key, and
/// each key names a resource of its own (unlike a tuple, which joins its parts into one
/// key). The request is locked on all of them, as one lease: e.g.
/// `each((header("x-account"), json_field("/to")))`. For several fields of one JSON body,
/// [`json_fields`](super::json_fields) parses it once.
pub fn each<T>(members: T) -> Each<T> {
    Each { members }
}

macro_rules! each_of {
    ($($name:ident $index:tt),+) => {
        impl<$($name: KeyExtractor<Keys = String>),+> KeyExtractor for Each<($($name,)+)> {
            type Keys = Vec<String>;
            type Body = reads!($($name),+);

            fn keys(&self, parts: &mut Parts, body: &[u8]) -> Result<Option<Vec<String>>, KeyRejection> {
                let found = vec![$(self.members.$index.keys(parts, body)?),+];
                gather(found, |index| self.describe_key(index))
            }

            // The tuple's: the largest limit, the parts' descriptions joined.
            fn body_limit(&self) -> Option<usize> {
                self.members.body_limit()
            }

            fn describe(&self) -> String {
                self.members.describe()
            }

            fn describe_key(&self, index: usize) -> String {
                match index {
                    $($index => self.members.$index.describe(),)+
                    _ => format!("lock key {}", index + 1),
                }
            }
        }
    };
}

each_of!(K1 0, K2 1);
each_of!(K1 0, K2 1, K3 2);
each_of!(K1 0, K2 1, K3 2, K4 3);

/// What [`keys_fn`] reads the keys with.
type ReadKeys = dyn Fn(&Parts) -> Option<Vec<String>> + Send + Sync;

/// The keys are what a closure reads from the request head; see [`keys_fn`].
#[derive(Clone)]
pub struct KeysFn {
    // Type-erased: a multi-key extractor generic over its closure would overlap the
    // single-key closures (`Fn(&Parts) -> Option<String>`) for coherence.
    keys: Arc<ReadKeys>,
}

/// A multi-key extractor from a closure over the request head: each key it returns
/// names a resource of its own. `None` or an empty list is no key. A key-invalid
/// problem names a key by its position ("lock key 2"). Examples: [the
/// guide](crate::guide::keys).
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

impl KeyExtractor for KeysFn {
    type Keys = Vec<String>;
    type Body = ();

    fn keys(&self, parts: &mut Parts, _body: &[u8]) -> Result<Option<Vec<String>>, KeyRejection> {
        Ok((self.keys)(parts).filter(|keys| !keys.is_empty()))
    }

    fn describe(&self) -> String {
        "lock keys".to_owned()
    }
}

/// The keys of several members, each `None` when the request lacks it: all absent is no
/// key (`Ok(None)`), some absent is a request the layer cannot lock (400 `key-missing`,
/// naming them), all present are the keys.
pub(crate) fn gather(
    found: Vec<Option<String>>,
    describe: impl Fn(usize) -> String,
) -> Result<Option<Vec<String>>, KeyRejection> {
    let missing: Vec<String> = found
        .iter()
        .enumerate()
        .filter(|(_, key)| key.is_none())
        .map(|(index, _)| describe(index))
        .collect();
    if missing.len() == found.len() {
        return Ok(None);
    }
    if !missing.is_empty() {
        return Err(KeyRejection::missing(format!(
            "no lock key: expected {}",
            missing.join(" and ")
        )));
    }
    Ok(Some(found.into_iter().flatten().collect()))
}
