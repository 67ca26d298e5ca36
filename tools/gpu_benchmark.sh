#!/usr/bin/env bash
# One prepared GPU benchmark (tools/gpu_benchmark.py): T5 1.1 small and base in bfloat16,
# each kernel set beside HF PyTorch, a profile; three files in OUT_DIR.
#   bash tools/gpu_benchmark.sh OUT_DIR [--dry_run] [--budget_s=S] [--only=RUN,...]
#     [--kernels=SET,...] [--compile_workers=N]
# Run from anywhere; PYTHON picks the interpreter (default python3). Wheels carried in
# .whl/ (gin-config, which the GPU machines lack) are installed to /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "ERROR: usage: bash tools/gpu_benchmark.sh OUT_DIR [--dry_run] [--budget_s=S]" >&2
  exit 2
fi
out=$1
shift
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec "$python" tools/gpu_benchmark.py "$out" "$@"
