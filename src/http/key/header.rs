//! [`Header`]: the key is a request header (an `Idempotency-Key` read as RFC 8941 String).

use std::fmt;

use http::header::HeaderName;
use http::request::Parts;

use super::{KeyFromParts, KeyRejection};

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
/// ```
/// use tower_redlock::http::key::{header, KeyFromParts};
///
/// let request = http::Request::post("/payments")
///     .header("Idempotency-Key", r#""8e03978e-40d5""#)
///     .body(())
///     .unwrap();
/// let (mut parts, ()) = request.into_parts();
/// let key = header("Idempotency-Key").key(&mut parts).unwrap();
/// assert_eq!(key.as_deref(), Some("8e03978e-40d5"));
/// ```
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

    /// Reads the value as an RFC 8941 String when it starts with a double quote, else
    /// as it is (default: on for `Idempotency-Key`, off for other headers).
    #[must_use]
    pub fn sf_string(mut self, on: bool) -> Self {
        self.sf_string = on;
        self
    }
}

/// The content of the RFC 8941 String `value` (which starts with `"`), or why it is
/// not one.
fn parse_sf_string(value: &str) -> Result<String, &'static str> {
    let mut chars = value.chars();
    if chars.next() != Some('"') {
        return Err("a String starts with a double quote");
    }
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

impl KeyFromParts for Header {
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        let mut values = parts.headers.get_all(&self.name).iter();
        match (values.next(), values.next()) {
            (None, _) => Ok(None),
            (Some(value), None) => {
                // Refused rather than replaced with U+FFFD: two different byte strings
                // must never name one lock.
                let text = std::str::from_utf8(value.as_bytes()).map_err(|_| {
                    KeyRejection::invalid(format!("the `{}` header is not UTF-8", self.name))
                })?;
                if self.sf_string && text.starts_with('"') {
                    return parse_sf_string(text).map(Some).map_err(|why| {
                        KeyRejection::invalid(format!(
                            "the `{}` header is not a valid structured-field String (RFC 8941): {why}",
                            self.name
                        ))
                    });
                }
                Ok(Some(text.to_owned()))
            }
            (Some(_), Some(_)) => Err(KeyRejection::invalid(format!(
                "the `{}` header appears more than once",
                self.name
            ))),
        }
    }

    fn describe(&self) -> String {
        format!("the `{}` header", self.name)
    }
}
