# Sourced by the scripts/gpu_*.sh runners after they set OUT (their log
# directory): the environment every GPU run keeps (multicast off), the
# package on PYTHONPATH, and `step NAME CMD...`, which runs CMD with its
# output in $OUT/NAME.log, prints PASS or FAIL (with the log's tail) and
# sets fail=1 on a failure.
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fail=0
step() {
    local name=$1; shift
    if "$@" > "$OUT/$name.log" 2>&1; then echo "PASS $name"; else echo "FAIL $name (see $OUT/$name.log)"; tail -40 "$OUT/$name.log"; fail=1; fi
}
