#!/usr/bin/env python3
"""The client's own work per S2 acquire + release cycle, as valgrind's cachegrind
simulates it: instructions, first-level data-cache misses and branch mispredictions, for
the crate (fencing on and off), the hand-written fenced client, raw redis-rs and rslock.

    python3 benches/client_cost.py                      # every subject, current_thread
    python3 benches/client_cost.py tower-redlock-nofence rslock --runtime multi-thread
    python3 benches/client_cost.py --nodes 3            # three redis-servers

Each subject's binary (`benches/anchor.rs`, and the anchors' `raw_bench` and
`rslock_bench` built by `benches/headline.py` in `target/headline/anchors`) runs S2
(64 tasks, distinct keys) under `valgrind --tool=cachegrind` against one (`--nodes 3`:
three) fresh `redis-server` on free 127.0.0.1 ports, twice: with `--small` and with `--large`
cycles. The difference of the two totals, divided by the difference of the cycles
run (the harness warms up with a tenth of them first), is the figure per cycle,
without start-up. The counts barely depend on the machine's load, unlike the CPU times
of `benches/batching.py` (they vary by about 1 % between runs, with how the tasks'
commands happen to batch): this is the figure to compare a change of the client's code
with. Instructions alone do not rank clients: rslock spends a tenth of its
instructions hashing its script (SHA-1, cheap per instruction), the crate more of its
own in misses and mispredictions. Valgrind runs one thread at a time, so the
current_thread runtime (the default here) is the faithful one. Needs valgrind and
redis-server; standard library only.
"""
import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batching import ANCHORS, cli, redis_server  # noqa: E402
from headline import build_ours  # noqa: E402


def subjects(ours):
    rows = {
        'tower-redlock': ([ours], {}),
        'tower-redlock-nofence': ([ours], {'NO_FENCING': '1'}),
        'raw-fenced': ([ours, '--baseline', 'fenced'], {}),
    }
    for name, binary in (('raw-redis-rs', 'raw_bench'), ('rslock', 'rslock_bench')):
        rows[name] = ([os.path.join(ANCHORS, binary)], {})
    return rows


def total_cycles(cycles):
    # The harness warms up with a tenth of the cycles first (at least one per task).
    return cycles + max(cycles // 10, 64)


EVENTS = ('Ir', 'D1mr', 'D1mw', 'Bcm', 'Bim')


def counts(cmd, env, ports, cycles, workdir):
    """The run's totals of `EVENTS` (instructions, D1 read and write misses, conditional
    and indirect mispredictions)."""
    for port in ports:
        cli(port, 'flushall')
    out = os.path.join(workdir, 'cachegrind.out')
    subprocess.run(['valgrind', '--tool=cachegrind', '--cache-sim=yes', '--branch-sim=yes',
                    f'--cachegrind-out-file={out}', *cmd,
                    '--scenario', 'S2', '--ports', ','.join(map(str, ports)), '--cycles', str(cycles)],
                   # The node timeout is far above the 50 ms default: valgrind is ~50x slower.
                   env={**os.environ, 'NODE_TIMEOUT_MS': '10000', **env}, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    text = open(out).read()
    os.remove(out)
    names = re.search(r'^events:\s*(.*)$', text, re.M).group(1).split()
    totals = [int(v) for v in re.search(r'^summary:\s*(.*)$', text, re.M).group(1).split()]
    found = dict(zip(names, totals))
    return {e: found[e] for e in EVENTS}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('names', nargs='*', help='subjects (default: all)')
    ap.add_argument('--runtime', choices=('current_thread', 'multi-thread'), default='current_thread')
    ap.add_argument('--small', type=int, default=1000)
    ap.add_argument('--large', type=int, default=4000)
    ap.add_argument('--nodes', type=int, choices=(1, 3), default=1)
    args = ap.parse_args()
    rows = subjects(build_ours())
    names = args.names or list(rows)
    for name in names:
        if name not in rows:
            sys.exit(f'unknown subject {name}; known: {", ".join(rows)}')
        if not os.path.exists(rows[name][0][0]):
            sys.exit(f'{rows[name][0][0]} is missing: run benches/headline.py once (it builds the anchors)')
    rt = {'ANCHOR_RT': 'current_thread'} if args.runtime == 'current_thread' else {}
    results = {}
    with contextlib.ExitStack() as stack:
        ports = [stack.enter_context(redis_server()) for _ in range(args.nodes)]
        grind = stack.enter_context(tempfile.TemporaryDirectory())
        for name in names:
            cmd, env = rows[name]
            small = counts(cmd, {**env, **rt}, ports, args.small, grind)
            large = counts(cmd, {**env, **rt}, ports, args.large, grind)
            cycles = total_cycles(args.large) - total_cycles(args.small)
            per = {e: (large[e] - small[e]) / cycles for e in EVENTS}
            results[name] = per
            print(f'{name:<24} {per["Ir"]:>9.0f} instructions, {per["D1mr"] + per["D1mw"]:>5.0f} D1 misses, '
                  f'{per["Bcm"] + per["Bim"]:>5.0f} mispredictions per cycle', file=sys.stderr, flush=True)
    print(f'S2, {args.nodes} node(s), {args.runtime}, the client\'s work per acquire + release cycle '
          f'(cachegrind, {args.large} - {args.small} cycles):')
    print('| implementation | instructions | D1 misses | mispredictions (indirect) | instructions vs rslock |')
    print('|---|---|---|---|---|')
    base = results.get('rslock')
    for name, per in results.items():
        ratio = f'{per["Ir"] / base["Ir"]:.2f}' if base else '—'
        print(f'| {name} | {per["Ir"]:.0f} | {per["D1mr"] + per["D1mw"]:.0f} | '
              f'{per["Bcm"] + per["Bim"]:.0f} ({per["Bim"]:.0f}) | {ratio} |')


if __name__ == '__main__':
    main()
