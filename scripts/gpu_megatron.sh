#!/usr/bin/env bash
# GPU checks of Megatron-Core on transformer_engine_c through the
# transformer_engine alias (tests/distributed/run_megatron_gpt.py): its TE GPT
# layer spec, a 2-layer GPTModel against a float64 reference (loss and every
# gradient), then Megatron's DDP + optimizer for a few steps, on CUDA:
#   1. TP=1 on one GPU;
#   2. TP=2 with two ranks sharing the GPU (TEC_SHARE_GPU=2), sequence parallel;
#   3. the CPU (gloo) TP=2 run and the launcher-form tests, through pytest.
# Needs megatron-core importable by python3 (pip install "megatron-core==0.16.*"
# on CPython 3.11, "megatron-core==0.19.*" on 3.12); with MEGATRON_WHEELS=DIR
# it is installed offline from that directory first. Run from the repository
# root after the build; prints one PASS/FAIL line per check and a summary.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/tests/distributed${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_megatron}
mkdir -p "$OUT"
fail=0
results=()

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
python3 -c "import megatron.core as m, torch; print('megatron-core', m.__version__, 'torch', torch.__version__)"

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
        tail -40 "$log"
        fail=$((fail + 1))
    fi
    grep -E "compared loss|losses" "$log" | head -3
}

run() {  # nproc, args...
    local n=$1
    shift
    python3 -m torch.distributed.run --nproc_per_node="$n" --master_addr=127.0.0.1 \
        --master_port=$((29500 + RANDOM % 2000)) tests/distributed/run_megatron_gpt.py "$@"
}

check megatron_gpt_cuda_tp1 "PASS run_megatron_gpt (TP=1, cuda)" run 1 --device cuda
run_shared() { TEC_SHARE_GPU=2 run "$@"; }  # a function: env cannot start one
check megatron_gpt_cuda_tp2_shared "PASS run_megatron_gpt (TP=2, cuda)" run_shared 2 --device cuda
check megatron_pytest_cpu_and_alias "passed" python3 -m pytest -q -p no:cacheprovider tests/distributed/test_megatron_gpt.py
check megatron_pytest_cuda_shared "passed" env TEC_SHARE_GPU=2 python3 -m pytest -q -p no:cacheprovider \
    tests/distributed/test_megatron_gpt.py -k cuda
check norm_attention_moe_cpu "passed" python3 -m pytest -q -p no:cacheprovider tests/test_norm_attention.py \
    tests/test_moe_names.py tests/test_alias_extra_state.py

for r in "${results[@]}"; do echo "$r"; done
echo "SUMMARY: $(( ${#results[@]} - fail )) passed, $fail failed"
[ $fail -eq 0 ]
