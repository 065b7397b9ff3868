#!/usr/bin/env bash
# Entry point for ../shared/anchors: EXTRA_IMPL="tower-redlock=$PWD/benches/anchor.sh".
# Builds the bench binary once (release profile) and runs it with the harness's flags.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(cargo bench --bench anchor --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="anchor" and m.get("executable"): print(m["executable"])' | tail -1)
exec "$bin" "$@"
