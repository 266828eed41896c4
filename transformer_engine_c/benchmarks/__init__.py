"""The package's benchmarks (docs/performance.md), each a `python -m` command:

    python -m transformer_engine_c.bench            comm-GEMM overlap at TP>1 (overlap.py), or
                                                    --tp1: each layer against torch.nn modules (tp1.py)
    python -m transformer_engine_c.bench_saving     prepare_for_saving / restore_from_saved (saving.py)
    python -m transformer_engine_c.bench_checker    the debug checker's cost (checker.py)

The `transformer_engine_c.bench*` modules are thin entry points into this
subpackage; `python -m transformer_engine_c.benchmarks.<name>` runs the same."""
