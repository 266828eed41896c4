"""`python -m transformer_engine_c.bench_checker`: runs transformer_engine_c.benchmarks.checker."""
from .benchmarks.checker import main

if __name__ == "__main__":
    main()
