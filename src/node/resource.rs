//! Resource names and the Redis keys derived from them.

use std::fmt;
use std::sync::Arc;

/// The name of a lockable thing, such as `order:42`.
///
/// A resource is a list of parts. Each part is escaped (`%`, `:`, `{` and `}` become
/// `%25`, `%3A`, `%7B`, `%7D`) and the parts are joined with `:`, so two different part
/// lists never name the same resource, and no part can break the Redis Cluster hash
/// tag of the keys.
///
/// **One spelling.** A string given where a resource is expected (`try_acquire("order:42")`,
/// `acquire_all(["account:bob", …])`, [`From<&str>`](#impl-From%3C%26str%3E-for-Resource))
/// reads `:` as the separator of its parts: `"order:42"` is
/// `Resource::new("order").join("42")`, which is exactly what a
/// [`LockLayer`](crate::http::LockLayer) with `Scope::shared("order")` locks for the key `42`
/// (and what a `Locked` extractor with that scope locks). A key that may itself contain
/// `:` is joined as a part, never formatted into a string:
/// `Resource::new("order").join(key)`, as the layer does.
///
/// ```
/// use tower_redlock::Resource;
///
/// let a = Resource::new("ab").join("c");
/// let b = Resource::new("a").join("bc");
/// assert_ne!(a, b);
/// assert_eq!(a.as_str(), "ab:c");
/// // `new` takes one part, `:` included; a string is a list of parts.
/// assert_eq!(Resource::new("a:b").as_str(), "a%3Ab");
/// assert_eq!(Resource::from("order:42"), Resource::new("order").join("42"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Resource(Arc<str>);

impl Resource {
    /// A resource of one part (a `:` in it is part of the part).
    pub fn new(part: impl AsRef<str>) -> Self {
        Resource(encode(None, part.as_ref()))
    }

    /// The resource `name` spells, its parts separated by `:` (see
    /// [One spelling](Resource#one-spelling)).
    fn from_name(name: &str) -> Self {
        // Nothing to escape: the name is its own encoding.
        if !name.bytes().any(|b| matches!(b, b'%' | b'{' | b'}')) {
            return Resource(Arc::from(name));
        }
        let mut parts = name.split(':');
        let first = Resource::new(parts.next().unwrap_or_default());
        parts.fold(first, |resource, part| resource.join(part))
    }

    /// This resource with one more part appended.
    #[must_use]
    pub fn join(&self, part: impl AsRef<str>) -> Self {
        Resource(encode(Some(&self.0), part.as_ref()))
    }

    /// The encoded name, as it appears inside the Redis keys.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The parts, unescaped, in order.
    ///
    /// ```
    /// use tower_redlock::Resource;
    ///
    /// let resource = Resource::new("POST").join("/invoices/{id}/send").join("7");
    /// let parts: Vec<String> = resource.parts().collect();
    /// assert_eq!(parts, ["POST", "/invoices/{id}/send", "7"]);
    /// ```
    pub fn parts(&self) -> impl Iterator<Item = String> + '_ {
        self.0.split(':').map(unescape)
    }

    /// The name for people: the parts as given, joined by `:`, e.g.
    /// `POST:/invoices/{id}/send:7` where [`as_str`](Resource::as_str) reads
    /// `POST:/invoices/%7Bid%7D/send:7`. Problem bodies show this. It is not an
    /// identifier: a part that contains `:` reads as two (compare resources, or
    /// [`as_str`](Resource::as_str), instead).
    ///
    /// ```
    /// use tower_redlock::Resource;
    ///
    /// let resource = Resource::new("POST").join("/invoices/{id}/send").join("7");
    /// assert_eq!(resource.display_name(), "POST:/invoices/{id}/send:7");
    /// assert_eq!(resource.as_str(), "POST:/invoices/%7Bid%7D/send:7");
    /// ```
    pub fn display_name(&self) -> String {
        if !self.0.contains('%') {
            return self.0.to_string();
        }
        self.parts().collect::<Vec<_>>().join(":")
    }
}

/// One part as it was given: the four escapes undone.
fn unescape(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    let mut rest = part;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let escaped = rest.get(at..at + 3);
        let byte = match escaped {
            Some("%25") => Some('%'),
            Some("%3A") => Some(':'),
            Some("%7B") => Some('{'),
            Some("%7D") => Some('}'),
            _ => None,
        };
        match byte {
            Some(c) => {
                out.push(c);
                rest = &rest[at + 3..];
            }
            // Not an escape this module wrote (a name given whole): kept as it is.
            None => {
                out.push('%');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The characters a part may not contain as they are.
fn is_escaped(byte: u8) -> bool {
    matches!(byte, b'%' | b':' | b'{' | b'}')
}

/// `parent` and `:`, then `part` escaped (only `part`, escaped, for a resource of one
/// part). A resource is built on every acquisition: this allocates once, the
/// `Arc<str>` itself.
fn encode(parent: Option<&str>, part: &str) -> Arc<str> {
    // Names up to this long are escaped on the stack, then copied into the `Arc`.
    const INLINE: usize = 256;
    let head = parent.map_or(0, |parent| parent.len() + 1);
    // Escaping at most triples a part, so this bound needs no counting pass.
    if head + 3 * part.len() > INLINE {
        let escapes = part.bytes().filter(|&b| is_escaped(b)).count();
        let mut encoded = String::with_capacity(head + part.len() + 2 * escapes);
        if let Some(parent) = parent {
            encoded.push_str(parent);
            encoded.push(':');
        }
        escape_into(&mut encoded, part);
        return encoded.into();
    }
    let mut rest = part.as_bytes();
    let mut next = rest.iter().position(|&b| is_escaped(b));
    if next.is_none() && parent.is_none() {
        return Arc::from(part);
    }
    let mut buf = [0u8; INLINE];
    if let Some(parent) = parent {
        buf[..parent.len()].copy_from_slice(parent.as_bytes());
        buf[parent.len()] = b':';
    }
    let mut at = head;
    // The runs between escaped characters are copied whole.
    while let Some(run) = next {
        buf[at..at + run].copy_from_slice(&rest[..run]);
        buf[at + run..at + run + 3].copy_from_slice(escape(rest[run]).as_bytes());
        at += run + 3;
        rest = &rest[run + 1..];
        next = rest.iter().position(|&b| is_escaped(b));
    }
    buf[at..at + rest.len()].copy_from_slice(rest);
    at += rest.len();
    // Only ASCII bytes were replaced, by ASCII, so the buffer is as valid as the input
    // and the lossy branch never runs.
    match std::str::from_utf8(&buf[..at]) {
        Ok(encoded) => Arc::from(encoded),
        Err(_) => Arc::from(String::from_utf8_lossy(&buf[..at]).as_ref()),
    }
}

fn escape(byte: u8) -> &'static str {
    match byte {
        b'%' => "%25",
        b':' => "%3A",
        b'{' => "%7B",
        _ => "%7D",
    }
}

fn escape_into(out: &mut String, part: &str) {
    // Copies the runs between the escaped characters whole (all four are ASCII, so
    // every split lands on a character boundary).
    let mut rest = part;
    while let Some(at) = rest.bytes().position(is_escaped) {
        out.push_str(&rest[..at]);
        out.push_str(escape(rest.as_bytes()[at]));
        rest = &rest[at + 1..];
    }
    out.push_str(rest);
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Resource({:?})", &*self.0)
    }
}

/// The resource the string spells, `:` separating its parts (see
/// [One spelling](Resource#one-spelling)).
impl From<&str> for Resource {
    fn from(name: &str) -> Self {
        Resource::from_name(name)
    }
}

/// As [`From<&str>`](#impl-From%3C%26str%3E-for-Resource).
impl From<String> for Resource {
    fn from(name: String) -> Self {
        Resource::from_name(&name)
    }
}

/// As [`From<&str>`](#impl-From%3C%26str%3E-for-Resource).
impl From<&String> for Resource {
    fn from(name: &String) -> Self {
        Resource::from_name(name)
    }
}

impl From<&Resource> for Resource {
    fn from(resource: &Resource) -> Self {
        resource.clone()
    }
}

/// What the wait queue's key adds to the lock key.
pub(crate) const QUEUE_SUFFIX: &str = ":queue";
/// What a waiting writer's intent key adds to the lock key; the acquire script knows
/// it too.
pub(crate) const WRITER_SUFFIX: &str = ":writer";
/// What the key of shared holders' limit adds to the lock key (see `acquire.lua`).
#[cfg(feature = "redis")]
pub(crate) const LIMIT_SUFFIX: &str = ":limit";
/// The suffix of the release channel's name (`ResourceKeys::channel`); the acquire script
/// knows it too.
pub(crate) const CHANNEL_SUFFIX: &str = ":released";

/// The keys a node uses for one resource: `{prefix}{<resource>}` for the lock,
/// `…:fence` for the fence counter and `…:released` for the wake-up channel.
/// The braces form a Redis Cluster hash tag, so all three map to one slot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ResourceKeys {
    /// The lock key, holding the owner value.
    pub lock: String,
    /// The fence counter key.
    pub fence: String,
    /// The pub/sub channel the release script publishes on.
    pub channel: String,
}

impl ResourceKeys {
    /// The wait queue's key (a sorted set of waiter ids, see
    /// [`Capabilities::wait_queue`](crate::node::Capabilities::wait_queue)): the lock key and `:queue`.
    pub fn queue(&self) -> String {
        [self.lock.as_str(), QUEUE_SUFFIX].concat()
    }

    /// A waiting writer's intent (see [`LockMode`](crate::LockMode)): the
    /// lock key and `:writer`, in the same slot.
    pub fn writer(&self) -> String {
        [self.lock.as_str(), WRITER_SUFFIX].concat()
    }

    pub(crate) fn new(prefix: &str, resource: &Resource) -> Self {
        // Built by hand: `format!` costs several times as much, on every acquisition.
        let name = resource.as_str();
        let mut lock = String::with_capacity(prefix.len() + name.len() + 2);
        lock.push_str(prefix);
        lock.push('{');
        lock.push_str(name);
        lock.push('}');
        let with_suffix = |suffix: &str| {
            let mut key = String::with_capacity(lock.len() + suffix.len());
            key.push_str(&lock);
            key.push_str(suffix);
            key
        };
        ResourceKeys {
            fence: with_suffix(":fence"),
            channel: with_suffix(CHANNEL_SUFFIX),
            lock,
        }
    }
}
