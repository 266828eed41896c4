#!/usr/bin/env bash
# Build with the CUDA backend and run the GPU validation in one go (used on
# the lent GPU machines): the CUDA transport test, the kernel/layer tests on
# cuda, the torchrun tests with NCCL on every GPU count present, the main job,
# and the benchmark when BENCH is set. Logs go to ${OUT:-out}/.
#   bash scripts/gpu_validate.sh [pytest selection...]
#   PART=1 bash scripts/gpu_validate.sh; BUILD=0 PART=2 ...; BUILD=0 PART=3 ...
#   TEC_SHARE_GPU=2 BUILD=0 PART=4 bash scripts/gpu_validate.sh; ... PART=5 ...
#     (the CUDA tests in parts, each meant to take under 9 minutes on one H200:
#      the file lists below; parts 4-5 are the 2-rank tests, which need 2 GPUs
#      or TEC_SHARE_GPU=2; BUILD=0 keeps an in-place build already there; a
#      part skips the main job unless MAINJOB=1; its last line is
#      "PART k: N passed, M failed, K skipped")
#   bash scripts/gpu_validate.sh --all
#     (everything on one GPU in one command, meant to take under 9 minutes on one
#      H100 or H200: one build, then the five parts side by side (parts 4-5 with
#      TEC_SHARE_GPU=2 where there is one GPU; PART_TIMEOUT=380 each); what failed
#      while the parts shared the GPU is rerun alone before it counts (within
#      RERUN_TIMEOUT=100 s); one line per part, then the total; exit 0 only when
#      nothing failed. Each part's logs are in $OUT/partK/, the reruns' in $OUT/;
#      WHEELS=DIR first installs DIR's wheels with pip --no-deps: megatron-core's
#      and torchao's, whose tests skip where they are not installed)
#   In a part, a test that leaves the CUDA state broken stops its process at once
#   (tests/_cuda_state.py names it, and it counts as failed); the part goes on in
#   a fresh process with the tests not yet run, and counts every test once.
#   bash scripts/gpu_validate.sh --parts          (each part's entries: "k entry")
#   bash scripts/gpu_validate.sh --uncovered [ROOT]
#     (ROOT's test files that may run on CUDA but are in no part; exit 1 if any)
#   BENCH="--shapes 8192x4096x12288" bash scripts/gpu_validate.sh
#   PROFILE=2048x2048x6144,8192x4096x12288 bash scripts/gpu_validate.sh tests/test_kernels.py
#     (also runs scripts/profile_overlap.py on every GPU: host/GPU times, cProfile, a trace)
#   SWEEP=1 BENCH="--shapes 8192x4096x12288" bash scripts/gpu_validate.sh ...
#     (also runs scripts/gemm_sweep_check.py, and the benchmark again with TEC_GEMM_TUNE=1)
#   HOSTCOST=1 bash scripts/gpu_validate.sh ...
#     (with 2 or more GPUs, first: scripts/experiments/sp_host_cost.py on NCCL at the
#      benchmark's 2048x2048x6144 MLP step, fast path / general path / PyTorch's block,
#      and the no-grad forwards against PyTorch's sequential path, with a cProfile of
#      ours and PyTorch's; then the same on the fake process group, to compare the
#      one-GPU proxy with NCCL; MAINJOB=0 skips the main job)
#   TEC_COLLECTIVES=torch bash scripts/gpu_validate.sh tests/distributed -k cuda
#     (every test and runner with the layers' CUDA collectives through the process
#      group instead of the engine's own NCCL communicator, the default "auto": the
#      environment reaches pytest, torchrun's ranks and the benchmark's)
#   TEC_SHARE_GPU=2 bash scripts/gpu_validate.sh tests/distributed -k cuda
#     (with one GPU: the 2-rank tests with both ranks on it, NCCL through its socket
#      transport; correctness only, see transformer_engine_c/_launch.py)
#   SANITIZE=1 bash scripts/gpu_validate.sh ...
#     (also runs compute-sanitizer memcheck, racecheck and synccheck over the CUDA
#      transport test, the single-GPU CUDA kernel/layer tests ($SANITIZE_TESTS) and,
#      with 2 or more GPUs, the overlap runners on every GPU; a tool's run passes
#      when it exits 0 and reports "ERROR SUMMARY: 0 errors")
set -uo pipefail
cd "$(dirname "$0")/.."

# The CUDA tests in parts (PART=k), each meant to take under 9 minutes on one
# H200 (docs/gpu-validation.md has the estimates). Parts 1-3 run on one GPU
# with -k "$SINGLE_K": every test but the CPU-only variants, since a test
# without a device in its name may take the GPU as its default device. Parts
# 4-5 are the 2-rank CUDA tests (-k "$RANKS_K": every one has cuda or gpu in
# its name), on 2 GPUs or with TEC_SHARE_GPU=2 on one; the node ids listed
# there are deselected from parts 1-3. Together the parts list every test
# file that may run on CUDA (runs_on_cuda; tests/test_gpu_parts.py checks it).
PARTS=()
PARTS[1]="tests/test_kernels.py tests/test_activations.py tests/test_cuda_transport.py tests/test_comm.py
  tests/test_comm_schedule.py tests/test_gemm_cache.py tests/test_gemm_tune.py tests/test_engine_nccl.py
  tests/test_error_path.py tests/test_reliability_sizes.py tests/test_launch.py tests/test_bad_input.py
  tests/test_norm_attention.py tests/test_te_names.py tests/test_moe_names.py tests/test_alias_extra_state.py
  tests/test_bench.py tests/test_gpu_parts.py tests/test_runner_generators.py"
PARTS[2]="tests/test_layers.py tests/test_one_path.py tests/test_layernorm_mlp.py tests/test_te_semantics.py
  tests/test_saving.py tests/test_debug_checker.py tests/test_fp8_layers.py tests/test_fp8_extra_state.py
  tests/test_fp8_recipe.py tests/test_float8_tensor.py tests/test_te_api.py"
PARTS[3]="tests/test_cuda_graphs.py tests/test_fp8_params.py tests/test_fp8_engine.py tests/test_fp8_steps.py
  tests/test_fp8_block.py tests/test_compile.py tests/test_compile_autocast.py tests/test_rope.py tests/test_transformer_layer.py"
PARTS[4]="tests/distributed/test_layernorm_mlp_tp.py tests/distributed/test_gemm_with_overlap.py
  tests/distributed/test_comm_gemm_overlap.py tests/distributed/test_grad_mode_overlap.py
  tests/distributed/test_graph_overlap.py tests/distributed/test_temporaries.py tests/distributed/test_tp.py
  tests/distributed/test_sp_reference.py tests/distributed/test_distributed_weight.py
  tests/distributed/test_compile_tp.py tests/distributed/test_transformer_layer_tp.py tests/distributed/test_cp.py"
PARTS[5]="tests/distributed/test_te_dropin.py tests/distributed/test_fp8_layers_tp.py
  tests/distributed/test_megatron_gpt.py tests/distributed/test_engine_collectives.py
  tests/distributed/test_megatron_cp.py
  tests/test_megatron_construction.py::test_megatron_tensor_parallel_cuda tests/test_main_job.py::test_main_job_two_gpus"
RANK_PARTS="4 5"
SINGLE_K="not cpu or cuda or gpu"
RANKS_K="cuda or gpu"

is_rank_part() { [[ " $RANK_PARTS " == *" $1 "* ]]; }
list_parts() {
  local k e
  for k in "${!PARTS[@]}"; do for e in ${PARTS[$k]}; do echo "$k $e"; done; done
}
# runs_on_cuda FILE: the file mentions cuda, or one of its tests takes the
# `device` fixture (tests/conftest.py: cpu and cuda).
runs_on_cuda() { grep -qi cuda "$1" || grep -qE '^\s*def test_\w*\((.*[ ,])?device\b' "$1"; }
# uncovered ROOT: ROOT's test files that may run on CUDA and that no part lists.
uncovered() {
  local root=$1 listed f
  listed=$(list_parts | awk '{sub(/::.*/, "", $2); print $2}' | sort -u)
  find "$root/tests" -name 'test_*.py' | sort | while read -r f; do
    runs_on_cuda "$f" || continue
    f=${f#"$root"/}
    grep -qxF "$f" <<< "$listed" || echo "$f"
  done
}
# pytest_resumed LEDGER LOG LIMIT ARGS...: pytest ARGS with its ledger, started
# again on the tests not yet run each time a test leaves the CUDA state broken
# (tests/_cuda_state.py: exit code 17), within LIMIT seconds in all; returns
# the last run's exit code (124 at the limit).
pytest_resumed() {
  local ledger=$1 logf=$2 limit=$3 end rc=0 left; shift 3
  end=$(( $(date +%s) + limit ))
  while :; do
    left=$(( end - $(date +%s) ))
    [ "$left" -gt 5 ] || { rc=124; break; }
    # SIGINT at the limit: pytest stops and reports what ran
    TEC_TEST_LEDGER=$ledger timeout -s INT -k 60 "$left" python3 -m pytest -v -rs -p no:cacheprovider "$@" \
        >> "$logf" 2>&1
    rc=$?
    [ $rc -eq 17 ] || break
    echo "== a test left the CUDA state broken: $(grep -P '^broke\t' "$ledger" | tail -1 | cut -f2); the rest run in a fresh process" | tee -a "$logf"
  done
  return $rc
}
# all_parts: the --all run (see the header).
all_parts() {
  local k ngpu share rc=0 failed_total=0 passed_total=0 skipped_total=0 t0 line end left
  local -a singles=() ranks=()
  OUT=${OUT:-out}; mkdir -p "$OUT"; : > "$OUT/summary.txt"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  t0=$(date +%s)
  date -u | tee -a "$OUT/summary.txt"
  if [ -n "${WHEELS:-}" ]; then  # the peers the machine lacks (megatron-core, torchao), as wheels carried there
    python3 -m pip install --no-deps -q "$WHEELS"/*.whl > "$OUT/wheels.log" 2>&1 \
      || { echo "WHEELS FAILED" | tee -a "$OUT/summary.txt"; tail -20 "$OUT/wheels.log"; return 1; }
    echo "== installed: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
  fi
  TEC_CUDA=1 python3 setup.py build_ext --inplace -j "$(nproc)" > "$OUT/build.log" 2>&1 \
    || { echo "BUILD FAILED" | tee -a "$OUT/summary.txt"; tail -40 "$OUT/build.log"; return 1; }
  echo "== build ok in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  ngpu=$(nvidia-smi -L | wc -l)
  share=${TEC_SHARE_GPU:-$([ "$ngpu" -lt 2 ] && echo 2 || echo 0)}
  for k in 1 2 3 4 5; do  # all five side by side: part 1, the longest, sets the pace
    if is_rank_part $k; then
      TEC_SHARE_GPU=$share PART=$k BUILD=0 OUT="$OUT/part$k" PART_TIMEOUT=${PART_TIMEOUT:-380} bash "$0" \
          > "$OUT/part$k.console" 2>&1 &
    else
      PART=$k BUILD=0 OUT="$OUT/part$k" PART_TIMEOUT=${PART_TIMEOUT:-380} bash "$0" > "$OUT/part$k.console" 2>&1 &
    fi
  done
  wait
  echo "== parts 1-5 done at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  for k in 1 2 3 4 5; do
    mapfile -t ids < <(python3 scripts/pytest_counts.py --failed "$OUT/part$k/ledger.txt")
    if is_rank_part $k; then ranks+=("${ids[@]}"); else singles+=("${ids[@]}"); fi
  done
  # what failed beside the other parts, alone: one process for the one-GPU tests, then one for the 2-rank ones
  end=$(( $(date +%s) + ${RERUN_TIMEOUT:-100} ))
  : > "$OUT/rerun.txt"
  if [ ${#singles[@]} -gt 0 ]; then
    left=$(( end - $(date +%s) ))
    pytest_resumed "$OUT/rerun.txt" "$OUT/rerun.log" "$left" "${singles[@]}"
  fi
  if [ ${#ranks[@]} -gt 0 ]; then
    left=$(( end - $(date +%s) ))
    TEC_SHARE_GPU=$share pytest_resumed "$OUT/rerun.txt" "$OUT/rerun.log" "$left" "${ranks[@]}"
  fi
  for k in 1 2 3 4 5; do
    line=$(python3 scripts/pytest_counts.py --ledger "$OUT/part$k/ledger.txt" "$OUT/rerun.txt")
    echo "PART $k: $line" | tee -a "$OUT/summary.txt"
    if grep -q "^PART $k: .*(stopped at PART_TIMEOUT" "$OUT/part$k/summary.txt" 2>/dev/null; then
      echo "  part $k stopped at its time limit: the tests after it did not run" | tee -a "$OUT/summary.txt"; rc=1
    fi
    set -- $line
    passed_total=$((passed_total + $1)); failed_total=$((failed_total + $3)); skipped_total=$((skipped_total + $5))
  done
  python3 scripts/pytest_counts.py --failed "$OUT/rerun.txt" | sed 's/^/  failed alone too: /' | tee -a "$OUT/summary.txt"
  [ "$failed_total" -eq 0 ] || rc=1
  echo "ALL: $passed_total passed, $failed_total failed, $skipped_total skipped in $(( $(date +%s) - t0 )) s" \
      | tee -a "$OUT/summary.txt"
  return $rc
}
case "${1:-}" in
  --all) all_parts; exit $? ;;
  --parts) list_parts; exit 0 ;;
  --uncovered) u=$(uncovered "${2:-.}"); [ -z "$u" ] || { echo "$u"; exit 1; }; exit 0 ;;
esac
if [ -n "${PART:-}" ]; then
  [[ $PART =~ ^[0-9]+$ ]] && [ -n "${PARTS[$PART]+x}" ] || { echo "PART must be one of: ${!PARTS[*]} (got '$PART')" >&2; exit 2; }
  [ $# -eq 0 ] || { echo "PART=$PART runs its own selection; drop the pytest arguments ($*)" >&2; exit 2; }
  if is_rank_part "$PART" && [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && [ "${TEC_SHARE_GPU:-0}" -lt 2 ]; then
    echo "PART $PART holds the 2-rank CUDA tests: it needs 2 GPUs, or TEC_SHARE_GPU=2 with one" >&2; exit 2
  fi
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
date -u | tee "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' | tee -a "$OUT/summary.txt"
echo "layers' CUDA collectives: ${TEC_COLLECTIVES:-auto} (TEC_COLLECTIVES); ranks sharing a GPU: ${TEC_SHARE_GPU:-no} (TEC_SHARE_GPU)" | tee -a "$OUT/summary.txt"
[ -n "${PART:-}" ] && log "PART $PART: $(echo ${PARTS[$PART]})"
u=$(uncovered .); [ -z "$u" ] || log "test files that may run on CUDA but are in no part: $u"
t0=$(date +%s)
if [ "${BUILD:-1}" = 0 ] && [ -e transformer_engine_c/libtec_cuda.so ]; then
  log "build: kept (BUILD=0)"
else
  TEC_CUDA=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { log "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
  log "build ok in $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${PART:-}" ] && [ -z "${SANITIZE:-}" ]; then
  log "CUDA transport test: run by tests/test_cuda_transport.py in part $(list_parts | awk '$2 == "tests/test_cuda_transport.py" {print $1}')"
else  # the sources and nvcc command tests/test_cuda_transport.py builds too
  python3 tests/cuda/transport_build.py "$OUT/transport_test" > "$OUT/transport_test.log" 2>&1 \
    && timeout 300 "$OUT/transport_test" >> "$OUT/transport_test.log" 2>&1
  log "CUDA transport test: exit $?: $(tail -1 "$OUT/transport_test.log")"
fi
if [ -n "${SANITIZE:-}" ]; then
  CS=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  ngpu=$(nvidia-smi -L | wc -l)
  # sanitize NAME CMD...: run CMD under each tool; the log's error summary decides.
  sanitize() {
    local name=$1; shift
    for tool in memcheck racecheck synccheck; do
      local f="$OUT/sanitize_${name}_${tool}.log"
      timeout 1200 "$CS" --tool "$tool" --target-processes all --error-exitcode 99 "$@" > "$f" 2>&1
      local rc=$? errs
      errs=$(grep -Eo "ERROR SUMMARY: [0-9]+ error" "$f" | awk '{s += $3} END {print s + 0}')
      log "compute-sanitizer $tool $name: exit $rc, $errs errors ($(grep -c 'ERROR SUMMARY' "$f") processes)"
      [ "$rc" -eq 0 ] && [ "$errs" -eq 0 ] || { grep -m 20 -E "^=========  *(Invalid|Race|Barrier|Error|Uninit|Program hit)" "$f" | tee -a "$OUT/summary.txt"; rc_sanitize=1; }
    done
  }
  rc_sanitize=0
  sanitize transport "$OUT/transport_test"
  sanitize cuda_tests python3 -m pytest -q -x -p no:cacheprovider ${SANITIZE_TESTS:-tests/test_kernels.py tests/test_layers.py tests/test_cuda_transport.py}
  if [ "$ngpu" -ge 2 ]; then
    sanitize gemm_overlap python3 -m torch.distributed.run --nproc_per_node="$ngpu" \
        tests/distributed/run_gemm_with_overlap.py --device cuda --check numerics,small,close
    sanitize layer_overlap python3 -m torch.distributed.run --nproc_per_node="$ngpu" \
        tests/distributed/run_layer_with_overlap.py --device cuda --dtypes bfloat16 --checks layers
  else
    log "compute-sanitizer overlap runners: skipped, $ngpu GPU (they need 2 or more)"
  fi
  log "compute-sanitizer: $([ $rc_sanitize -eq 0 ] && echo clean || echo ERRORS)"
fi
rm -f "$OUT/transport_test"
if [ -n "${HOSTCOST:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 240 python3 -m torch.distributed.run --nproc_per_node=2 scripts/experiments/sp_host_cost.py --device cuda \
      --dtype bf16 --ub --tokens 1024 --hidden 2048 --ffn 6144 --iters 50 --reps 5 \
      --profile "$OUT/hostcost_profile.txt" > "$OUT/hostcost.log" 2>&1
  log "host cost (sp_host_cost.py, NCCL): exit $?"; grep -A40 "^nccl" "$OUT/hostcost.log" | tee -a "$OUT/summary.txt"
  # the same on torch's fake process group (one process): how far the one-GPU proxy is from NCCL
  timeout 180 python3 scripts/experiments/sp_host_cost.py --fake --device cuda --dtype bf16 --tokens 1024 \
      --hidden 2048 --ffn 6144 --iters 50 --reps 5 > "$OUT/hostcost_fake.log" 2>&1
  log "host cost (sp_host_cost.py --fake): exit $?"; grep -A40 "^fake" "$OUT/hostcost_fake.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${PART:-}" ]; then
  if is_rank_part "$PART"; then
    sel=(-k "$RANKS_K")
  else
    sel=(-k "$SINGLE_K")
    for e in $(list_parts | awk -v r=" $RANK_PARTS " 'index(r, " " $1 " ") && $2 ~ /::/ {print $2}'); do
      sel+=(--deselect "$e")
    done
  fi
  sel+=(${PARTS[$PART]})
  : > "$OUT/ledger.txt"; : > "$OUT/pytest.log"
  pytest_resumed "$OUT/ledger.txt" "$OUT/pytest.log" "${PART_TIMEOUT:-540}" --durations=30 "${sel[@]}"
  rc=$?
  [ $rc -eq 124 ] && log "pytest stopped at PART_TIMEOUT=${PART_TIMEOUT:-540} s"
else
  sel=("$@"); [ ${#sel[@]} -gt 0 ] || sel=(tests)
  python3 -m pytest -q -rs "${sel[@]}" -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  rc=$?
fi
log "pytest ${sel[*]}: exit $rc: $(tail -1 "$OUT/pytest.log")"
if [ -n "${PART:-}" ]; then
  python3 scripts/pytest_counts.py --failed "$OUT/ledger.txt" | head -30 | sed 's/^/FAILED /' | tee -a "$OUT/summary.txt"
else
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30 | tee -a "$OUT/summary.txt"
fi
if [ "${MAINJOB:-$([ -n "${PART:-}" ] && echo 0 || echo 1)}" != 0 ]; then
  timeout 300 python3 -m transformer_engine_c > "$OUT/mainjob.log" 2>&1
  log "main job: exit $?"; grep -v Warning "$OUT/mainjob.log" | tail -12 | tee -a "$OUT/summary.txt"
fi
if [ -n "${PROFILE:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 300 python3 -m torch.distributed.run --nproc_per_node="$(nvidia-smi -L | wc -l)" \
      scripts/profile_overlap.py --shapes "$PROFILE" --out "$OUT/profile" > "$OUT/profile.log" 2>&1
  log "profile: exit $?"; cat "$OUT/profile/times.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
  python3 scripts/trace_summary.py "$OUT"/profile/mlp_*.json 2>&1 | tee -a "$OUT/summary.txt"
  python3 scripts/trace_summary.py --timeline=14 "$OUT"/profile/layer_*.json 2>&1 | tee -a "$OUT/summary.txt"
  head -45 "$OUT"/profile/cprofile_*.txt 2>/dev/null | tee -a "$OUT/summary.txt"
fi
if [ -n "${BENCH:-}" ]; then
  timeout 400 python3 -m transformer_engine_c.bench $BENCH --out "$OUT/bench" > "$OUT/bench.log" 2>&1
  log "bench: exit $?"; grep -E "^\|" "$OUT/bench.log" | tee -a "$OUT/summary.txt"
fi
if [ -n "${SWEEP:-}" ]; then
  timeout 120 python3 scripts/gemm_sweep_check.py > "$OUT/sweep.log" 2>&1
  log "GEMM sweep check: exit $?"; cat "$OUT/sweep.log" | tee -a "$OUT/summary.txt"
  if [ -n "${BENCH:-}" ]; then
    TEC_GEMM_TUNE=1 timeout 400 python3 -m transformer_engine_c.bench $BENCH --out "$OUT/bench_tuned" \
        > "$OUT/bench_tuned.log" 2>&1
    log "bench with TEC_GEMM_TUNE=1: exit $?"; grep -E "^\|" "$OUT/bench_tuned.log" | tee -a "$OUT/summary.txt"
  fi
fi
[ -n "${SANITIZE:-}" ] && [ "${rc_sanitize:-0}" -ne 0 ] && [ "$rc" -eq 0 ] && rc=1
if [ -n "${PART:-}" ]; then  # the last line: the part's counts (failed includes errors)
  echo "PART $PART: $(python3 scripts/pytest_counts.py --ledger "$OUT/ledger.txt")$([ $rc -eq 124 ] && echo " (stopped at PART_TIMEOUT)")" | tee -a "$OUT/summary.txt"
fi
exit $rc
