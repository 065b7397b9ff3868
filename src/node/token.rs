//! [`FencingToken`], the number the nodes' fence counters hand out. Why it
//! increases, and under which assumptions, is argued in [`fencing`](crate::fencing).

use std::fmt;

/// A number that increases strictly from one holder of a resource to the next.
///
/// Compare tokens of the same resource only. Display prints the decimal value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw value, for storages that read tokens back.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<FencingToken> for u64 {
    fn from(token: FencingToken) -> u64 {
        token.0
    }
}
