//! Keys made of keys: [`Or`], [`Normalized`] (`parse`, `normalize`), tuples.

use std::fmt;

use http::request::Parts;

use super::{sealed, KeyExtractor, KeyRejection};
use crate::Resource;

/// `key` parsed as `T`, written back in `T`'s own form.
pub(super) fn canonical<T: std::str::FromStr + fmt::Display>(
    key: String,
) -> Result<String, String> {
    match key.parse::<T>() {
        Ok(value) => Ok(value.to_string()),
        Err(_) => Err(format!(
            "`{key}` is not a valid {}",
            std::any::type_name::<T>()
                .rsplit("::")
                .next()
                .unwrap_or("value")
        )),
    }
}

/// A key passed through a normalising function; see [`KeyExtractor::normalize`] and
/// [`KeyExtractor::parse`].
#[derive(Clone)]
pub struct Normalized<E, F> {
    pub(super) inner: E,
    pub(super) normalize: F,
}

impl<E: fmt::Debug, F> fmt::Debug for Normalized<E, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Normalized")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<E, F> KeyExtractor for Normalized<E, F>
where
    E: KeyExtractor<Keys = String>,
    F: Fn(String) -> Result<String, String> + Clone + Send + Sync + 'static,
{
    type Keys = String;
    type Body = E::Body;

    fn keys(&self, parts: &mut Parts, body: &[u8]) -> Result<Option<String>, KeyRejection> {
        match self.inner.keys(parts, body)? {
            None => Ok(None),
            Some(key) => (self.normalize)(key).map(Some).map_err(|detail| {
                KeyRejection::invalid(format!("{}: {detail}", self.inner.describe()))
            }),
        }
    }

    fn body_limit(&self) -> Option<usize> {
        self.inner.body_limit()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// One extractor with a fallback; see [`KeyExtractor::or`].
#[derive(Debug, Clone)]
pub struct Or<A, F> {
    pub(super) first: A,
    pub(super) fallback: F,
}

impl<A, F> KeyExtractor for Or<A, F>
where
    A: KeyExtractor<Keys = String>,
    F: KeyExtractor<Keys = String>,
{
    type Keys = String;
    type Body = <A::Body as sealed::Reads>::Or<F::Body>;

    fn keys(&self, parts: &mut Parts, body: &[u8]) -> Result<Option<String>, KeyRejection> {
        match self.first.keys(parts, body)? {
            Some(key) => Ok(Some(key)),
            None => self.fallback.keys(parts, body),
        }
    }

    fn body_limit(&self) -> Option<usize> {
        self.first.body_limit().max(self.fallback.body_limit())
    }

    fn describe(&self) -> String {
        format!("{} or {}", self.first.describe(), self.fallback.describe())
    }
}

/// The `Reads` of several extractors together: the body when any reads it.
macro_rules! reads {
    ($first:ident) => { $first::Body };
    ($first:ident, $($rest:ident),+) => {
        <$first::Body as $crate::http::key::sealed::Reads>::Or<reads!($($rest),+)>
    };
}
pub(crate) use reads;

macro_rules! tuple_key {
    ($($name:ident $index:tt),+) => {
        /// All parts are required; they are joined with [`Resource`] escaping, so
        /// different part lists never give the same key. An empty part is rejected.
        impl<$($name: KeyExtractor<Keys = String>),+> KeyExtractor for ($($name,)+) {
            type Keys = String;
            type Body = reads!($($name),+);

            fn keys(&self, parts: &mut Parts, body: &[u8]) -> Result<Option<String>, KeyRejection> {
                let mut joined: Option<Resource> = None;
                let mut missing = false;
                $(
                    match self.$index.keys(parts, body)? {
                        None => missing = true,
                        Some(part) if part.is_empty() => {
                            let detail = format!("{} is empty", self.$index.describe());
                            return Err(KeyRejection::invalid(detail));
                        }
                        Some(part) => {
                            joined = Some(match joined {
                                None => Resource::new(part),
                                Some(r) => r.join(part),
                            });
                        }
                    }
                )+
                Ok(joined.filter(|_| !missing).map(|r| r.as_str().to_owned()))
            }

            fn body_limit(&self) -> Option<usize> {
                [$(self.$index.body_limit()),+].into_iter().max().flatten()
            }

            fn describe(&self) -> String {
                [$(self.$index.describe()),+].join(" and ")
            }
        }
    };
}

tuple_key!(K1 0, K2 1);
tuple_key!(K1 0, K2 1, K3 2);
tuple_key!(K1 0, K2 1, K3 2, K4 3);
