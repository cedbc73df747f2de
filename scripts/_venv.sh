# Sourced by the scripts: create (or reuse) a virtual environment and install the project into it.
# Usage: . scripts/_venv.sh VENV_DIR EXTRAS
set -euo pipefail
venv="$1"
extras="$2"
if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv" >&2
  python3 -m venv "$venv"
fi
# torch first, pinned to the CPU build on disk: a bare 'torch' requirement would pull a CUDA build.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "$venv/bin/pip" install -q torch==2.13.0
fi
"$venv/bin/pip" install -q -e ".[$extras]"
# The expert FFN kernel, compiled once per machine into the cache (a no-op once built; where the
# CPU has neither AVX2 nor AVX-512 or nothing can compile it, expert workers use torch's matmul).
"$venv/bin/python" -m fabric.kernels.skinny
