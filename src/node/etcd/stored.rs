//! The encoding of a record key's value.

use super::*;

/// A record key's value: a pending marker or a completed record.
///
/// Layout: `b'd'` (done) or `b'p'` (pending), an orphan byte (0 or 1), the token as
/// 8 bytes big-endian, the fingerprint's length as 4 bytes big-endian, the
/// fingerprint, then the data.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Stored {
    pub(super) done: bool,
    pub(super) orphan: bool,
    pub(super) token: u64,
    pub(super) fingerprint: Bytes,
    pub(super) data: Bytes,
}

impl Stored {
    const HEADER: usize = 1 + 1 + 8 + 4;

    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::HEADER + self.fingerprint.len() + self.data.len());
        out.push(if self.done { b'd' } else { b'p' });
        out.push(u8::from(self.orphan));
        out.extend_from_slice(&self.token.to_be_bytes());
        let len = u32::try_from(self.fingerprint.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&self.fingerprint);
        out.extend_from_slice(&self.data);
        out
    }

    pub(super) fn decode(value: &[u8]) -> Result<Self, NodeError> {
        let bad = || NodeError::Protocol("the record key holds no record of this crate".into());
        if value.len() < Self::HEADER {
            return Err(bad());
        }
        let done = match value[0] {
            b'd' => true,
            b'p' => false,
            _ => return Err(bad()),
        };
        let orphan = value[1] == 1;
        let token = u64::from_be_bytes(value[2..10].try_into().map_err(|_| bad())?);
        let len = u32::from_be_bytes(value[10..14].try_into().map_err(|_| bad())?);
        let len = usize::try_from(len).map_err(|_| bad())?;
        let rest = &value[Self::HEADER..];
        if rest.len() < len {
            return Err(bad());
        }
        Ok(Stored {
            done,
            orphan,
            token,
            fingerprint: Bytes::copy_from_slice(&rest[..len]),
            data: Bytes::copy_from_slice(&rest[len..]),
        })
    }

    pub(super) fn completed(&self) -> Option<Record> {
        self.done.then(|| {
            Record::new(
                FencingToken::new(self.token),
                self.fingerprint.clone(),
                self.data.clone(),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_garbage_is_an_error() {
        let stored = Stored {
            done: true,
            orphan: false,
            token: 42,
            fingerprint: Bytes::from_static(b"fp"),
            data: Bytes::from_static(b"data"),
        };
        assert!(Stored::decode(&stored.encode()).unwrap() == stored);
        assert!(Stored::decode(b"").is_err());
        assert!(Stored::decode(b"x\0\0\0\0\0\0\0\0\0\0\0\0\0").is_err());
        let mut short = stored.encode();
        short.truncate(Stored::HEADER + 1);
        assert!(Stored::decode(&short).is_err());
    }
}
