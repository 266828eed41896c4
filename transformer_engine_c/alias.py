"""Opt-in: make `import transformer_engine` resolve to this package, for code
whose imports cannot be edited (Megatron-Core and other TransformerEngine
clients).

After install_as_transformer_engine():
  * `transformer_engine` is a small package module whose `pytorch` is
    `transformer_engine_c` itself and whose `common` is
    `transformer_engine_c.common`; `__version__` is TE_API_VERSION;
  * `transformer_engine.pytorch.X[.Y]` is `transformer_engine_c.X[.Y]` (the
    same module objects: `module`, `module.base`, `distributed`, `tensor`,
    `quantization`, `fp8`, `router`, `graph`, `attention`, ...) and
    `transformer_engine.common.X` is `transformer_engine_c.common.X`;
  * a TE submodule this package does not have raises ModuleNotFoundError on
    import, as an uninstalled optional TE part does (clients guard those);
  * importlib.metadata finds a `transformer-engine` distribution at
    TE_API_VERSION (and no longer once the alias is removed), so clients
    that look TE up by its distribution (Hugging Face Accelerate, version
    checks through packaging) see it.

Three ways to turn it on:
  * a call at the top of the training script, before anything imports
    transformer_engine: `transformer_engine_c.install_as_transformer_engine()`;
  * a runner: `python -m transformer_engine_c.alias script.py args...` or
    `torchrun [options] -m transformer_engine_c.alias script.py args...`
    (torchrun's -m runs the module in every worker as `python -m` would);
    `-m package.module` in place of the script runs a module;
  * the environment: TEC_AS_TRANSFORMER_ENGINE=1 with PYTHONPATH starting
    with the directory `python -m transformer_engine_c.alias --pythonpath`
    prints. Its sitecustomize installs the alias when the interpreter starts,
    so every Python process that inherits the environment has it: torchrun's
    workers, multiprocessing's spawned children, subprocesses. It then runs
    the sitecustomize it shadows, if any. The runner sets both variables for
    the processes its script starts.

The machinery is in _alias.py, which the package imports; this module is
what `python -m transformer_engine_c.alias` runs."""
from ._alias import (DIST_NAME, ENV_VAR, TE_API_VERSION, __all__, install_as_transformer_engine,  # noqa: F401
                     is_installed, main, site_dir, uninstall_transformer_engine_alias)

if __name__ == "__main__":
    import sys

    sys.exit(main())
