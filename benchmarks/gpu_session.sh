#!/usr/bin/env bash
# One device call: the GPU tests, then benchmarks/generate.py for the contexts given (results under $OUT).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
if [ "${RUN_TESTS:-1}" = 1 ]; then
  python -m pytest -q -x -m gpu tests/test_gpu_generate.py tests/kernels/test_fetch.py tests/test_gpu_core.py tests/test_quoka.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
fi
python benchmarks/generate.py "$@" 2>&1 | tee "$OUT/generate.log"
cp benchmarks/results/generate*.json "$OUT/" 2>/dev/null || true
