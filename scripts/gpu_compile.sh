#!/usr/bin/env bash
# The layers under torch.compile on one GPU: tests/test_compile.py (fullgraph,
# reduce-overhead, graphs after a compiled region), the compiled
# tensor-parallel runner with two ranks sharing the GPU (TEC_SHARE_GPU=2:
# correctness only), then `bench --compile` (BENCH_ARGS adds options).
# torchao's wheel, where .whl/ holds one, is installed first (the FP8 peer).
#   bash scripts/gpu_compile.sh            logs in out/gpu_compile (OUT=...)
OUT=${OUT:-out/gpu_compile}
source scripts/gpu_common.sh
TEC_CUDA=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
ls .whl/torchao-*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/torchao-*.whl > "$OUT/pip.log" 2>&1
step compile_tests python3 -m pytest -q -rs -p no:cacheprovider tests/test_compile.py
tail -1 "$OUT/compile_tests.log"
TEC_SHARE_GPU=2 step compile_tp python3 -m pytest -q -rs -p no:cacheprovider tests/distributed/test_compile_tp.py
tail -1 "$OUT/compile_tp.log"
step bench python3 -m transformer_engine_c.bench --compile --out "$OUT/bench" ${BENCH_ARGS:-}
grep -v Warning "$OUT/bench.log" | grep -E "^(block|  |ratio)" 
exit $fail
