"""The `transformer_engine` alias (in a fresh interpreter each: it changes
the import system) and `_extra_state` in TransformerEngine's format.

TE's format, from its module/base.py (TransformerEngineBaseModule) and
ops/op.py (BasicOperation, under LayerNorm and RMSNorm): get_extra_state
returns `torch.empty(0, dtype=torch.uint8)` when the module has no FP8
state, else the pickled FP8 metadata as a uint8 CPU tensor;
set_extra_state takes None or an empty tensor as nothing to load. Every
module of theirs has the `_extra_state` key in its state_dict."""
import io
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

import transformer_engine_c as te

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(code, env=None):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


def test_alias_maps_te_modules_to_ours():
    proc = run_py("""
import transformer_engine_c as t
t.install_as_transformer_engine(); t.install_as_transformer_engine()  # the second call does nothing
import transformer_engine as te_root
import transformer_engine.pytorch as te
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, get_ub
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, activation_recompute_forward, checkpoint
from transformer_engine.pytorch.tensor import QuantizedTensor
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from transformer_engine.pytorch.router import fused_topk_with_score_function
from transformer_engine.pytorch.graph import make_graphed_callables
from transformer_engine.pytorch.quantization import autocast
from transformer_engine.common.recipe import DelayedScaling
import transformer_engine.pytorch.module as module, transformer_engine.pytorch.attention as attention
assert te is t and module is t.module and attention is t.attention and te_root.pytorch is t
assert te_root.common.recipe is t.common.recipe and DelayedScaling is t.recipe.DelayedScaling
assert te_root.__version__ == t.alias.TE_API_VERSION == "2.9.0"
assert t.module.base.__spec__.name == "transformer_engine_c.module.base"  # its own spec is kept
for name in ("RMSNorm", "LayerNorm", "DotProductAttention", "GroupedLinear", "Linear", "LayerNormLinear"):
    assert hasattr(te, name), name
try:
    import transformer_engine.pytorch.optimizers
except ModuleNotFoundError as e:
    assert "transformer_engine.pytorch.optimizers" in str(e), e
else:
    raise AssertionError("a missing TE submodule imported")
t.alias.uninstall_transformer_engine_alias()
import sys
assert "transformer_engine" not in sys.modules
try:
    import transformer_engine
except ModuleNotFoundError:
    print("OK")
""")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_alias_refuses_a_real_transformer_engine():
    proc = run_py("""
import sys, types
sys.modules["transformer_engine"] = types.ModuleType("transformer_engine")  # as if TE were imported
import transformer_engine_c as t
try:
    t.install_as_transformer_engine()
except RuntimeError as e:
    assert "already imported" in str(e) and "transformer_engine" in str(e), e
    assert not t.alias.is_installed()
    print("REFUSED")
""")
    assert proc.returncode == 0 and "REFUSED" in proc.stdout, proc.stderr[-3000:]


def test_alias_environment_variable():
    site = te.alias.site_dir()
    env = {"TEC_AS_TRANSFORMER_ENGINE": "1", "PYTHONPATH": os.pathsep.join([site, ROOT])}
    proc = run_py("import transformer_engine.pytorch as te, transformer_engine_c as t; assert te is t; print('ON')",
                  env)
    assert proc.returncode == 0 and "ON" in proc.stdout, proc.stderr[-3000:]
    env["TEC_AS_TRANSFORMER_ENGINE"] = "0"
    proc = run_py("import transformer_engine", env)
    assert proc.returncode != 0 and "No module named 'transformer_engine'" in proc.stderr, proc.stderr[-3000:]
    env["TEC_AS_TRANSFORMER_ENGINE"] = "yes"
    proc = run_py("pass", env)
    assert "TEC_AS_TRANSFORMER_ENGINE must be 1 or 0" in proc.stderr, proc.stderr[-3000:]


def test_alias_runner_runs_a_script_and_a_module(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys, transformer_engine\nprint('ARGS', sys.argv[1:], transformer_engine.__version__)\n")
    e = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "transformer_engine_c.alias", str(script), "--x", "1"], env=e,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ARGS ['--x', '1'] 2.9.0" in out.stdout, out.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "transformer_engine_c.alias", "-m", "json.tool", "--help"], env=e,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "json.tool" in out.stdout, out.stderr[-3000:]



def test_alias_pythonpath_prints_only_the_path():
    """`--pythonpath` goes into shell substitutions: nothing on stderr (no
    runpy warning about the module being imported already), with or without
    the environment form already on."""
    e = dict(os.environ, PYTHONPATH=ROOT)
    e.pop("TEC_AS_TRANSFORMER_ENGINE", None)
    for env in (e, dict(e, TEC_AS_TRANSFORMER_ENGINE="1", PYTHONPATH=os.pathsep.join([te.alias.site_dir(), ROOT]))):
        out = subprocess.run([sys.executable, "-W", "always", "-m", "transformer_engine_c.alias", "--pythonpath"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
        assert out.stdout == te.alias.site_dir() + "\n"


def test_alias_provides_te_distribution_metadata():
    """importlib.metadata sees a `transformer-engine` distribution at the TE
    API version only while the alias is installed (what Accelerate and
    packaging-based version checks read)."""
    proc = run_py("""
import importlib.metadata as md, importlib.util
import transformer_engine_c as t
def version():
    try:
        return md.version("transformer-engine")
    except md.PackageNotFoundError:
        return None
assert version() is None
t.install_as_transformer_engine()
assert version() == t.alias.TE_API_VERSION == "2.9.0"
assert md.version("transformer_engine") == md.version("Transformer.Engine") == "2.9.0"
assert md.metadata("transformer-engine")["Name"] == "transformer-engine"
assert md.distribution("transformer-engine").files is None
assert "transformer-engine" in md.packages_distributions().get("transformer_engine", [])
assert importlib.util.find_spec("transformer_engine") is not None
try:
    from packaging.version import Version
except ImportError:
    pass
else:
    assert Version(version()) >= Version("2.9") and Version(version()) < Version("3")
t.alias.uninstall_transformer_engine_alias()
assert version() is None
print("OK")
""")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


# ---------------------------------------------------------------- _extra_state

# TE's state_dict keys for each module (its parameter names, and _extra_state)
TE_KEYS = {
    "Linear": ["weight", "bias", "_extra_state"],
    "LayerNormLinear": ["layer_norm_weight", "layer_norm_bias", "weight", "bias", "_extra_state"],
    "LayerNormMLP": ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias",
                     "_extra_state"],
    "LayerNorm": ["weight", "bias", "_extra_state"],
    "RMSNorm": ["weight", "_extra_state"],
    "GroupedLinear": ["weight0", "bias0", "weight1", "bias1", "_extra_state"],
    "DotProductAttention": ["_extra_state"],
}


def build(name):
    return {"Linear": lambda: te.Linear(8, 8, device="cpu"),
            "LayerNormLinear": lambda: te.LayerNormLinear(8, 8, device="cpu"),
            "LayerNormMLP": lambda: te.LayerNormMLP(8, 16, device="cpu"),
            "LayerNorm": lambda: te.LayerNorm(8, device="cpu"),
            "RMSNorm": lambda: te.RMSNorm(8, device="cpu"),
            "GroupedLinear": lambda: te.GroupedLinear(2, 8, 8, device="cpu"),
            "DotProductAttention": lambda: te.DotProductAttention(2, 4)}[name]()


def te_state_dict(name, ours):
    """A state_dict as TE saves it for a non-FP8 model: the tensors, and
    _extra_state an empty uint8 tensor."""
    sd = {k: torch.randn_like(v) for k, v in ours.state_dict().items() if k != "_extra_state"}
    sd["_extra_state"] = torch.empty(0, dtype=torch.uint8)
    return sd


@pytest.mark.parametrize("name", list(TE_KEYS))
def test_extra_state_matches_te_format(name):
    m = build(name)
    sd = m.state_dict()
    assert sorted(sd) == sorted(TE_KEYS[name])
    extra = sd["_extra_state"]
    assert isinstance(extra, torch.Tensor) and extra.dtype == torch.uint8 and extra.numel() == 0
    assert extra.device.type == "cpu"
    # TE's state_dict loads strict into ours
    theirs = te_state_dict(name, m)
    m.load_state_dict(theirs, strict=True)
    for k, v in theirs.items():
        if k != "_extra_state":
            assert torch.equal(m.state_dict()[k], v), k
    # ours loads strict into a model with TE's keys (a module whose state_dict is TE's)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    build(name).load_state_dict(back, strict=True)


def test_extra_state_missing_key_is_an_error_and_fp8_state_is_read():
    """A missing key fails strict loading; TE's FP8 state (a pickled dict
    with the recipe and delayed scaling's tensors) is loaded into the
    layer's fp8_meta (tests/test_fp8_extra_state.py has the rest)."""
    m = te.Linear(8, 8, device="cpu")
    sd = m.state_dict()
    del sd["_extra_state"]
    with pytest.raises(RuntimeError, match="_extra_state"):
        m.load_state_dict(sd, strict=True)
    state = {"recipe": te.recipe.DelayedScaling(amax_history_len=2), "scale_fwd": torch.full((3,), 2.0),
             "amax_history_fwd": torch.ones(2, 3), "scale_bwd": torch.full((2,), 4.0),
             "amax_history_bwd": torch.ones(2, 2), "extra_fp8_variables": {"fp8_checkpoint": True}}
    sd["_extra_state"] = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.load_state_dict(sd, strict=True)
    assert torch.equal(m.fp8_meta["scaling_fwd"].scale, state["scale_fwd"])
    assert torch.equal(m.fp8_meta["scaling_bwd"].scale_inv, torch.full((2,), 0.25))
    assert m.state_dict()["_extra_state"].numel() > 0
    sd["_extra_state"] = {"not": "a tensor"}
    with pytest.raises(TypeError, match="_extra_state"):
        m.load_state_dict(sd, strict=True)
