#!/usr/bin/env bash
# GPU checks of Megatron-Core on transformer_engine_c through the
# transformer_engine alias (tests/distributed/run_megatron_gpt.py): its TE GPT
# layer spec, a 2-layer GPTModel against a float64 reference (loss and every
# gradient; the runner first checks that the inputs and the replicated
# parameters are the same on every rank), then Megatron's DDP + optimizer for a
# few steps, on CUDA. The steps, all by default or the ones named:
#   tp1   TP=1 on one GPU;
#   tp2   TP=2 with two ranks sharing the GPU (TEC_SHARE_GPU=2), sequence
#         parallel: the layers initialised on the GPU (--init device, a CUDA
#         run's default) with the default collectives and with
#         TEC_COLLECTIVES=torch, and initialised on the CPU and moved (--init cpu);
#   cpu   the CPU (gloo) runs and the launcher-form tests through pytest, and
#         the norm / attention / MoE-name tests.
#   bash scripts/gpu_megatron.sh [tp1] [tp2] [cpu]
#   BUILD=1 OUT=$OUT bash scripts/gpu_megatron.sh tp2   (one command on a bare machine)
# Needs megatron-core importable by python3 (pip install "megatron-core==0.16.*"
# on CPython 3.11, "megatron-core==0.19.*" on 3.12); with MEGATRON_WHEELS=DIR
# it is installed offline from that directory first. BUILD=1 builds the CUDA
# extension first (TEC_CUDA=1), else run it after the build. Logs under
# ${OUT:-/tmp/gpu_megatron}, one per check (8 files at most: build, pip and six
# checks); prints each check's result with its largest gradient error, and a
# summary line.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/tests/distributed${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_megatron}
mkdir -p "$OUT"
steps=${*:-tp1 tp2 cpu}
for s in $steps; do
    case $s in tp1|tp2|cpu) ;; *) echo "unknown step '$s' (tp1, tp2, cpu)"; exit 2 ;; esac
done
fail=0
results=()

if [ -n "${BUILD:-}" ]; then
    if ! TEC_CUDA=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
        tail -40 "$OUT/build.log"
        echo "SUMMARY: 0 passed, 1 failed (the build; $OUT/build.log)"
        exit 1
    fi
fi
if ! python3 -c "import megatron.core" 2>/dev/null; then
    if [ -n "${MEGATRON_WHEELS:-}" ]; then
        python3 -m pip install -q --no-index --find-links "$MEGATRON_WHEELS" "megatron-core" >"$OUT/pip.log" 2>&1
    fi
fi
if ! python3 -c "import megatron.core" 2>/dev/null; then
    echo "FAIL: megatron-core is not installed for $(python3 -V); set MEGATRON_WHEELS to a directory with its wheel"
    echo "SUMMARY: 0 passed, 1 failed"
    exit 1
fi
python3 -c "import megatron.core as m, torch; print('megatron-core', m.__version__, 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"

check() {  # name, expected pass line, command...
    local name=$1 want=$2
    shift 2
    local log="$OUT/$name.log"
    local t0=$SECONDS
    "$@" >"$log" 2>&1
    local rc=$?
    if [ $rc -eq 0 ] && grep -q "$want" "$log"; then
        results+=("PASS $name ($((SECONDS - t0)) s)")
    else
        results+=("FAIL $name (rc $rc; log $log)")
        echo "--- $name failed; its last lines:"
        grep -v -i "warn" "$log" | tail -40
        fail=$((fail + 1))
    fi
    echo "--- $name:"
    grep -E "compared loss|largest gradient error|losses" "$log" | head -4
}

run() {  # nproc, args...
    local n=$1
    shift
    python3 -m torch.distributed.run --nproc_per_node="$n" --master_addr=127.0.0.1 \
        --master_port=$((29500 + RANDOM % 2000)) tests/distributed/run_megatron_gpt.py "$@"
}
# functions, so that `env` is not needed to start them (it cannot start a function)
run_shared() { TEC_SHARE_GPU=2 run "$@"; }
run_shared_torch() { TEC_SHARE_GPU=2 TEC_COLLECTIVES=torch run "$@"; }

for s in $steps; do
    case $s in
    tp1)
        check megatron_gpt_cuda_tp1 "PASS run_megatron_gpt (TP=1, cuda)" run 1 --device cuda ;;
    tp2)
        check megatron_gpt_cuda_tp2_shared "PASS run_megatron_gpt (TP=2, cuda)" \
            run_shared 2 --device cuda --init device
        check megatron_gpt_cuda_tp2_shared_torch_collectives "PASS run_megatron_gpt (TP=2, cuda)" \
            run_shared_torch 2 --device cuda --init device
        check megatron_gpt_cuda_tp2_shared_cpu_init "PASS run_megatron_gpt (TP=2, cuda)" \
            run_shared 2 --device cuda --init cpu ;;
    cpu)
        check megatron_pytest_cpu_and_alias "passed" python3 -m pytest -q -p no:cacheprovider \
            tests/distributed/test_megatron_gpt.py -k "not cuda"
        check norm_attention_moe_cpu "passed" python3 -m pytest -q -p no:cacheprovider tests/test_norm_attention.py \
            tests/test_moe_names.py tests/test_alias_extra_state.py ;;
    esac
done

for r in "${results[@]}"; do echo "$r"; done
echo "SUMMARY: $(( ${#results[@]} - fail )) passed, $fail failed"
[ $fail -eq 0 ]
