"""The `transformer_engine` alias's machinery (see alias.py, its public
module): the import finder, the distribution metadata it answers for, the
runner. The package imports this module, never alias.py, so that
`python -m transformer_engine_c.alias` runs alias.py fresh."""
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
import types

__all__ = ["install_as_transformer_engine", "uninstall_transformer_engine_alias", "is_installed",
           "TE_API_VERSION", "ENV_VAR", "DIST_NAME", "site_dir", "main"]

# The TransformerEngine release whose Python API the package follows: the
# layers' signatures are TE 2.x's and Megatron-Core 0.16 (which asks for
# TE >= 2.9 in its own dependencies) takes, at 2.9, the paths whose TE calls
# the package implements (docs/decisions.md).
TE_API_VERSION = "2.9.0"
ENV_VAR = "TEC_AS_TRANSFORMER_ENGINE"
_ROOT = "transformer_engine"
DIST_NAME = "transformer-engine"  # TransformerEngine's distribution on PyPI
_PACKAGE = __name__.rpartition(".")[0]  # transformer_engine_c


def _target(fullname):
    """The name of this package's module behind a TE module name, or None for
    `transformer_engine` itself (synthesised)."""
    if fullname == _ROOT:
        return None
    rest = fullname[len(_ROOT) + 1:]
    if rest == "pytorch":
        return _PACKAGE
    if rest.startswith("pytorch."):
        return f"{_PACKAGE}.{rest[len('pytorch.'):]}"
    return f"{_PACKAGE}.{rest}"  # transformer_engine.common[.X]


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        self._spec = getattr(self.module, "__spec__", None)
        return self.module

    def exec_module(self, module):
        # the import system set __spec__ to the alias's spec: the module keeps its own
        if self._spec is not None:
            module.__spec__ = self._spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Answers for `transformer_engine` and its submodules, ahead of any
    installed TransformerEngine."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _ROOT and not fullname.startswith(_ROOT + "."):
            return None
        name = _target(fullname)
        if name is None:
            module = _root_module()
        else:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name is not None and (e.name == name or name.startswith(e.name + ".")):
                    raise ModuleNotFoundError(
                        f"No module named {fullname!r} ({_PACKAGE} stands in for transformer_engine and "
                        f"has no {name!r})", name=fullname) from None
                raise
        is_pkg = hasattr(module, "__path__")
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=is_pkg)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        """importlib.metadata's hook: the `transformer-engine` distribution
        (any spelling of the name), or it among all when no name is asked."""
        name = getattr(context, "name", None)
        if name is None or _normalized(name) == DIST_NAME:
            return iter((_AliasDistribution(),))
        return iter(())


def _normalized(name):
    """A distribution name as packaging normalises it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


class _AliasDistribution(importlib.metadata.Distribution):
    """TransformerEngine's distribution as the alias presents it: the name
    `transformer-engine` at TE_API_VERSION, so that clients that look for
    TE with importlib.metadata (Hugging Face Accelerate's
    is_transformer_engine_available, version gates through packaging) find
    the API the alias serves. It lists no files: nothing of TE is on disk."""

    def read_text(self, filename):
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {TE_API_VERSION}\n"
                    f"Summary: TransformerEngine's API, served by {_PACKAGE} through its transformer_engine alias\n"
                    f"Requires-Python: >=3.10\n")
        if filename == "top_level.txt":
            return f"{_ROOT}\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) / path


_finder = _AliasFinder()
_root = None


def _root_module():
    global _root
    if _root is None:
        pkg = importlib.import_module(_PACKAGE)
        _root = types.ModuleType(_ROOT, f"TransformerEngine's top-level package, served by {_PACKAGE} "
                                        f"(see {_PACKAGE}.alias)")
        _root.__path__ = []  # a package: its submodules come from the finder
        _root.__version__ = TE_API_VERSION
        _root.__tec_alias__ = True
        _root.pytorch = pkg
        _root.common = importlib.import_module(f"{_PACKAGE}.common")
    return _root


def is_installed():
    """Whether the alias is installed in this interpreter."""
    return _finder in sys.meta_path


def _foreign_te():
    """Names of already-imported modules of a real TransformerEngine."""
    found = []
    for name, mod in list(sys.modules.items()):
        if name in (_ROOT, "transformer_engine_torch") or name.startswith(_ROOT + "."):
            if name == "transformer_engine_torch" or mod is None:
                found.append(name)
                continue
            if getattr(mod, "__tec_alias__", False):
                continue
            spec_name = getattr(getattr(mod, "__spec__", None), "name", "") or ""
            if spec_name != _PACKAGE and not spec_name.startswith(_PACKAGE + "."):
                found.append(name)
    return sorted(found)


def install_as_transformer_engine():
    """Make `import transformer_engine` (and its submodules) resolve to this
    package from now on, in this interpreter. Call it before anything imports
    transformer_engine; a second call does nothing. Raises RuntimeError if a
    real TransformerEngine is already imported (its modules and ours would
    be mixed)."""
    if is_installed():
        return
    foreign = _foreign_te()
    if foreign:
        raise RuntimeError(
            f"install_as_transformer_engine: TransformerEngine is already imported ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); install the alias before anything imports "
            "transformer_engine, or do not use it alongside the real TransformerEngine")
    sys.meta_path.insert(0, _finder)
    importlib.import_module(_ROOT)


def uninstall_transformer_engine_alias():
    """Remove the alias and the `transformer_engine` entries it put in
    sys.modules (for tests; modules that already hold `te` keep it)."""
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if n == _ROOT or n.startswith(_ROOT + ".")]:
        mod = sys.modules[name]
        spec_name = getattr(getattr(mod, "__spec__", None), "name", "") or ""
        if getattr(mod, "__tec_alias__", False) or spec_name == _PACKAGE or spec_name.startswith(_PACKAGE + "."):
            del sys.modules[name]


def site_dir():
    """The directory whose sitecustomize installs the alias at interpreter
    start when TEC_AS_TRANSFORMER_ENGINE=1 (put it first on PYTHONPATH)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "alias_site")


def _env_on():
    value = os.environ.get(ENV_VAR, "")
    if value in ("", "0"):
        return False
    if value != "1":
        raise ValueError(f"{ENV_VAR} must be 1 or 0, got {value!r}")
    return True


def _set_env_for_children():
    os.environ[ENV_VAR] = "1"
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if site_dir() not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([site_dir()] + paths)


_USAGE = ("usage: python -m transformer_engine_c.alias SCRIPT [ARGS...]\n"
          "       python -m transformer_engine_c.alias -m MODULE [ARGS...]\n"
          "       python -m transformer_engine_c.alias --pythonpath\n"
          "(under torchrun: torchrun [OPTIONS] -m transformer_engine_c.alias SCRIPT [ARGS...])")


def main(argv=None):
    import runpy
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "--pythonpath":
        print(site_dir())
        return 0
    install_as_transformer_engine()
    _set_env_for_children()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(_USAGE, file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` sets it
        runpy.run_path(argv[0], run_name="__main__")
    return 0
