//! The keys of the request head: [`header`], [`query_param`], [`path_param`].

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::request::Parts;

use super::{KeyExtractor, KeyRejection};

/// The key is the value of a request header; see [`header`].
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
    sf_string: bool,
}

/// The key is the value of the header `name` (e.g. `Idempotency-Key`). A header sent
/// twice, or a value that is not UTF-8, is rejected (`key-invalid`).
///
/// For `Idempotency-Key` the value is read as the IETF draft defines it, an
/// [RFC 8941](https://www.rfc-editor.org/rfc/rfc8941#name-strings) *String*:
/// `"8e03978e-40d5"` gives the key `8e03978e-40d5` (the quotes are syntax, `\"` and
/// `\\` are escapes), and a bare value as Stripe's clients send it (`8e03978e-40d5`)
/// is taken as it is; a value that opens a quote but is not a valid String is
/// rejected (`key-invalid`). [`Header::sf_string`] turns this reading on or off for any
/// header.
///
/// # Panics
///
/// When `name` is not a valid header name.
pub fn header<N>(name: N) -> Header
where
    N: TryInto<HeaderName>,
    N::Error: fmt::Display,
{
    match name.try_into() {
        Ok(name) => {
            let sf_string = name == IDEMPOTENCY_KEY;
            Header { name, sf_string }
        }
        Err(e) => panic!("invalid header name for a lock key: {e}"),
    }
}

/// The header of the IETF draft *The Idempotency-Key HTTP Header Field*.
const IDEMPOTENCY_KEY: &str = "idempotency-key";

impl Header {
    /// The header's name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    setters!({
        /// Reads the value as an RFC 8941 String when it starts with a double quote, else
        /// as it is (default: on for `Idempotency-Key`, off for other headers).
        sf_string: bool;
    });
}

/// 400 `key-invalid`: what `extractor` looks for is there, and `why` it is unusable.
fn invalid(extractor: &impl KeyExtractor, why: &str) -> KeyRejection {
    KeyRejection::invalid(format!("{} {why}", extractor.describe()))
}

/// The content of the RFC 8941 String `value` (which starts with `"`), or why it is
/// not one.
fn parse_sf_string(value: &str) -> Result<String, &'static str> {
    let mut chars = value.chars().skip(1);
    let mut out = String::with_capacity(value.len());
    loop {
        match chars.next() {
            None => return Err("the closing double quote is missing"),
            Some('"') => break,
            Some('\\') => match chars.next() {
                Some(c @ ('"' | '\\')) => out.push(c),
                _ => return Err("only \\\" and \\\\ may be escaped"),
            },
            Some(c @ ' '..='~') => out.push(c),
            Some(_) => return Err("a String holds visible ASCII and spaces only"),
        }
    }
    if chars.next().is_some() {
        return Err("characters follow the closing double quote");
    }
    Ok(out)
}

impl KeyExtractor for Header {
    type Keys = String;
    type Body = ();

    fn keys(&self, parts: &mut Parts, _body: &[u8]) -> Result<Option<String>, KeyRejection> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(invalid(self, "appears more than once"));
        }
        // Refused rather than replaced with U+FFFD: two different byte strings must never
        // name one lock.
        let text =
            std::str::from_utf8(value.as_bytes()).map_err(|_| invalid(self, "is not UTF-8"))?;
        if !(self.sf_string && text.starts_with('"')) {
            return Ok(Some(text.to_owned()));
        }
        parse_sf_string(text).map(Some).map_err(|why| {
            let why = format!("is not a valid structured-field String (RFC 8941): {why}");
            invalid(self, &why)
        })
    }

    fn describe(&self) -> String {
        format!("the `{}` header", self.name)
    }
}

/// The key is a query parameter; see [`query_param`].
#[derive(Debug, Clone)]
pub struct QueryParam {
    name: Arc<str>,
}

/// The key is the query parameter `name`, percent-decoded (`+` is a space). A
/// parameter given twice is rejected (`key-invalid`).
pub fn query_param(name: impl Into<Arc<str>>) -> QueryParam {
    QueryParam { name: name.into() }
}

impl KeyExtractor for QueryParam {
    type Keys = String;
    type Body = ();

    fn keys(&self, parts: &mut Parts, _body: &[u8]) -> Result<Option<String>, KeyRejection> {
        let Some(query) = parts.uri.query() else {
            return Ok(None);
        };
        let mut found = None;
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if decode_component(name).as_deref() != Some(&*self.name) {
                continue;
            }
            if found.is_some() {
                return Err(invalid(self, "appears more than once"));
            }
            found = Some(decode_component(value).ok_or_else(|| invalid(self, "is not UTF-8"))?);
        }
        Ok(found)
    }

    fn describe(&self) -> String {
        format!("the `{}` query parameter", self.name)
    }
}

/// Decodes one `application/x-www-form-urlencoded` component; `None` if not UTF-8.
/// A `%` not followed by two hex digits stays as it is.
fn decode_component(input: &str) -> Option<String> {
    let bytes = input.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes.get(i + 1..i + 3).and_then(|h| {
                    let h = std::str::from_utf8(h).ok()?;
                    u8::from_str_radix(h, 16).ok()
                });
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// The key is a path parameter of the matched axum route; see [`path_param`].
#[cfg(feature = "axum")]
#[derive(Debug, Clone)]
pub struct PathParam {
    name: Arc<str>,
}

/// The key is the path parameter `name` of the matched axum route, percent-decoded
/// (e.g. `id` in `/orders/{id}`). A matched route without a parameter of that name
/// is a server mistake: 500 `key-misconfigured`, logged as an error.
///
/// Path parameters exist only after routing: apply the layer inside the router.
/// Outside a router no key is found (and a warning is logged). Lock the key as the
/// handler reads it: [`KeyExtractor::parse`], [`KeyExtractor::normalize`].
#[cfg(feature = "axum")]
pub fn path_param(name: impl Into<Arc<str>>) -> PathParam {
    PathParam { name: name.into() }
}

#[cfg(feature = "axum")]
impl KeyExtractor for PathParam {
    type Keys = String;
    type Body = ();

    fn keys(&self, parts: &mut Parts, _body: &[u8]) -> Result<Option<String>, KeyRejection> {
        use axum::extract::rejection::RawPathParamsRejection;
        use axum::extract::{FromRequestParts, RawPathParams};
        use futures_util::FutureExt;

        // axum's extractor reads the parameters routing left in the extensions; its
        // future is ready at once.
        match RawPathParams::from_request_parts(parts, &()).now_or_never() {
            Some(Ok(params)) => {
                let found = params
                    .iter()
                    .find(|(name, _)| *name == &*self.name)
                    .map(|(_, value)| value.to_owned());
                // A matched route without the parameter is the server's mistake (a
                // typo, or the layer on the wrong route), never the client's: 500, not
                // 400. Without a matched route (the router's fallback under
                // `Router::layer`) there is simply no key.
                match (found, parts.extensions.get::<axum::extract::MatchedPath>()) {
                    (None, Some(route)) => {
                        let detail = format!(
                            "the route `{}` has no path parameter `{}` to take the lock key from",
                            route.as_str(),
                            self.name
                        );
                        tracing::error!("lock key misconfigured: {detail}");
                        Err(KeyRejection::misconfigured(detail))
                    }
                    (found, _) => Ok(found),
                }
            }
            Some(Err(RawPathParamsRejection::InvalidUtf8InPathParam(_))) => {
                Err(invalid(self, "is not UTF-8"))
            }
            Some(Err(_)) | None => {
                tracing::warn!(
                    param = %self.name,
                    "no path parameters: apply the lock layer inside the axum router (route_layer or layer)"
                );
                Ok(None)
            }
        }
    }

    fn describe(&self) -> String {
        format!("the `{}` path parameter", self.name)
    }
}
