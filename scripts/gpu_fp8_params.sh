#!/usr/bin/env bash
# FP8 primary weights on one CUDA GPU (H200): builds the CUDA backend, runs
# tests/test_fp8_params.py (its cuda cases: Float8Tensor weights, bit-exact
# against bf16 weights holding their values, no weight cast per call, the
# transpose kept per update, SGD/Adam training, main_grad, parameter memory),
# the sharded FP8 DistributedWeight on two ranks sharing the GPU
# (TEC_SHARE_GPU=2, NCCL), and the memory row
# `python -m transformer_engine_c.bench --fp8 --fp8-params` at hidden 4096
# for delayed, current and block scaling (parameter bytes ratio <= 0.6,
# training-step peaks). Logs and
# fp8_params.json under ${OUT:-out}/fp8_params/.
#   bash scripts/gpu_fp8_params.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}/fp8_params
. scripts/gpu_common.sh
step build env TEC_CUDA=1 TEC_CUDA_ARCHS=90 python3 setup.py -q build_ext --inplace
step fp8_params python3 -m pytest -q -rf tests/test_fp8_params.py
step fp8_dw_shared env TEC_SHARE_GPU=2 OMP_NUM_THREADS=1 python3 -m torch.distributed.run --nproc_per_node=2 \
    --master_addr=127.0.0.1 --master_port=29561 tests/distributed/run_fp8_distributed_weight.py --device cuda
step fp8_layers_regression python3 -m pytest -q -rf tests/test_fp8_layers.py -k cuda
step bench python3 -m transformer_engine_c.bench --fp8 --fp8-params --device cuda --hidden 4096 --tokens 8192 \
    --out "$OUT"
step bench_current python3 -m transformer_engine_c.bench --fp8 --fp8-params --device cuda --hidden 4096 \
    --tokens 8192 --recipe current
step bench_block python3 -m transformer_engine_c.bench --fp8 --fp8-params --device cuda --hidden 4096 \
    --tokens 8192 --recipe block
grep -hE "passed|failed" "$OUT"/*.log | tail -6
grep -hE "^FP8 primary|^\|.*MiB|^target" "$OUT/bench.log" "$OUT/bench_current.log" "$OUT/bench_block.log"
if [ $fail = 0 ]; then echo "SUMMARY fp8_params: PASS"; else echo "SUMMARY fp8_params: FAIL"; fi
exit $fail
