#!/usr/bin/env bash
# The GPU acceptance check: the Triton kernels compiled, greedy parity on cuda, EW and AW SIGINT
# failover (with and without a warm standby), the datapath against transformers on the same GPU,
# and a table at the end. Needs only what a GPU machine's image has (torch with CUDA, triton,
# transformers, aiohttp, msgpack, uvloop, pytest): no network, no pip install; this tree runs from
# PYTHONPATH. Without a GPU it runs its CPU part (--device cpu) and says what needs a GPU.
# Usage: scripts/gpu-check.sh [--device auto|cuda|cpu] [--out DIR] [--skip kernels,parity,failover,datapath]
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if [ -x .venv-test/bin/python ] && [ -z "${PYTHON:-}" ]; then python=.venv-test/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/gpu_check.py "$@"
