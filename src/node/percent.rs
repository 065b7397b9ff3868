//! Percent-decoding of URL components (user names, passwords, master names, prefixes),
//! shared by the Redis and etcd node URLs.

use crate::error::ConfigError;

/// Decodes `%XX` escapes (credentials, paths and parameters of node URLs).
pub(crate) fn percent_decode(s: &str) -> Result<String, ConfigError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| ConfigError::new("bad percent-encoding in URL"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| ConfigError::new("URL component is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_and_refuses_bad_escapes() {
        assert_eq!(percent_decode("a%40b%3A").unwrap(), "a@b:");
        assert!(percent_decode("%4").is_err());
    }
}
