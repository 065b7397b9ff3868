//! [`QueryParam`]: the key is a query parameter.

use std::sync::Arc;

use http::request::Parts;

use super::{KeyFromParts, KeyRejection};

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

impl KeyFromParts for QueryParam {
    fn key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
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
                return Err(KeyRejection::invalid(format!(
                    "the `{}` query parameter appears more than once",
                    self.name
                )));
            }
            let value = decode_component(value).ok_or_else(|| {
                KeyRejection::invalid(format!("the `{}` query parameter is not UTF-8", self.name))
            })?;
            found = Some(value);
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
