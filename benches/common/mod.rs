//! Helpers shared by the plain-main benches (`layer`, `scale`, `memory`): process CPU
//! time, load average, Redis observations, percentiles and medians.
//!
//! A directory module, so that cargo does not take it for a bench target of its own.
#![allow(dead_code)] // not every bench uses every helper

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use crate::support::RedisServer;

/// Clock ticks per second of `/proc/*/stat` (`getconf CLK_TCK`, 100 on Linux).
fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// CPU time (user + system) of process `pid` so far, from `/proc/PID/stat`
/// (10 ms resolution); `self` for this process.
pub fn cpu_time(pid: &str) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // "pid (comm) S ppid ...": utime and stime are fields 14 and 15, i.e. the 12th and
    // 13th after the closing parenthesis of comm.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    Duration::from_secs_f64(ticks as f64 / clock_ticks())
}

/// CPU time of this process so far.
pub fn own_cpu() -> Duration {
    cpu_time("self")
}

/// CPU time of every server so far, summed.
pub fn servers_cpu(servers: &[RedisServer]) -> Duration {
    servers.iter().map(|s| cpu_time(&s.pid().to_string())).sum()
}

/// The three load averages, as `uptime` shows them.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Commands executed by the servers since their last `CONFIG RESETSTAT`, summed over
/// servers, leaving out the observer's own `INFO` and `CONFIG` calls. Commands inside
/// scripts and pipelines count one each.
pub fn commands(servers: &[RedisServer]) -> u64 {
    by_command(servers).values().sum()
}

/// [`commands`] by command name.
pub fn by_command(servers: &[RedisServer]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (name, calls) in servers.iter().flat_map(|s| s.info_commandstats()) {
        if !(name == "info" || name.starts_with("config|")) {
            *out.entry(name).or_default() += calls;
        }
    }
    out
}

/// `CONFIG RESETSTAT` on every server.
pub fn reset_stats(servers: &[RedisServer]) {
    servers.iter().for_each(RedisServer::reset_stats);
}

/// One field of `INFO section` of a server, e.g. `("clients", "connected_clients")`.
pub fn info_field(server: &RedisServer, section: &str, field: &str) -> Option<String> {
    let reply = server.cmd(&["INFO", section]);
    let text = reply.to_string_lossy()?;
    text.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

/// `connected_clients` of a server (the observer's own connection included).
pub fn connected_clients(server: &RedisServer) -> u64 {
    info_field(server, "clients", "connected_clients")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Nearest-rank percentile of an ascending slice.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Median of some values (the mean of the two middle ones for an even count); NaN
/// when empty.
pub fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.into_iter().collect();
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Milliseconds with three decimals.
pub fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

/// `1234567.8` as `1,234,568`.
pub fn thousands(x: f64) -> String {
    let digits = format!("{:.0}", x.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if x < 0.0 {
        out.insert(0, '-');
    }
    out
}

/// The value of `--name N` on the command line, else `default`.
pub fn flag<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}: cannot parse {v:?}"))
        })
}

/// `true` when `--name` is on the command line.
pub fn switch(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}
