"""`python -m transformer_engine_c.bench`: the benchmark command.

Without --tp1 it is the comm-GEMM overlap benchmark
(transformer_engine_c.benchmarks.overlap); with --tp1 each layer against the
same layer built from torch.nn modules on one device
(transformer_engine_c.benchmarks.tp1)."""
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--tp1" in argv:
        from .benchmarks import tp1
        return tp1.main([a for a in argv if a != "--tp1"])
    from .benchmarks import overlap
    return overlap.main()


if __name__ == "__main__":
    sys.exit(main())
