#!/usr/bin/env bash
# Runs a command with every CUDA process it starts sharing one MPS server (NVIDIA's Multi-Process Service), so that
# the fabric's workers on one GPU run their kernels side by side instead of taking turns by time slice. The daemon
# is this script's own: its pipes and logs under DIR, started before the command and stopped after it, whatever the
# command's end. The GPU's settings are left as they are (MPS runs in its default compute mode too).
# Usage: scripts/with-mps.sh DIR COMMAND [ARGS...]
set -uo pipefail
dir="${1:?usage: scripts/with-mps.sh DIR COMMAND [ARGS...]}"
shift
command -v nvidia-cuda-mps-control >/dev/null || { echo "with-mps: no nvidia-cuda-mps-control here" >&2; exit 3; }
export CUDA_MPS_PIPE_DIRECTORY="$dir/pipe" CUDA_MPS_LOG_DIRECTORY="$dir/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "with-mps: the MPS daemon did not start" >&2; exit 4; }
trap 'echo quit | nvidia-cuda-mps-control' EXIT
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM INT  # (a step's cap: the command ends first)
wait "$child"
