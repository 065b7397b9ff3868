//! Plain values of the public API: how a [`Resource`] spells its parts (distinct part
//! lists never collide, the escaping is the documented one, the parts read back as
//! given), which [`LockOptions`] a locker refuses, and [`Backoff`]'s bounds.

use std::time::Duration;

use tower_redlock::{Backoff, LockOptions, MemoryNode, Redlock, Resource, RetryPolicy};

#[test]
fn different_part_lists_never_collide() {
    let lists: &[&[&str]] = &[
        &["ab", "c"],
        &["a", "bc"],
        &["a:b", "c"],
        &["a", "b:c"],
        &["a", "b", "c"],
        &["a%3Ab", "c"],
        &["", ""],
        &[":"],
        &[""],
        &["%"],
        &["{a}"],
    ];
    let encoded: Vec<Resource> = lists
        .iter()
        .map(|parts| {
            let mut r = Resource::new(parts[0]);
            for p in &parts[1..] {
                r = r.join(p);
            }
            r
        })
        .collect();
    for (i, a) in encoded.iter().enumerate() {
        for (j, b) in encoded.iter().enumerate() {
            if i != j {
                assert_ne!(a, b, "{:?} and {:?} collide", lists[i], lists[j]);
            }
        }
    }
}

/// The encoding as documented, written the plain way.
fn reference(parts: &[&str]) -> String {
    parts
        .iter()
        .map(|part| {
            part.chars()
                .map(|c| match c {
                    '%' => "%25".to_owned(),
                    ':' => "%3A".to_owned(),
                    '{' => "%7B".to_owned(),
                    '}' => "%7D".to_owned(),
                    c => c.to_string(),
                })
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join(":")
}

#[test]
fn encoding_on_and_off_the_stack() {
    let long_plain = "é".repeat(200);
    let long_escaped = ":{x}%".repeat(60);
    let nearly_inline = "x".repeat(250);
    let long_parent = "y".repeat(200);
    let parts: &[&[&str]] = &[
        &["plain"],
        &["a:b"],
        &["é{ü}:%"],
        &[""],
        &["a", ""],
        &[&long_plain],
        &[&long_escaped],
        &["a", &long_escaped],
        &[&long_plain, "b:c"],
        &[&nearly_inline, ":"],
        &[&long_parent, ":x:"],
        &[&long_parent, "é:{"],
    ];
    for list in parts {
        let mut resource = Resource::new(list[0]);
        for part in &list[1..] {
            resource = resource.join(part);
        }
        assert_eq!(resource.as_str(), reference(list));
    }
}

#[test]
fn parts_read_back_as_given() {
    let lists: &[&[&str]] = &[
        &["POST", "/invoices/{id}/send", "7"],
        &["a:b", "%7B", ""],
        &["%", "%%3A", "é{ü}"],
    ];
    for list in lists {
        let mut resource = Resource::new(list[0]);
        for part in &list[1..] {
            resource = resource.join(part);
        }
        assert_eq!(resource.parts().collect::<Vec<_>>(), *list);
        assert_eq!(resource.display_name(), list.join(":"));
    }
}

#[test]
fn a_string_spells_its_parts() {
    assert_eq!(
        Resource::from("order:42"),
        Resource::new("order").join("42")
    );
    assert_eq!(Resource::from("a"), Resource::new("a"));
    assert_eq!(
        Resource::from("a:b:c"),
        Resource::new("a").join("b").join("c")
    );
    assert_eq!(Resource::from("a{b}:%"), Resource::new("a{b}").join("%"));
    assert_eq!(Resource::from(""), Resource::new(""));
    assert_eq!(
        Resource::from(String::from("x:")),
        Resource::new("x").join("")
    );
}

/// Every option value that cannot work is refused when the locker is built; the
/// defaults are accepted.
#[tokio::test]
async fn options_that_cannot_work_are_refused() {
    Redlock::new([MemoryNode::new()], LockOptions::default()).unwrap();
    let bad = [
        LockOptions::default().ttl(Duration::ZERO),
        LockOptions::default().ttl(Duration::from_millis(10)),
        LockOptions::default().ttl(Duration::from_secs(365 * 24 * 3600)),
        LockOptions::default().node_timeout(Duration::ZERO),
        LockOptions::default().node_timeout(Duration::MAX),
        LockOptions::default().min_validity(Duration::MAX),
        LockOptions::default().drift_factor(0.5),
        LockOptions::default().drift_factor(f64::NAN),
        LockOptions::default().drift_factor(-0.1),
        LockOptions::default().key_prefix("a{b}"),
        LockOptions::default().fence_ttl(Duration::from_secs(1)),
        LockOptions::default().max_hold(Some(Duration::ZERO)),
        LockOptions::default().max_waiters(0),
        LockOptions::default().setup_check_interval(Duration::ZERO),
    ];
    for options in bad {
        let description = format!("{options:?}");
        assert!(
            Redlock::new([MemoryNode::new()], options)
                .unwrap_err()
                .to_string()
                .starts_with("invalid lock configuration"),
            "{description}"
        );
    }
}

#[test]
fn backoff_stays_within_bounds() {
    let b = Backoff::default();
    for attempt in 1..40 {
        assert!(b.delay(attempt, None) <= b.max);
        assert!(b.delay(attempt, Some(Duration::from_millis(3))) <= Duration::from_millis(4));
    }
}
