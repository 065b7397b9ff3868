use super::acquire::{acquire_granted, parse_acquire};
use super::*;
use crate::node::{Acquire as Request, LockMode, PerKey, Vote};

#[test]
fn acquire_goes_by_hash_with_exact_arguments() {
    assert!(ACQUIRE.code.contains("redis.call('INCR', key)"));
    let keys = ResourceKeys::new("p:", &crate::node::Resource::new("r"));
    let owner = Owner::random();
    let request = try_acquire(
        &keys,
        &owner,
        Duration::from_secs(60),
        1_838_556_217_040_896,
    );
    let Acquire::Pipelined(pipelined) = Acquire::new(&(&request).into(), false) else {
        panic!("fencing on, no waiter, standalone: the pipeline");
    };
    let sent: Vec<Vec<String>> = pipelined.pipe.cmd_iter().map(words).collect();
    assert_eq!(
        sent[0],
        ["SET", &keys.lock, owner.as_str(), "NX", "PX", "1500"]
    );
    assert_eq!(sent[1], ["EXISTS", keys.queue().as_str()]);
    // The floor goes out as the exact decimal string, never through a float.
    assert_eq!(
        sent[2][2..],
        ["1", keys.fence.as_str(), "1838556217040896", "60000"]
    );
    assert_eq!(sent[2][0], "EVALSHA");
    // Behind waiters, the acquire script finishes the call, as a caller that does not
    // wait sends it, plus ARGV[12].
    let queued = words(&pipelined.queued_call().evalsha);
    assert_eq!(queued[0], "EVALSHA");
    assert_eq!(
        queued[2..],
        [
            "3",
            &keys.lock,
            &keys.fence,
            &keys.queue(),
            owner.as_str(),
            "1500",
            "60000",
            "1838556217040896",
            "1",
            &keys.channel,
            "0",
            "1000",
            "",
            "0",
            "0",
            "1"
        ],
        "the common call leaves out every argument whose default the script knows"
    );
    let Acquire::Script(call) = Acquire::new(&(&request).into(), true) else {
        panic!("a cluster: the script");
    };
    assert_eq!(
        words(&call.evalsha)[10..],
        ["1", &keys.channel, "1", "1000"]
    );
    let waiter = crate::node::Waiter {
        id: "w1".into(),
        ticket: 7,
        queue_ttl: Duration::from_secs(2),
    };
    let waiting = Request {
        waiter: Some(&waiter),
        seed_only_when_missing: true,
        ..request
    };
    let Acquire::Script(call) = Acquire::new(&(&waiting).into(), true) else {
        panic!("a waiter: the script");
    };
    let sent = words(&call.evalsha);
    assert_eq!(
        sent[10..],
        ["s", &keys.channel, "1", "1000", "w1", "7", "2000"]
    );
}

/// A fenced `try_acquire` of a 1.5 s lease (no waiter).
fn try_acquire<'a>(
    keys: &'a ResourceKeys,
    owner: &'a Owner,
    fence_ttl: Duration,
    fence_floor: u64,
) -> Request<'a> {
    Request {
        keys: std::slice::from_ref(keys),
        owner,
        mode: LockMode::Exclusive,
        ttl: Duration::from_millis(1500),
        fence_ttl,
        fencing: true,
        fence_floor,
        seed_only_when_missing: false,
        waiter: None,
    }
}

/// A command's words, as text.
fn words(cmd: &redis::Cmd) -> Vec<String> {
    cmd.args_iter()
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            _ => "<cursor>".to_owned(),
        })
        .collect()
}

#[test]
fn parses_acquire_replies() {
    let granted = Value::Array(vec![
        Value::Int(1),
        Value::BulkString(b"1838556217040896".to_vec()),
    ]);
    assert!(acquire_granted(&granted));
    assert_eq!(
        parse_acquire(&granted).unwrap(),
        Vote::Granted {
            fences: PerKey::one(1_838_556_217_040_896)
        }
    );
    let held = Value::Array(vec![Value::Int(0), Value::Int(250)]);
    assert!(!acquire_granted(&held));
    assert_eq!(
        parse_acquire(&held).unwrap(),
        Vote::Held {
            member: 0,
            pttl: Some(Duration::from_millis(250))
        }
    );
    // A set: every member's token, or the first member held (1-based) after the pttl.
    let set = Value::Array(vec![Value::Int(1), Value::Int(7), Value::Int(9)]);
    assert_eq!(
        parse_acquire(&set).unwrap(),
        Vote::Granted {
            fences: vec![7, 9].into()
        }
    );
    let held = Value::Array(vec![Value::Int(0), Value::Int(-1), Value::Int(2)]);
    assert_eq!(
        parse_acquire(&held).unwrap(),
        Vote::Held {
            member: 1,
            pttl: None
        }
    );
    let other = Value::Array(vec![Value::Int(2), Value::Int(0)]);
    assert_eq!(
        parse_acquire(&other).unwrap(),
        Vote::OtherMode {
            held: LockMode::Shared
        }
    );
    assert!(parse_acquire(&Value::Int(1)).is_err());
    assert!(parse_acquire(&Value::Array(vec![Value::Int(1), Value::Int(-5)])).is_err());
}

#[test]
fn parses_flags() {
    assert!(parse_flag(Value::Int(1)).unwrap());
    assert!(!parse_flag(Value::Int(0)).unwrap());
    assert!(parse_flag(Value::Nil).is_err());
}

#[test]
fn release_publishes_sharded_only_when_asked() {
    let keys = ResourceKeys::new("p:", &crate::node::Resource::new("r"));
    let owner = Owner::random();
    let release = |keys: &ResourceKeys, sharded| {
        let keys = std::slice::from_ref(keys);
        words(
            &ReleaseCall::new(keys, owner.as_str(), Hand::Next, false, sharded)
                .0
                .evalsha,
        )
    };
    let (plain, sharded) = (release(&keys, false), release(&keys, true));
    // EVALSHA sha 2 lock queue owner [sharded hold leaving back_to shared channel]
    assert_eq!(
        plain[2..],
        ["2", &keys.lock, &keys.queue(), owner.as_str()],
        "the script's defaults: the usual channel, not sharded, HANDOFF_TTL"
    );
    assert_eq!(
        sharded[6..],
        ["1", "1000", "", "", "0", keys.channel.as_str()]
    );
    // A channel of another name, or none (the test kit's undo), goes out with the rest.
    for channel in ["elsewhere", ""] {
        let other = ResourceKeys {
            channel: channel.into(),
            ..keys.clone()
        };
        assert_eq!(
            release(&other, false)[6..],
            ["0", "1000", "", "", "0", channel]
        );
    }
}

#[test]
fn a_fence_ttl_by_default_is_left_to_the_script() {
    let keys = ResourceKeys::new("p:", &crate::node::Resource::new("r"));
    let owner = Owner::random();
    let request = try_acquire(&keys, &owner, DEFAULT_FENCE_TTL, 7);
    let Acquire::Pipelined(pipelined) = Acquire::new(&(&request).into(), false) else {
        panic!("fencing on, no waiter, standalone: the pipeline");
    };
    let sent: Vec<Vec<String>> = pipelined.pipe.cmd_iter().map(words).collect();
    assert_eq!(sent[2][2..], ["1", keys.fence.as_str(), "7"]);
    // Behind waiters, the acquire script gets it all the same (its ARGV[3]).
    let queued = words(&pipelined.queued_call().evalsha);
    assert_eq!(
        queued[2..10],
        [
            "3",
            &keys.lock,
            &keys.fence,
            &keys.queue(),
            owner.as_str(),
            "1500",
            "3600000",
            "7"
        ]
    );
}

#[test]
fn listening_marks_the_queue_after_every_waiter() {
    let keys = ResourceKeys::new("p:", &crate::node::Resource::new("r"));
    let sent = words(&ListenCall::new(&keys, Duration::from_secs(10)).0.evalsha);
    assert_eq!(sent[2..], ["1", keys.queue().as_str(), "10000"]);
    // The mark ('*' at +inf) is what the queue's functions look for.
    assert!(LISTEN.code.contains("'+inf', '*'"));
    assert!(RELEASE.code.contains("if head == '*' then"));
    assert!(ACQUIRE.code.contains("if head == '*' then"));
}

#[test]
fn the_eval_fallback_sends_the_same_keys_and_arguments() {
    let keys = ResourceKeys::new("p:", &crate::node::Resource::new("r"));
    let owner = Owner::random();
    let extend = ExtendCall::new([(&keys, &owner)], Duration::from_millis(1500), false);
    let call = &extend.chunks[0].0;
    let (evalsha, eval) = (words(&call.evalsha), words(&call.eval()));
    assert_eq!(evalsha[0], "EVALSHA");
    assert_eq!(eval[0], "EVAL");
    assert_eq!(eval[1], EXTEND.code);
    assert_eq!(evalsha[2..], eval[2..]);
    assert_eq!(evalsha[4..], ["1500", owner.as_str()]);
}

#[cfg(feature = "sentinel")]
#[test]
fn errors_say_why() {
    let wait = ReplicaWait {
        replicas: 2,
        timeout: Duration::from_millis(20),
    };
    let e = CallError::Replicas { acked: 1, wait };
    assert!(e.master_may_have_moved());
    assert!(!e.certainly_not_run());
    let text = e.into_node_error().to_string();
    assert!(text.contains("1 replica(s), 2 required"), "{text}");
    let readonly = CallError::Redis(RedisError::from((
        ErrorKind::Server(ServerErrorKind::ReadOnly),
        "You can't write against a read only replica.",
    )));
    assert!(readonly.master_may_have_moved() && readonly.certainly_not_run());
}

#[test]
fn the_scripts_defaults_are_the_crates_constants() {
    // What the acquire and release scripts assume for the arguments a common call
    // leaves out.
    assert_eq!(HANDOFF_TTL, Duration::from_millis(1000));
    for lua in [&*ACQUIRE, &*RELEASE] {
        assert!(lua.code.contains("or '1000'"));
    }
    let keys = ResourceKeys::new("p:", &crate::node::Resource::new("r"));
    assert_eq!(keys.channel, format!("{}:released", keys.lock));
    assert!(ACQUIRE.code.contains("(KEYS[1] .. ':released')"));
    assert!(RELEASE.code.contains("(lock .. ':released')"));
    assert_eq!(DEFAULT_FENCE_TTL, Duration::from_millis(3_600_000));
    assert!(FENCE.code.contains("ARGV[2] or '3600000'"));
}
