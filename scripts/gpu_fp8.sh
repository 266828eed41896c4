#!/usr/bin/env bash
# FP8 foundation on one CUDA GPU (H200): the FP8 engine tests on cuda
# (quantize bit-exact against torch's float8 cast, GEMM against float64,
# Float8Tensor / quantizers on cuda), the GEMM tests touched by the FP8 plan
# keys, the check of our FP8 GEMM against torch._scaled_mm and float64, and
# the FP8-vs-bf16 GEMM benchmark at 8192x4096x12288, 4096x4096x16384 and
# 2048x2048x6144, and the layers' FP8 benchmark (python -m
# transformer_engine_c.bench --fp8: FP8 training steps against our bf16
# layers, torchao float8 compiled and torch.nn; results in $OUT/bench/fp8.md).
# torchao comes from a wheel in .whl/ (carry it: .whl/ is git-ignored),
# unpacked into a temporary folder on PYTHONPATH; without one its rows say
# "torchao not installed". Assumes the lead built the CUDA backend
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
AO_PATH=
AO_WHL=$(ls .whl/torchao-*.whl 2>/dev/null | tail -1)
if [ -n "$AO_WHL" ]; then
    AO_DIR=$(mktemp -d)
    python3 -m pip install -q --no-deps --no-index --target "$AO_DIR" "$AO_WHL" && AO_PATH=$AO_DIR
fi
echo "torchao: ${AO_WHL:-no wheel in .whl/}"
step layers_bench env PYTHONPATH="${AO_PATH:+$AO_PATH:}$PYTHONPATH" \
    python3 -m transformer_engine_c.bench --fp8 --out "$OUT/bench"
cat "$OUT/fp8_check.log" "$OUT/fp8_bench.log"
[ -f "$OUT/bench/fp8.md" ] && cat "$OUT/bench/fp8.md"
grep -E "passed|failed" "$OUT/fp8_tests.log" "$OUT/gemm_tests.log" | tail -4
if [ $fail = 0 ]; then echo "SUMMARY fp8: PASS"; else echo "SUMMARY fp8: FAIL"; fi
exit $fail
