"""`python -m transformer_engine_c.bench`: the benchmark command.

Without --tp1 or --fp8 it is the comm-GEMM overlap benchmark
(transformer_engine_c.benchmarks.overlap); with --tp1 each layer against the
same layer built from torch.nn modules on one device
(transformer_engine_c.benchmarks.tp1); with --fp8 the FP8 training steps
against our bf16 layers, torchao float8 and torch.nn on one device
(transformer_engine_c.benchmarks.fp8); with --fp8 --fp8-params the memory of
FP8 primary weights against bf16 parameters
(transformer_engine_c.benchmarks.fp8_params); with --fp8 --host the host's
time per eager step, bf16 against FP8, and where the FP8 step's goes
(transformer_engine_c.benchmarks.fp8_host); with --compile a GPT-style block
under torch.compile, CUDA graphs and eagerly, ours against torch.nn's
(transformer_engine_c.benchmarks.compile); with --cp context-parallel
attention against one rank over the whole sequence
(transformer_engine_c.benchmarks.cp)."""
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--cp" in argv:
        from .benchmarks import cp
        return cp.main([a for a in argv if a != "--cp"])
    if "--compile" in argv:
        from .benchmarks import compile as compile_bench
        return compile_bench.main([a for a in argv if a != "--compile"])
    if "--tp1" in argv:
        from .benchmarks import tp1
        return tp1.main([a for a in argv if a != "--tp1"])
    if "--fp8" in argv and "--host" in argv:
        from .benchmarks import fp8_host
        return fp8_host.main([a for a in argv if a not in ("--fp8", "--host")])
    if "--fp8" in argv and "--fp8-params" in argv:
        from .benchmarks import fp8_params
        return fp8_params.main([a for a in argv if a not in ("--fp8", "--fp8-params")])
    if "--fp8" in argv:
        from .benchmarks import fp8
        return fp8.main([a for a in argv if a != "--fp8"])
    from .benchmarks import overlap
    return overlap.main()


if __name__ == "__main__":
    sys.exit(main())
