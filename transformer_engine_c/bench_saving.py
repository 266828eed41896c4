"""`python -m transformer_engine_c.bench_saving`: runs transformer_engine_c.benchmarks.saving."""
from .benchmarks.saving import main

if __name__ == "__main__":
    main()
