#!/usr/bin/env bash
# Serves the demo model with `moe-fabric serve` (2 attention + 2 expert workers), shows one
# completion, and keeps serving on http://127.0.0.1:${PORT:-8000}/v1 until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh "${MOE_FABRIC_VENV:-.venv}" "ucx,experiments,structured"
venv="${MOE_FABRIC_VENV:-.venv}"
port="${PORT:-8000}"
"$venv/bin/moe-fabric" serve --port "$port" "$@" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server' EXIT INT TERM
until curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null; do
  kill -0 $server 2>/dev/null || { echo "moe-fabric serve exited" >&2; exit 1; }
  sleep 0.5
done
echo "--- a completion from the demo model:"
curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "Serving language models", "max_tokens": 16, "temperature": 0, "return_token_ids": true}'
echo
echo "--- serving on http://127.0.0.1:$port/v1 (Ctrl-C to stop)"
wait $server
