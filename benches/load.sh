#!/usr/bin/env bash
# The orders demo under a real load generator (issue 42): three redis-server nodes on
# free loopback ports, two instances of `examples/orders` locking over them, and
#   1. one keep-alive client (curl, one connection) sending 10 sequential
#      `POST /orders/seq/pay?work_ms=$WORK_MS`: the time of each;
#   2. `wrk --latency -t2 -c32 -d$DURATION` against each instance at once, on the locked
#      route `POST /orders/{id}/pay` and then on the same work unlocked,
#      `POST /orders/{id}/pay-unlocked`: requests/s (both instances) and latency
#      percentiles (per instance).
# Every request of the wrk runs is a new order (no contention) unless HOT=N spreads them
# over N orders per instance (the locked route then refuses with 409 while one is held).
# Kills everything it started. Needs redis-server, curl, cargo; installs wrk if missing.
#
#   benches/load.sh                       # release build of the example, then the runs
#   DURATION=5s WORK_MS=0 HOT=16 benches/load.sh
#   ORDERS_BIN=/path/to/orders benches/load.sh   # a binary built elsewhere (another commit)
set -euo pipefail

DURATION=${DURATION:-10s}
WORK_MS=${WORK_MS:-1}
HOT=${HOT:-0}
cd "$(dirname "$0")/.."

if ! command -v wrk >/dev/null; then
    if [ "$(id -u)" = 0 ]; then apt-get install -y wrk; else sudo apt-get install -y wrk; fi
fi

if [ -z "${ORDERS_BIN:-}" ]; then
    cargo build --quiet --release --example orders
fi
bin=${ORDERS_BIN:-${CARGO_TARGET_DIR:-target}/release/examples/orders}

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

urls=()
for _ in 1 2 3; do
    port=$(free_port)
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
        --dir "$work" --logfile "$work/redis-$port.log" &
    pids+=($!)
    until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.05; done
    urls+=("redis://127.0.0.1:$port")
done
lock_urls=$(IFS=,; echo "${urls[*]}")

apps=()
for _ in 1 2; do
    port=$(free_port)
    PORT=$port LOCK_URLS=$lock_urls RUST_LOG=warn "$bin" >"$work/orders-$port.log" 2>&1 &
    pids+=($!)
    until curl -sf "http://127.0.0.1:$port/healthz" >/dev/null; do sleep 0.1; done
    apps+=("$port")
done

echo "## ${ORDERS_BIN:-$(git log -1 --format='%h %s' | cut -c1-72)}"
echo "3 redis-server nodes, 2 instances, work_ms=$WORK_MS, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "### one keep-alive connection, 10 sequential POST /orders/seq/pay (ms each)"
url="http://127.0.0.1:${apps[0]}/orders/seq/pay?work_ms=$WORK_MS"
args=()
for _ in $(seq 10); do args+=(-o /dev/null "$url"); done
# curl keeps one connection for the URLs of one command line.
curl -s -X POST -w '%{time_total}\n' "${args[@]}" |
    awk '{ printf "%.1f ", $1 * 1000 } END { print "" }'

cat >"$work/orders.lua" <<'LUA'
-- Each wrk thread numbers its own requests; `setup` tells it its number.
local threads = 0
function setup(thread)
    threads = threads + 1
    thread:set("thread", threads)
end
local n = 0
local prefix = "/orders/" .. os.getenv("PREFIX")
local suffix = "/" .. os.getenv("ROUTE") .. "?work_ms=" .. os.getenv("WORK_MS")
local hot = tonumber(os.getenv("HOT"))
function request()
    n = n + 1
    local id = hot > 0 and tostring(math.random(1, hot)) or (thread .. "-" .. n)
    return wrk.format("POST", prefix .. id .. suffix)
end
LUA

for route in pay pay-unlocked; do
    echo
    echo "### wrk -t2 -c32 -d$DURATION on each instance, POST /orders/{id}/$route"
    runs=()
    for port in "${apps[@]}"; do
        ROUTE=$route HOT=$HOT WORK_MS=$WORK_MS PREFIX="$route-$port-" \
            wrk --latency -t2 -c32 -d"$DURATION" -s "$work/orders.lua" \
            "http://127.0.0.1:$port" >"$work/wrk-$port.txt" &
        runs+=($!)
    done
    wait "${runs[@]}"
    total=0
    for port in "${apps[@]}"; do
        out="$work/wrk-$port.txt"
        rps=$(awk '/^Requests\/sec/ { print $2 }' "$out")
        total=$(awk -v a="$total" -v b="$rps" 'BEGIN { print a + b }')
        pct=$(awk '/Latency Distribution/ { on = 1; next } on && NF == 2 { sub("%", "", $1); printf "p%s %s  ", $1, $2 } on && NF != 2 { on = 0 }' "$out")
        non2xx=$(awk '/Non-2xx/ { print $NF }' "$out")
        echo "instance :$port  ${rps} req/s  ${pct}non-2xx ${non2xx:-0}"
    done
    echo "both instances: ${total} req/s"
done
