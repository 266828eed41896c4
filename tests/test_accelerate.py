"""Hugging Face Accelerate's TransformerEngine path on this package through
the `transformer_engine` alias, on the CPU (FP8 emulated): Accelerate finds
TE by its distribution metadata, `convert_model` swaps nn.Linear and
nn.LayerNorm for te.Linear and te.LayerNorm, `apply_fp8_autowrap` runs the
forward under fp8_autocast with the recipe Accelerate builds, and
`Accelerator(mixed_precision="fp8")` prepares a model and optimizer and
takes a training step. Each test runs in a fresh interpreter (the alias
changes the import system, Accelerate keeps global state)."""
import importlib.util
import os
import subprocess
import sys

import pytest

import transformer_engine_c as te

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="accelerate is not installed (pip install accelerate; it is in the test extra)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import torch
import transformer_engine_c as tec
tec.install_as_transformer_engine()
import transformer_engine.pytorch as te
from accelerate.utils import is_transformer_engine_available
assert is_transformer_engine_available()

def small_model():
    torch.manual_seed(0)
    # every weight dim a multiple of 16: convert_model leaves the model alone otherwise (and FP8 needs it)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 16))
"""


def run(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               ACCELERATE_USE_CPU="1")
    env.pop("TEC_AS_TRANSFORMER_ENGINE", None)
    proc = subprocess.run([sys.executable, "-c", PRELUDE + code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-4000:])


def test_convert_model():
    run("""
from accelerate import Accelerator
from accelerate.utils import convert_model
Accelerator(cpu=True)  # convert_model reads the accelerator's state
model = small_model()
x = torch.randn(16, 32)
ref = model(x)
with torch.no_grad():
    convert_model(model)
assert [type(m) for m in model] == [te.Linear, te.LayerNorm, torch.nn.ReLU, te.Linear], list(model)
torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)  # the same weights, copied
print("OK")
""")


def test_apply_fp8_autowrap():
    run("""
from accelerate import Accelerator
from accelerate.utils import TERecipeKwargs, apply_fp8_autowrap, convert_model
from transformer_engine.common import recipe
Accelerator(cpu=True)
model = small_model()
with torch.no_grad():
    convert_model(model)
x = torch.randn(16, 32)
plain = model(x).detach()
model = apply_fp8_autowrap(model, TERecipeKwargs(fp8_format="HYBRID", amax_history_len=16))
y = model(x)  # training mode: under fp8_autocast
meta = model[0].fp8_meta
assert isinstance(meta["recipe"], recipe.DelayedScaling) and meta["recipe"].amax_history_len == 16, meta
assert meta["fp8_checkpoint"] is True and not torch.equal(y.detach(), plain)
torch.testing.assert_close(y.detach(), plain, rtol=0.2, atol=0.2)  # FP8 GEMMs: close, not equal
model.eval()
torch.testing.assert_close(model(x), plain)  # eval: no autocast (use_autocast_during_eval=False)
print("OK")
""")


def test_accelerator_fp8_prepare_and_step():
    run("""
from accelerate import Accelerator
from accelerate.utils import TERecipeKwargs
accelerator = Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(amax_history_len=16)])
assert accelerator.fp8_backend == "TE", accelerator.fp8_backend
model = small_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = accelerator.prepare(model, opt)
assert isinstance(model[0], te.Linear) and isinstance(model[1], te.LayerNorm) and isinstance(model[3], te.Linear)
params = list(model.parameters())
assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in params}  # remapped
before = [p.detach().clone() for p in params]
x, target = torch.randn(16, 32), torch.randn(16, 16)
for _ in range(2):
    loss = torch.nn.functional.mse_loss(model(x).float(), target)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
assert torch.isfinite(loss)
assert all(not torch.equal(a, p) for a, p in zip(before, params))
meta = model[0].fp8_meta  # the forward ran in FP8: delayed scaling updated the scales from the amaxes
assert meta["recipe"].amax_history_len == 16 and not torch.equal(meta["scaling_fwd"].scale, torch.ones(3))
print("OK")
""")


@pytest.mark.skipif(not hasattr(te, "TransformerLayer"),
                    reason="transformer_engine_c has no TransformerLayer yet: Accelerate's "
                           "has_transformer_engine_layers reads te.TransformerLayer")
def test_has_transformer_engine_layers():
    run("""
from accelerate import Accelerator
from accelerate.utils import convert_model, has_transformer_engine_layers
Accelerator(cpu=True)
model = small_model()
assert not has_transformer_engine_layers(model)
with torch.no_grad():
    convert_model(model)
assert has_transformer_engine_layers(model)
print("OK")
""")
