#!/usr/bin/env bash
# The layers in FP8 on one CUDA GPU (H200): tests/test_fp8_layers.py on cuda
# (reference products, scale updates, accuracy, micro-batching), the layer
# tests that share the steps (a regression check of the bf16 path), and the
# TP=2 FP8 layers with two ranks sharing the GPU (TEC_SHARE_GPU=2, NCCL
# over its socket transport: correctness only). Assumes the CUDA backend is
# built (TEC_CUDA=1 python3 setup.py build_ext --inplace). Logs under
# ${OUT:-out}/fp8_layers/.
#   bash scripts/gpu_fp8_layers.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}/fp8_layers
. scripts/gpu_common.sh
step fp8_layers python3 -m pytest -q -rf tests/test_fp8_layers.py -k cuda
step layers_cuda python3 -m pytest -q -rf -k cuda tests/test_layers.py tests/test_one_path.py tests/test_layernorm_mlp.py
step fp8_tp2_shared env TEC_SHARE_GPU=2 python3 -m pytest -q -rf tests/distributed/test_fp8_layers_tp.py -k cuda
grep -hE "passed|failed" "$OUT"/*.log | tail -6
if [ $fail = 0 ]; then echo "SUMMARY fp8_layers: PASS"; else echo "SUMMARY fp8_layers: FAIL"; fi
exit $fail
