"""Installs transformer_engine_c's `transformer_engine` alias at interpreter
start when TEC_AS_TRANSFORMER_ENGINE=1 (this directory first on PYTHONPATH;
see transformer_engine_c/alias.py), then runs the sitecustomize it shadows."""
import importlib.machinery
import importlib.util
import os
import sys


def _run_shadowed():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("TEC_AS_TRANSFORMER_ENGINE", "") not in ("", "0"):
    from transformer_engine_c import _alias

    if _alias._env_on():  # a value other than 0 / 1 raises, naming the variable
        _alias.install_as_transformer_engine()
_run_shadowed()
