#!/usr/bin/env python3
"""Where S2's time goes under each tokio runtime: per acquire + release cycle, the
client's CPU, Redis's CPU and how many socket reads Redis made (`INFO stats`
`total_reads_processed`: one read serves every command that arrived together, so
fewer reads per cycle means the client's commands reached Redis in larger batches).

    python3 benches/batching.py                       # 3 repetitions, 1 node
    python3 benches/batching.py --reps 5 --cycles 40000

Runs S2 (64 tasks, distinct keys) of `benches/anchor.rs` (the crate with fencing on
and off, and `--baseline fenced`) and of the anchors' raw redis-rs and rslock clients
(`target/headline/anchors`, built by `benches/headline.py`), each under the
multi-thread and the current_thread runtime, taking turns, against one fresh
`redis-server` on a free 127.0.0.1 port. Client CPU is the process's user + system
time (`os.wait4`), Redis's the change of `used_cpu_user` + `used_cpu_sys`; both are
divided by the cycles run (the harness's warm-up included). Medians over the
repetitions. Needs redis-server and redis-cli; standard library only.
"""
import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from headline import build_ours  # noqa: E402  (benches/headline.py: the anchor binary)
ANCHORS = os.path.join(ROOT, 'target', 'headline', 'anchors', 'rust', 'target', 'release')


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server():
    """One fresh `redis-server` (no persistence) on a free 127.0.0.1 port, answering
    `PING`; yields its port and shuts it down afterwards."""
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        server = subprocess.Popen(['redis-server', '--port', str(port), '--bind', '127.0.0.1', '--save', '',
                                   '--appendonly', 'no', '--dir', workdir], stdout=subprocess.DEVNULL)
        try:
            for _ in range(100):
                if subprocess.run(['redis-cli', '-p', str(port), 'ping'], capture_output=True).returncode == 0:
                    break
                time.sleep(0.05)
            yield port
        finally:
            server.terminate()
            server.wait()


def cli(port, *args):
    return subprocess.run(['redis-cli', '-p', str(port), *args], capture_output=True, text=True,
                          check=True).stdout


def info(port, section, fields):
    values = {}
    for line in cli(port, 'info', section).splitlines():
        name, _, value = line.partition(':')
        if name in fields:
            values[name] = float(value)
    return values


def server_cpu(port):
    cpu = info(port, 'cpu', ('used_cpu_user', 'used_cpu_sys'))
    return cpu['used_cpu_user'] + cpu['used_cpu_sys']


def reads(port):
    return info(port, 'stats', ('total_reads_processed',))['total_reads_processed']


def run_one(cmd, env, port, cycles):
    cli(port, 'flushall')
    cpu0, reads0 = server_cpu(port), reads(port)
    proc = subprocess.Popen([*cmd, '--scenario', 'S2', '--ports', str(port), '--cycles', str(cycles)],
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f'{cmd} failed: {status}')
    cpu1, reads1 = server_cpu(port), reads(port)
    result = json.loads(out.strip().splitlines()[-1])
    # The harness warms up with a tenth of the cycles first (at least one per task).
    total = cycles + max(cycles // 10, 64)
    return {
        'ops': result['ops_per_s'],
        'client': (usage.ru_utime + usage.ru_stime) * 1e6 / total,
        'server': (cpu1 - cpu0) * 1e6 / total,
        'reads': (reads1 - reads0) / total,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--reps', type=int, default=3)
    ap.add_argument('--cycles', type=int, default=40000)
    args = ap.parse_args()
    ours = build_ours()
    subjects = [
        ('tower-redlock', [ours], {}),
        ('tower-redlock-nofence', [ours], {'NO_FENCING': '1'}),
        ('raw-fenced', [ours, '--baseline', 'fenced'], {}),
    ]
    for name, binary in (('raw-redis-rs', 'raw_bench'), ('rslock', 'rslock_bench')):
        path = os.path.join(ANCHORS, binary)
        if not os.path.exists(path):
            sys.exit(f'{path} is missing: run benches/headline.py once (it builds the anchors)')
        subjects.append((name, [path], {}))
    rows = {}
    with redis_server() as port:
        for rep in range(args.reps):
            for name, cmd, env in subjects:
                for runtime, rt_env in (('multi-thread', {}), ('current_thread', {'ANCHOR_RT': 'current_thread'})):
                    row = run_one(cmd, {**env, **rt_env}, port, args.cycles)
                    rows.setdefault((name, runtime), []).append(row)
                    print(f'rep{rep + 1} {name:<22} {runtime:<14} {row["ops"]:>9.0f} ops/s  client '
                          f'{row["client"]:5.1f} us  redis {row["server"]:5.1f} us  reads {row["reads"]:.3f}',
                          file=sys.stderr, flush=True)
    print(f'S2, 1 node, {args.cycles} cycles, medians of {args.reps} repetitions; per acquire + release cycle:')
    print('| implementation | runtime | ops/s | client CPU µs | Redis CPU µs | Redis reads |')
    print('|---|---|---|---|---|---|')
    for (name, runtime), values in rows.items():
        med = {k: statistics.median(v[k] for v in values) for k in values[0]}
        print(f'| {name} | {runtime} | {med["ops"]:.0f} | {med["client"]:.1f} | {med["server"]:.1f} '
              f'| {med["reads"]:.3f} |')


if __name__ == '__main__':
    main()
