#!/usr/bin/env bash
# FP8 under CUDA graphs on one CUDA GPU (H200): builds the CUDA backend, runs
# tests/test_cuda_graphs.py (graphed FP8 steps against eager ones, weight
# caching, the negative cases, TE's FP8 graph cases; the bf16 graphs too),
# the engine's quantize tests on cuda (the noop flag's kernels), the FP8
# layer tests on cuda (regression of the eager path), and the benchmark's
# graphs row: graphed FP8 LayerNormMLP vs our graphed bf16 step at
# 2048x2048x6144 (target >= 1.3x). Logs and bench_fp8_graphs/ under
# ${OUT:-out}/fp8_graphs/. About 3-5 minutes.
#   bash scripts/gpu_fp8_graphs.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}/fp8_graphs
. scripts/gpu_common.sh
step build env TEC_CUDA=1 TEC_CUDA_ARCHS=90 python3 setup.py -q build_ext --inplace
step cuda_graphs python3 -m pytest -q -rf tests/test_cuda_graphs.py
step fp8_engine_cuda python3 -m pytest -q -rf tests/test_fp8_engine.py -k cuda
step fp8_layers_cuda python3 -m pytest -q -rf tests/test_fp8_layers.py -k cuda
step bench_graphs python3 -m transformer_engine_c.bench --fp8 --graphs --out "$OUT/bench_fp8_graphs"
grep -hE "passed|failed" "$OUT"/*.log | tail -6
grep -hE "^graphs LayerNormMLP|^graphed LayerNormMLP|^status: graphs" "$OUT/bench_graphs.log"
if [ $fail = 0 ]; then echo "SUMMARY fp8_graphs: PASS"; else echo "SUMMARY fp8_graphs: FAIL"; fi
exit $fail
