//! The fencing-token response header (its format: [the module docs](super#several-keys-per-request)).

use std::fmt::Write as _;

use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::LeaseHandle;

/// Sets `name` on `headers` to the tokens of `lease`, replacing what was there. A
/// locker without fencing (token 0) sets nothing.
pub(crate) fn set_fencing_header(headers: &mut HeaderMap, name: &HeaderName, lease: &LeaseHandle) {
    let resources = lease.resources();
    if resources.len() <= 1 {
        if let token @ 1.. = lease.fencing_token().get() {
            headers.insert(name.clone(), HeaderValue::from(token));
        }
        return;
    }
    headers.remove(name);
    for resource in resources {
        let Some(token) = lease.fencing_token_of(resource).filter(|t| t.get() > 0) else {
            continue;
        };
        let mut entry = format!("{token};resource=");
        push_sf_text(&mut entry, resource.as_str());
        // Every byte is visible ASCII: `push_sf_text` encodes the rest.
        if let Ok(value) = HeaderValue::from_str(&entry) {
            headers.append(name.clone(), value);
        }
    }
}

/// `text` as an RFC 9651 String when it is printable ASCII, else as a Display String.
fn push_sf_text(out: &mut String, text: &str) {
    if text.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        out.push('"');
        for c in text.chars() {
            if matches!(c, '"' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        return;
    }
    out.push_str("%\"");
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' && b != b'"' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02x}");
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::push_sf_text;

    fn sf(text: &str) -> String {
        let mut out = String::new();
        push_sf_text(&mut out, text);
        out
    }

    #[test]
    fn resources_are_strings_or_display_strings() {
        assert_eq!(sf("account:a"), r#""account:a""#);
        assert_eq!(sf(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(sf("café"), r#"%"caf%c3%a9""#);
        assert_eq!(sf("é%\""), r#"%"%c3%a9%25%22""#);
    }
}
