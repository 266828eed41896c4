#!/usr/bin/env bash
# The host-cost targets at TP=1 on one H200: builds the CUDA extension, then
# runs scripts/gpu_layers_tp1.sh (the single-GPU layer suites on cuda, the
# host-cost script and the --tp1 benchmark at the three shapes of
# docs/performance.md, bf16) and the host-cost script's interleaved layer
# comparison alone with more rounds. Prints the --tp1 table (ms ratio = torch /
# ours, target >= 1.0; host ratio = ours / torch, target <= 1.0), the
# comparison (target <= 1.25) and a summary line. Logs in ${OUT:-out_host_tp1}/.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-out_host_tp1}
mkdir -p "$OUT"
if ! TEC_CUDA=1 TEC_CUDA_ARCHS=90 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; then
  echo "FAIL build ($OUT/build.log)"; tail -30 "$OUT/build.log"; echo "SUMMARY host_tp1: FAIL (build)"; exit 1
fi
echo "PASS build"
bash scripts/gpu_layers_tp1.sh
rc=$?
echo "== interleaved layer comparison, cuda, 40 rounds (least and median)"
python3 scripts/host_costs.py --device cuda --compare-only --rounds 40 2>&1 | tee "$OUT/compare.log" | tail -9
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=$((rc + 1))
echo "== the --tp1 table ($OUT/tp1/tp1.md)"
cat "$OUT/tp1/tp1.md" 2>/dev/null
if [ "$rc" -eq 0 ]; then echo "SUMMARY host_tp1: PASS"; else echo "SUMMARY host_tp1: FAIL ($rc)"; fi
exit "$rc"
