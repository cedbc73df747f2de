#!/usr/bin/env bash
# The GPU speed check, sized for a lent GPU machine's few minutes: the Triton kernels and the expert worker's batch
# against torch, the datapath against transformers `generate` (with a baseline checkout side by side where one is
# given, and the workers on the Triton kernels too: the expert batch as CUDA graphs), where a layer's time goes on
# the Triton kernels (the trace), and an EW SIGINT on them. Each step has a cap; the output says each step's exit
# code and seconds. Wheels in .whl/ (msgspec, py-spy: what the image lacks) are installed first, for this tree and
# the baseline alike. `bench/profile_datapath.py --device cuda --py-spy` says where the workers' CPU goes.
# `mps`, run only where STEPS names it, is the trace again with the processes' CUDA contexts in one MPS server
# (scripts/with-mps.sh): the workers share the one GPU, and without MPS their kernels take turns by time slice.
# `collapse`, also only where STEPS names it, runs the datapath against this tree with every layer's rows sent to one
# EW whatever its experts cost (`--collapse-below-us 1e9`, as "baseline"): what collapsing does on a GPU, whose
# batches the default line may keep spread (attention_worker/collapse.py; the AWs' stats say which way they went).
# Usage: [REPEATS=2] [STEPS=kernels,datapath,trace,failover,mps,collapse] [TRITON=1] scripts/gpu-perf.sh OUT_DIR [BASELINE_TREE]
# (STEPS: the steps to run, by default all but mps; TRITON=0: the datapath without its extra `--kernel triton` fabric.)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu-perf.sh OUT_DIR [BASELINE_TREE]}"
base="${2:-}"
mkdir -p "$out"
python="${PYTHON:-python3}"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
steps=",${STEPS:-kernels,datapath,trace,failover},"
for name in ${steps//,/ }; do  # (a misspelt step would silently run nothing, on a GPU's few minutes)
  case $name in kernels|datapath|trace|failover|mps|collapse) ;; *) echo "unknown step $name in STEPS" >&2; exit 2 ;; esac
done
step() {
  local name=$1 cap=$2 t0=$SECONDS
  shift 2
  [[ $steps == *",$name,"* ]] || return 0
  echo "== $* (cap ${cap} s)"
  timeout "$cap" "$@"
  echo "== rc $? in $((SECONDS - t0)) s"
}
"$python" -c 'import torch, msgspec; print(torch.__version__, torch.cuda.get_device_name(0), "msgspec", msgspec.__version__)'
step kernels 90 "$python" -m pytest -q -p no:cacheprovider tests/expert_worker/test_executor.py \
  tests/fabric/test_triton_kernels.py tests/fabric/test_device_moves.py
step datapath 240 "$python" bench/bench_datapath.py --device cuda --transports tcp --concurrency 1,16,64 --tokens 64 \
  --repeats "${REPEATS:-2}" $([ "${TRITON:-1}" = 0 ] || echo --triton) ${base:+--baseline-tree "$base" --baseline-flags "--device cuda"} --out "$out/datapath"
step trace 70 "$python" bench/trace_datapath.py --device cuda --kernel triton --concurrency 1,64 --seconds 5 --out "$out/trace"
step failover 60 "$python" -m launch.cli experiment failover --role expert --signal INT --concurrency 8 --duration 12 --at 4 \
  --tokens 48 --device cuda --kernel triton --out "$out/failover-ew-triton"
step mps 90 scripts/with-mps.sh "$out/mps" "$python" bench/trace_datapath.py --device cuda --kernel triton \
  --concurrency 1,64 --seconds 5 --out "$out/trace-mps"
step collapse 300 "$python" bench/bench_datapath.py --device cuda --transports tcp --concurrency 1,16,64 --tokens 64 \
  --repeats "${REPEATS:-2}" --baseline-tree "$PWD" --baseline-flags "--device cuda --collapse-below-us 1e9" --out "$out/collapse"
