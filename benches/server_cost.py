#!/usr/bin/env python3
"""Redis's own work per acquire + release, in instructions (callgrind), for the crate's
protocol and for the raw limit.

    python3 benches/server_cost.py            # every sequence, 3,000 cycles each
    python3 benches/server_cost.py raw fenced --cycles 1000

For each sequence a fresh `redis-server` (no persistence) runs under
`valgrind --tool=callgrind` on a free 127.0.0.1 port; the script loads the crate's Lua
scripts (read from src/node/redis/scripts, joined as the crate joins them), sends 300
warm-up cycles, then N cycles of the sequence pipelined 100 at a time, each on its own
key (S2's pattern: distinct resources), and shuts the server down. A second run with
no measured cycles is subtracted, so the figure is per cycle and excludes startup.
Instruction counts do not depend on the machine's load, unlike timings: they are what
decided which protocol the crate sends (BENCHMARKS.md, "Server work per acquisition").
Needs valgrind and redis-server; standard library only.
"""
import argparse
import glob
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, 'src', 'node', 'redis', 'scripts')
OWNER = 'owner-0123456789abcdef0123456789abcdef'
FLOOR = '1843000000000000'


def lua(*names):
    return ''.join(open(os.path.join(SCRIPTS, n + '.lua')).read() for n in names)


# name -> source, as `src/node/redis/call` joins them.
CODE = {
    'acquire': lua('held', 'fence_rule', 'acquire', 'hand_off', 'acquire_queued'),
    'release': lua('release', 'held', 'hand_off', 'release_queued'),
    'fence': lua('fence_rule', 'fence'),
    # Ideas measured and not taken (BENCHMARKS.md, session 12): the counter raised to
    # the holder's token by the release, atomically with the delete, so the acquire
    # only reads it with a plain GET; with a compare, and unconditionally.
    'release-raise': "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end "
                     "local c = tonumber(redis.call('GET', KEYS[3])) "
                     "if not c or c < tonumber(ARGV[2]) then "
                     "redis.call('SET', KEYS[3], ARGV[2], 'PX', '3600000') end "
                     "if redis.call('EXISTS', KEYS[2]) == 0 then "
                     "redis.call('DEL', KEYS[1]) return 1 end return 2",
    'release-set': "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end "
                   "redis.call('SET', KEYS[3], ARGV[2], 'PX', '3600000') "
                   "if redis.call('EXISTS', KEYS[2]) == 0 then "
                   "redis.call('DEL', KEYS[1]) return 1 end return 2",
    'unlock': 'if redis.call("get",KEYS[1]) == ARGV[1] then '
              'return redis.call("del",KEYS[1]) else return 0 end',
}


def keys(p):
    return '{%s{i}}' % p, '{%s{i}}:fence' % p, '{%s{i}}:queue' % p, '{%s{i}}:released' % p


def set_nx(p):
    return ['SET', keys(p)[0], OWNER, 'NX', 'PX', '30000']


def release(p):
    lock, _, queue, _ = keys(p)
    return ['EVALSHA', 'release', '2', lock, queue, OWNER]


def sequences():
    lock, fence, queue, _ = keys('a')
    seqs = {
        # The anchors' raw limit: SET NX PX, then a compare-and-delete script.
        'raw': [set_nx('r'), ['EVALSHA', 'unlock', '1', keys('r')[0], OWNER]],
        # The crate, fenced, a caller that does not wait (standalone, Sentinel).
        'fenced': [set_nx('a'), ['EXISTS', queue],
                   ['EVALSHA', 'fence', '1', fence, FLOOR], release('a')],
        # The same through the acquire script (Redis Cluster sends it with its flags).
        'fenced-script': [['EVALSHA', 'acquire', '3', *keys('b')[:3], OWNER, '30000', '3600000', FLOOR],
                          release('b')],
        # The crate with fencing(false): one SET NX PX, then the release script.
        'unfenced': [set_nx('c'), release('c')],
        # An idea measured and not taken: the counter as a sorted set, max by plain
        # commands (ZADD GT floor, ZINCRBY 1), no script in the acquire at all.
        'idea-zset-fence': [set_nx('d'), ['EXISTS', keys('d')[2]],
                            ['ZADD', keys('d')[1], 'GT', FLOOR, 't'],
                            ['ZINCRBY', keys('d')[1], '1', 't'],
                            ['PEXPIRE', keys('d')[1], '3600000'], release('d')],
        # Ideas measured and not taken: the acquire reads the counter (plain GET) and
        # the release writes the holder's token to it, with a compare or without.
        'idea-release-raises-fence': [set_nx('e'), ['EXISTS', keys('e')[2]], ['GET', keys('e')[1]],
                                      ['EVALSHA', 'release-raise', '3', keys('e')[0], keys('e')[2],
                                       keys('e')[1], OWNER, FLOOR]],
        'idea-release-sets-fence': [set_nx('g'), ['EXISTS', keys('g')[2]], ['GET', keys('g')[1]],
                                    ['EVALSHA', 'release-set', '3', keys('g')[0], keys('g')[2],
                                     keys('g')[1], OWNER, FLOOR]],
    }
    return seqs


def resp(args):
    out = [b'*%d\r\n' % len(args)]
    for a in args:
        a = a.encode() if isinstance(a, str) else a
        out.append(b'$%d\r\n%s\r\n' % (len(a), a))
    return b''.join(out)


class Conn:
    def __init__(self, port):
        self.sock = socket.create_connection(('127.0.0.1', port))
        self.buf = b''

    def _skip(self, i):
        """End of the reply starting at i, or None when incomplete."""
        j = self.buf.find(b'\r\n', i)
        if j < 0:
            return None
        kind, line = self.buf[i:i + 1], self.buf[i + 1:j]
        if kind in (b'+', b'-', b':'):
            return j + 2
        if kind == b'$':
            n = int(line)
            end = j + 2 + (n + 2 if n >= 0 else 0)
            return end if len(self.buf) >= end else None
        if kind == b'*':
            p = j + 2
            for _ in range(max(int(line), 0)):
                p = self._skip(p)
                if p is None:
                    return None
            return p
        raise ValueError(self.buf[i:i + 80])

    def replies(self, n):
        got, pos, out = 0, 0, []
        while got < n:
            end = self._skip(pos)
            if end is None:
                self.buf = self.buf[pos:]
                pos = 0
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise EOFError('server closed the connection')
                self.buf += chunk
                continue
            out.append(self.buf[pos:end])
            pos, got = end, got + 1
        self.buf = self.buf[pos:]
        return out

    def call(self, *args):
        self.sock.sendall(resp(args))
        return self.replies(1)[0]


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def instructions(seq, cycles, workdir):
    port = free_port()
    out = os.path.join(workdir, 'callgrind.out')
    server = subprocess.Popen(
        ['valgrind', '--tool=callgrind', f'--callgrind-out-file={out}', 'redis-server',
         '--port', str(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                conn = Conn(port)
                conn.call('PING')
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError('redis-server under valgrind did not start')
        shas = {}
        for name, code in CODE.items():
            reply = conn.call('SCRIPT', 'LOAD', code)
            assert reply.startswith(b'$40'), reply
            shas[name] = reply[5:45].decode()
        cmds = [[shas.get(a, a) for a in cmd] for cmd in seq]

        def run(template, n):
            for base in range(0, n, 100):
                m = min(n, base + 100) - base
                data = b''.join(resp([a.replace('{i}', str(i)) for a in cmd])
                                for i in range(base, base + m) for cmd in template)
                conn.sock.sendall(data)
                for reply in conn.replies(m * len(template)):
                    if reply.startswith(b'-'):
                        raise RuntimeError(f'server error: {reply!r}')

        run([[a.replace('{i}', 'w{i}') for a in cmd] for cmd in cmds], 300)
        run(cmds, cycles)
        conn.sock.sendall(resp(['SHUTDOWN', 'NOSAVE']))
        server.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    text = open(out).read()
    return int(re.search(r'^(?:summary|totals):\s*(\d+)', text, re.M).group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('names', nargs='*', help='sequences (default: all)')
    ap.add_argument('--cycles', type=int, default=3000)
    args = ap.parse_args()
    seqs = sequences()
    names = args.names or list(seqs)
    for name in names:
        if name not in seqs:
            sys.exit(f'unknown sequence {name!r}; known: {", ".join(seqs)}')
    version = subprocess.run(['redis-server', '--version'], capture_output=True, text=True).stdout.strip()
    print(f'# Redis server instructions per acquire + release ({version}; {args.cycles} cycles)')
    print('| sequence | instructions per cycle | / raw |')
    print('|---|---|---|')
    raw = None
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            per = (instructions(seqs[name], args.cycles, workdir)
                   - instructions(seqs[name], 0, workdir)) / args.cycles
            raw = per if name == 'raw' else raw
            ratio = f'{per / raw:.2f}×' if raw else '—'
            print(f'| {name} | {per / 1000:.1f}k | {ratio} |', flush=True)


if __name__ == '__main__':
    main()
