#!/usr/bin/env bash
# Float8BlockScaling on one CUDA GPU (H200): builds the CUDA backend, runs
# the block-scaling tests on cuda (block quantize byte-exact, the block GEMM
# against float64, the layers under autocast(recipe=Float8BlockScaling())),
# the FP8 engine and recipe tests touched by the scale modes and ABI 8, the
# block GEMM against torch's blockwise scaled_mm, and times it against the
# per-tensor FP8 GEMM and bf16 at 8192x4096x12288. Logs under ${OUT:-out}/fp8_block/.
#   bash scripts/gpu_fp8_block.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}/fp8_block; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fail=0
step() {  # step NAME CMD...: run, log, record PASS/FAIL
    local name=$1; shift
    if "$@" > "$OUT/$name.log" 2>&1; then echo "PASS $name"; else echo "FAIL $name (see $OUT/$name.log)"; tail -30 "$OUT/$name.log"; fail=1; fi
}
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
step build env TEC_CUDA=1 TEC_CUDA_ARCHS=90 python3 setup.py -q build_ext --inplace
if [ $fail != 0 ]; then echo "SUMMARY fp8_block: FAIL (build)"; exit 1; fi
step block_tests env TEC_TEST_DEVICE=cuda python3 -m pytest -q -rs tests/test_fp8_block.py
step fp8_tests env TEC_TEST_DEVICE=cuda python3 -m pytest -q tests/test_fp8_engine.py tests/test_fp8_recipe.py \
    tests/test_fp8_layers.py tests/test_float8_tensor.py
step gemm_tests python3 -m pytest -q -k cuda tests/test_gemm_cache.py tests/test_kernels.py
step tp_block env TEC_SHARE_GPU=2 python3 -m pytest -q -k block tests/distributed/test_fp8_layers_tp.py
step block_check_bench python3 scripts/fp8_block_bench.py --check --bench
cat "$OUT/block_check_bench.log"
grep -E "passed|failed" "$OUT/block_tests.log" "$OUT/fp8_tests.log" "$OUT/gemm_tests.log" "$OUT/tp_block.log" | tail -6
grep -E "^SKIPPED.*cuda|CHECK (FAIL|SKIP)" "$OUT"/*.log | head -10
if [ $fail = 0 ]; then echo "SUMMARY fp8_block: PASS"; else echo "SUMMARY fp8_block: FAIL"; fi
exit $fail
