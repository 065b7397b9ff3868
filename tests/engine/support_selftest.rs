//! Checks the `tests/support` helper itself against real `redis-server` processes.

use crate::support;

use std::path::Path;
use std::time::Duration;

use support::{RedisServer, RespValue, ServerState};

fn proc_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn resp_parser_handles_nested_values() {
    let raw = b"*5\r\n+OK\r\n:-3\r\n$3\r\na\r\n\r\n$-1\r\n*1\r\n-ERR x\r\n";
    let mut reader = &raw[..];
    assert_eq!(
        support::resp::read_value(&mut reader).unwrap(),
        RespValue::Array(vec![
            RespValue::Simple("OK".into()),
            RespValue::Integer(-3),
            RespValue::Bulk(b"a\r\n".to_vec()),
            RespValue::Nil,
            RespValue::Array(vec![RespValue::Error("ERR x".into())]),
        ])
    );
    assert_eq!(
        support::resp::encode_command(&[b"GET", b"k"]),
        b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n".to_vec()
    );
}

#[test]
fn set_get_and_observers() {
    let redis = RedisServer::start();
    assert_ne!(redis.port(), 6379);
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{}/0", redis.port()));
    assert_eq!(
        redis.addr().to_string(),
        format!("127.0.0.1:{}", redis.port())
    );
    assert!(redis.is_running());
    assert_eq!(redis.state(), ServerState::Running);
    assert!(redis.dir().is_dir());

    assert_eq!(
        redis.cmd(&["SET", "k", "v"]),
        RespValue::Simple("OK".into())
    );
    assert_eq!(redis.cmd(&["GET", "k"]), RespValue::Bulk(b"v".to_vec()));
    assert_eq!(redis.get("k").as_deref(), Some("v"));
    assert_eq!(redis.get("missing"), None);
    assert!(redis.exists("k"));
    assert!(!redis.exists("missing"));
    assert_eq!(redis.pttl("k"), -1);
    assert_eq!(redis.pttl("missing"), -2);
    assert_eq!(
        redis.cmd(&["PEXPIRE", "k", "100000"]),
        RespValue::Integer(1)
    );
    let pttl = redis.pttl("k");
    assert!((1..=100_000).contains(&pttl), "pttl {pttl}");

    redis.set("lock:a", "1");
    redis.set("lock:b", "2");
    assert_eq!(redis.keys("lock:*"), vec!["lock:a", "lock:b"]);
    assert_eq!(redis.dbsize(), 3);
    assert!(redis.cmd(&["NOSUCHCOMMAND"]).is_error());
    assert_eq!(
        redis.cmd(&["MGET", "lock:a", "missing"]),
        RespValue::Array(vec![RespValue::Bulk(b"1".to_vec()), RespValue::Nil])
    );

    let stats = redis.info_commandstats();
    assert!(
        stats
            .iter()
            .any(|(name, calls)| name == "set" && *calls >= 3),
        "{stats:?}"
    );
    assert_eq!(redis.command_calls("SET"), 3);
    redis.reset_stats();
    assert_eq!(redis.command_calls("set"), 0);

    redis.flushall();
    assert!(redis.keys("*").is_empty());
    assert!(redis.log().contains("Ready to accept connections"));
}

#[test]
fn pause_and_resume() {
    let mut redis = RedisServer::start();
    redis.set("k", "v");
    redis.pause();
    assert_eq!(redis.state(), ServerState::Paused);
    assert!(!redis.is_running());
    assert!(proc_exists(redis.pid()));
    let err = redis
        .try_cmd(&["PING"], Duration::from_millis(200))
        .expect_err("a paused server must not answer");
    assert!(
        matches!(
            err.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        "{err:?}"
    );
    redis.resume();
    assert!(redis.is_running());
    assert!(redis.ping(Duration::from_millis(1000)));
    assert_eq!(redis.get("k").as_deref(), Some("v"));
}

#[test]
fn kill_then_restart_comes_back_empty() {
    let mut redis = RedisServer::start();
    let port = redis.port();
    let old_pid = redis.pid();
    redis.set("k", "v");
    redis.kill();
    assert_eq!(redis.state(), ServerState::Killed);
    assert!(!redis.is_running());
    assert!(!proc_exists(old_pid));
    assert!(redis
        .try_cmd(&["PING"], Duration::from_millis(200))
        .is_err());

    redis.restart();
    assert_eq!(redis.port(), port);
    assert_ne!(redis.pid(), old_pid);
    assert!(redis.is_running());
    assert_eq!(redis.get("k"), None);
    assert_eq!(redis.dbsize(), 0);
}

#[test]
fn restart_while_running_and_while_paused() {
    let mut redis = RedisServer::start();
    let first = redis.pid();
    redis.restart();
    assert!(!proc_exists(first));
    let second = redis.pid();
    redis.pause();
    redis.restart();
    assert!(!proc_exists(second));
    assert!(redis.ping(Duration::from_secs(1)));
}

#[test]
fn restart_with_appendonly_keeps_data() {
    let mut redis = RedisServer::builder().appendonly(true).start();
    redis.set("k", "v");
    assert_eq!(
        redis.cmd(&["PEXPIRE", "k", "600000"]),
        RespValue::Integer(1)
    );
    redis.kill();
    redis.restart();
    assert_eq!(redis.get("k").as_deref(), Some("v"));
    assert!(redis.pttl("k") > 0);
}

#[test]
fn drop_reaps_process_and_removes_dir() {
    let redis = RedisServer::start();
    let (pid, dir) = (redis.pid(), redis.dir().to_path_buf());
    assert!(proc_exists(pid));
    drop(redis);
    assert!(!proc_exists(pid), "redis-server {pid} left behind");
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[test]
fn drop_of_paused_server_reaps_it() {
    let mut redis = RedisServer::start();
    redis.pause();
    let pid = redis.pid();
    drop(redis);
    assert!(!proc_exists(pid), "redis-server {pid} left behind");
}

#[test]
fn drop_on_panic_reaps_process() {
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let redis = RedisServer::start();
        tx.send(redis.pid()).unwrap();
        panic!("test failure while a server is up");
    })
    .join();
    assert!(result.is_err());
    let pid = rx.recv().unwrap();
    assert!(!proc_exists(pid), "redis-server {pid} left behind");
}

#[test]
fn builder_passes_extra_args_and_password() {
    let redis = RedisServer::builder()
        .arg("--maxmemory", "1mb")
        .password("s3cret")
        .start();
    assert_eq!(
        redis.url(),
        format!("redis://:s3cret@127.0.0.1:{}/0", redis.port())
    );
    assert_eq!(
        redis.cmd(&["CONFIG", "GET", "maxmemory"]),
        RespValue::Array(vec![
            RespValue::Bulk(b"maxmemory".to_vec()),
            RespValue::Bulk(b"1048576".to_vec()),
        ])
    );
    // A connection without AUTH is refused.
    let mut conn = support::resp::Connection::open(redis.addr(), Duration::from_secs(5)).unwrap();
    assert!(conn.call_str(&["GET", "k"]).unwrap().is_error());
}

#[test]
fn start_many_gives_distinct_servers() {
    let servers = RedisServer::start_many(3);
    let mut ports: Vec<u16> = servers.iter().map(RedisServer::port).collect();
    ports.sort();
    ports.dedup();
    assert_eq!(ports.len(), 3);
    servers[0].set("k", "0");
    assert_eq!(servers[1].get("k"), None);
}

#[tokio::test]
async fn eventually_waits_for_expiry() {
    let redis = RedisServer::start();
    redis.set("k", "v");
    redis.cmd(&["PEXPIRE", "k", "50"]);
    support::eventually("k expires", Duration::from_secs(5), || !redis.exists("k")).await;
}

#[tokio::test]
#[should_panic(expected = "timed out after 20ms waiting for: never")]
async fn eventually_panics_with_description() {
    support::eventually("never", Duration::from_millis(20), || false).await;
}

#[test]
fn eventually_blocking_waits_for_expiry() {
    let redis = RedisServer::start();
    redis.set("k", "v");
    redis.cmd(&["PEXPIRE", "k", "50"]);
    support::eventually_blocking("k expires", Duration::from_secs(5), || {
        redis.pttl("k") == -2
    });
}

#[test]
fn restart_waits_while_someone_else_holds_the_port() {
    let mut redis = RedisServer::start();
    redis.kill();
    let squatter = std::net::TcpListener::bind(redis.addr()).unwrap();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(squatter);
    });
    redis.restart();
    releaser.join().unwrap();
    assert!(redis.is_running());
    assert!(redis.log().contains("Address already in use"));
}

#[test]
#[should_panic(expected = "exited during start-up")]
fn bad_config_fails_with_the_log() {
    let _redis = RedisServer::builder().arg("--no-such-option", "1").start();
}

#[test]
fn save_then_restart_loads_the_rdb_file() {
    let mut redis = RedisServer::builder().dbfilename("locks.rdb").start();
    assert_eq!(
        redis.cmd(&["CONFIG", "GET", "save"]),
        RespValue::Array(vec![
            RespValue::Bulk(b"save".to_vec()),
            RespValue::Bulk(Vec::new()),
        ])
    );
    redis.set("saved", "1");
    redis.save();
    assert!(redis.rdb_path().ends_with("locks.rdb"));
    assert!(redis.rdb_path().is_file());
    redis.set("after", "1");
    redis.restart();
    assert_eq!(redis.get("saved").as_deref(), Some("1"));
    assert_eq!(
        redis.get("after"),
        None,
        "written after SAVE, lost by SIGKILL"
    );
    // Restarting again keeps the files (the directory is not wiped).
    redis.restart();
    assert_eq!(redis.get("saved").as_deref(), Some("1"));
}

#[test]
fn bgsave_waits_for_the_file() {
    let mut redis = RedisServer::start();
    redis.set("k", "v");
    redis.bgsave();
    assert!(redis.rdb_path().is_file());
    redis.restart();
    assert_eq!(redis.get("k").as_deref(), Some("v"));
}

#[test]
fn save_schedule_is_passed_on() {
    let redis = RedisServer::builder()
        .save_schedule("3600 1 300 100")
        .start();
    assert_eq!(
        redis.cmd(&["CONFIG", "GET", "save"]),
        RespValue::Array(vec![
            RespValue::Bulk(b"save".to_vec()),
            RespValue::Bulk(b"3600 1 300 100".to_vec()),
        ])
    );
}

#[test]
fn restart_from_rdb_snapshot_brings_back_older_state() {
    let mut redis = RedisServer::start();
    redis.set("k", "old");
    let backup = redis.snapshot();
    redis.set("k", "new");
    redis.set("later", "1");
    redis.save(); // the newer state is on disk too: restart_from must replace it
    redis.restart_from(&backup);
    assert_eq!(redis.get("k").as_deref(), Some("old"));
    assert_eq!(redis.get("later"), None);
    // The restored file is now the server's own: a plain restart loads it again.
    redis.restart();
    assert_eq!(redis.get("k").as_deref(), Some("old"));
}

#[test]
fn aof_everysec_survives_sigkill() {
    let mut redis = RedisServer::builder()
        .aof(support::AppendFsync::EverySec)
        .start();
    assert_eq!(
        redis.cmd(&["CONFIG", "GET", "appendfsync"]),
        RespValue::Array(vec![
            RespValue::Bulk(b"appendfsync".to_vec()),
            RespValue::Bulk(b"everysec".to_vec()),
        ])
    );
    redis.set("k", "v");
    redis.wait_aof_written();
    redis.restart();
    assert_eq!(redis.get("k").as_deref(), Some("v"));
}

#[test]
fn restart_from_aof_snapshot_loses_the_tail() {
    for fsync in [support::AppendFsync::Always, support::AppendFsync::EverySec] {
        let mut redis = RedisServer::builder().aof(fsync).start();
        redis.set("k", "old");
        let synced = redis.snapshot();
        assert!(synced.dir().join("appendonlydir").is_dir());
        redis.set("k", "new");
        redis.set("tail", "1");
        redis.restart_from(&synced);
        assert_eq!(redis.get("k").as_deref(), Some("old"), "{fsync:?}");
        assert_eq!(redis.get("tail"), None, "{fsync:?}");
        redis.set("k", "newer");
        redis.restart();
        assert_eq!(redis.get("k").as_deref(), Some("newer"), "{fsync:?}");
    }
}
