#!/usr/bin/env bash
# The kernels' GPU check: the gpu-marked tests (large grid natively, Triton on CUDA) and the CUDA
# benchmark. Run from the repository root on a machine with a CUDA device; output goes under $OUT
# (default ./gpu_check_out). Exit status is the tests' status, or the benchmark's if they passed.
set -uo pipefail
OUT="${OUT:-./gpu_check_out}"
mkdir -p "$OUT"
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
unset TRITON_INTERPRET
{
  nvidia-smi || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} >"$OUT/environment.txt" 2>&1
"$PY" -m pytest tests/kernels -m gpu -q -p no:cacheprovider --durations=10 --junitxml="$OUT/gpu_tests.xml" \
  >"$OUT/gpu_tests.txt" 2>&1
tests_rc=$?
tail -n 5 "$OUT/gpu_tests.txt"
"$PY" -m benchmarks.kernels --json >"$OUT/benchmark.json" 2>"$OUT/benchmark.stderr"
bench_rc=$?
cat "$OUT/benchmark.json"
if [ "$tests_rc" -ne 0 ]; then exit "$tests_rc"; fi
exit "$bench_rc"
