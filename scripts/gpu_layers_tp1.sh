#!/usr/bin/env bash
# GPU checks of the one-implementation layers (one H200; the build is done by
# the caller): the single-GPU layer suites on cuda, the host-cost script, and
# the --tp1 benchmark (each layer against its torch.nn build at the three
# shapes of docs/performance.md, bf16). Logs and results in ${OUT:-out_layers_tp1}/;
# a PASS/FAIL line per step and a summary at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out_layers_tp1}; mkdir -p "$OUT"
fails=0
step() {  # step NAME COMMAND...
  local name=$1; shift
  if timeout 900 "$@" > "$OUT/$name.log" 2>&1; then echo "PASS $name"; else echo "FAIL $name (rc $?, $OUT/$name.log)"; tail -20 "$OUT/$name.log"; fails=$((fails + 1)); fi
}
step layers python3 -m pytest -q -x -k "cuda or gpu" tests/test_layers.py tests/test_te_semantics.py \
  tests/test_layernorm_mlp.py tests/test_layernorm_mlp_te.py tests/test_one_path.py tests/test_cuda_graphs.py \
  tests/test_debug_checker.py tests/test_saving.py tests/test_bad_input.py
step host_costs python3 scripts/host_costs.py --device cuda
step tp1_bench python3 -m transformer_engine_c.bench --tp1 --shapes 512x1024x1024,2048x2048x6144,8192x4096x12288 \
  --iters 30 --out "$OUT/tp1"
cat "$OUT/host_costs.log" "$OUT/tp1_bench.log" 2>/dev/null | tail -40
if [ "$fails" -eq 0 ]; then echo "SUMMARY layers_tp1: PASS"; else echo "SUMMARY layers_tp1: FAIL ($fails steps)"; fi
exit "$fails"
