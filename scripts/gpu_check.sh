#!/usr/bin/env bash
# CUDA checks of engram-serve, a few minutes on one GPU. Run from the repository root with a
# venv holding a CUDA build of torch==2.13.0:  bash scripts/gpu_check.sh [OUT_DIR]
# Covers: the CUDA tests (tests/test_cuda.py: weights / KV cache / staging on the GPU, pinned host
# tables, greedy tokens equal to the CPU with 2 microbatches and with bounded graph captures, NCCL tensor
# parallelism when 2 GPUs exist) and the CUDA hash test; `verify --device cuda`; the step benchmark
# (2 microbatches against whole steps) on the GPU. Results go to OUT_DIR (default gpu_check_out/), summary on stdout.
set -u -o pipefail
OUT=${1:-gpu_check_out}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
status=0
run() {  # name, command...
    local name=$1; shift
    local t0=$(date +%s)
    if timeout 300 "$@" >"$OUT/$name.log" 2>&1; then r=ok; else r="FAIL($?)"; status=1; fi
    echo "$name: $r ($(( $(date +%s) - t0 )) s) -> $OUT/$name.log"
}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPU(s)')" \
    | tee "$OUT/device.txt" || { echo "no CUDA device: nothing to check"; exit 2; }
run cuda_tests "$PY" -m pytest -q -rs tests/test_cuda.py tests/kernels/test_hash_kernel.py -k "cuda"
run verify_cuda "$PY" -m engram_serve.cli verify --device cuda --json
run verify_cuda_text "$PY" -m engram_serve.cli verify --device cuda
run bench_step_cuda "$PY" -m engram_serve.cli bench step --device cuda --budget-s 1 --json
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    run verify_tp2_nccl "$PY" -m engram_serve.cli verify --device cuda --tensor-parallel-size 2
fi
tail -n 3 "$OUT/verify_cuda_text.log"
cat "$OUT/bench_step_cuda.log"
exit $status
