#!/usr/bin/env bash
# FP8 foundation on one CUDA GPU (H200): the FP8 engine tests on cuda
# (quantize bit-exact against torch's float8 cast, GEMM against float64,
# Float8Tensor / quantizers on cuda), the GEMM tests touched by the FP8 plan
# keys, the check of our FP8 GEMM against torch._scaled_mm and float64, and
# the FP8-vs-bf16 GEMM benchmark at 8192x4096x12288, 4096x4096x16384 and
# 2048x2048x6144. Assumes the lead built the CUDA backend
# (TEC_CUDA=1 python3 setup.py build_ext --inplace). Logs under ${OUT:-out}/fp8/.
#   bash scripts/gpu_fp8.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}/fp8; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fail=0
step() {  # step NAME CMD...: run, log, record PASS/FAIL
    local name=$1; shift
    if "$@" > "$OUT/$name.log" 2>&1; then echo "PASS $name"; else echo "FAIL $name (see $OUT/$name.log)"; tail -30 "$OUT/$name.log"; fail=1; fi
}
nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader
step fp8_tests python3 -m pytest -q tests/test_fp8_engine.py tests/test_float8_tensor.py \
    tests/test_fp8_recipe.py
step gemm_tests python3 -m pytest -q -k cuda tests/test_kernels.py tests/test_gemm_cache.py tests/test_gemm_tune.py
step fp8_check python3 scripts/fp8_gemm_bench.py --check
step fp8_bench python3 scripts/fp8_gemm_bench.py --bench
cat "$OUT/fp8_check.log" "$OUT/fp8_bench.log"
grep -E "passed|failed" "$OUT/fp8_tests.log" "$OUT/gemm_tests.log" | tail -4
if [ $fail = 0 ]; then echo "SUMMARY fp8: PASS"; else echo "SUMMARY fp8: FAIL"; fi
exit $fail
