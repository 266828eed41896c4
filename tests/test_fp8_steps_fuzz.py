"""The one-call FP8 steps (module/_fp8_gemm.ONE_CALL) against the general path
over randomly drawn layer configurations: the layer and its options, the
recipe and its parameters, the compute dtype, the token counts, the grad
modes, weight caching, fused and delayed weight gradients, frozen
parameters, checkpointing, the tensor-parallel modes on one rank, FP8
primary weights, stacks of layers. Each configuration runs twice from the same
seed, with and without the one-call steps; every output, gradient,
main_grad and delayed-scaling state after every step must be the same bit
for bit, and where one run raises the other must raise the same type at
the same step. A fixed sample of configurations runs here; `configs` draws
more for a longer search."""
import collections
import contextlib
import random

import pytest
import torch

import transformer_engine_c as te
from helpers import Stack
from transformer_engine_c.module import _fp8_gemm
from transformer_engine_c.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MMParams
from transformer_engine_c.recipe import QParams

# torch's reentrant checkpoint of an input without grad (its gradients are None, as the warning says)
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad:UserWarning")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ACTIVATIONS = ("gelu", "relu", "qgelu", "srelu", "silu", "geglu", "reglu", "qgeglu", "sreglu", "swiglu",
               "clamped_swiglu", "glu")
# leading dims of the input: multiples of 16 tokens, 24 and 8 (wgrad's general path), none
LEADS = ((16,), (32,), (48,), (8, 2), (16, 3)) * 2 + ((24,), (8,), (0,), (4, 6), (0, 2))


def random_recipe(rng):
    """A recipe spec (a dict: `make_recipe` builds it)."""
    r = rng.random()
    fmt = rng.choice(["HYBRID", "E4M3"])
    if r < 0.55:
        return dict(kind="delayed", fmt=fmt, hist=rng.choice([1, 4, 16]), algo=rng.choice(["max", "most_recent"]),
                    margin=rng.choice([0, 0, 1, 2]))
    if r < 0.95:
        return dict(kind="current", fmt=fmt, pow2=[rng.random() < 0.4 for _ in range(3)],
                    eps=[rng.choice([0.0, 0.0, 1e-3, 1.0]) for _ in range(3)],
                    split=[rng.random() < 0.5 for _ in range(3)])
    return dict(kind="block", fmt=fmt)


def make_recipe(spec):
    fmt = Format[spec["fmt"]]
    if spec["kind"] == "delayed":
        return DelayedScaling(fp8_format=fmt, amax_history_len=spec["hist"], amax_compute_algo=spec["algo"],
                              margin=spec["margin"])
    if spec["kind"] == "current":
        qp = [QParams(power_2_scale=p, amax_epsilon=e) for p, e in zip(spec["pow2"], spec["eps"])]
        mm = [MMParams(use_split_accumulator=s) for s in spec["split"]]
        return Float8CurrentScaling(fp8_format=fmt, fp8_quant_fwd_inp=qp[0], fp8_quant_fwd_weight=qp[1],
                                    fp8_quant_bwd_grad=qp[2], fp8_gemm_fprop=mm[0], fp8_gemm_dgrad=mm[1],
                                    fp8_gemm_wgrad=mm[2])
    return Float8BlockScaling(fp8_format=fmt)


def random_config(rng):
    """One configuration (plain data, printable as a reproducer's argument):
    one layer, or a stack of two or three (`layers`, each a configuration
    whose steps are the stack's)."""
    if rng.random() < 0.15:
        c = _layer_config(rng, "Stack")
        hidden = c["hidden"]
        c["layers"] = []
        for _ in range(rng.choice([2, 3])):
            sub = _layer_config(rng)
            sub.update(hidden=hidden, dtype=c["dtype"], return_bias=False, ret_ln=False, ckpt=None,
                       fp8_init=c["fp8_init"], recipes=c["recipes"])
            hidden = hidden if sub["kind"] == "LayerNormMLP" else sub["out"]
            c["layers"].append(sub)
        c["out"] = hidden
        return c
    return _layer_config(rng)


def _layer_config(rng, kind=None):
    kind = kind or rng.choice(["Linear", "LayerNormLinear", "LayerNormMLP"])
    c = dict(kind=kind, hidden=rng.choice([32, 48, 64, 96, 128]), out=rng.choice([16, 32, 48, 64]),
             ffn=rng.choice([16, 32, 64]), bias=rng.random() < 0.6, return_bias=rng.random() < 0.2,
             dtype=rng.choice(["bf16", "bf16", "fp16", "fp32"]), seed=rng.randrange(1000))
    if kind != "Linear":
        c.update(norm=rng.choice(["LayerNorm", "RMSNorm"]), zcg=rng.random() < 0.3, ret_ln=rng.random() < 0.2,
                 ln_grad=rng.random() < 0.5)
    if kind == "LayerNormMLP":
        c.update(act=rng.choice(ACTIVATIONS), mlp_ckpt=rng.random() < 0.15)
    # the weight gradient: plain, fused into main_grad, delayed (backward_dw), frozen weight(s)
    c["wgrad"] = rng.choice(["plain"] * 6 + ["fused", "delayed", "fused_delayed", "frozen"])
    c["frozen_norm"] = kind != "Linear" and rng.random() < 0.1
    c["ckpt"] = rng.choice([None] * 8 + ["reentrant", "nonreentrant"])
    recipes = [random_recipe(rng)]
    if rng.random() < 0.1:  # the recipe changes between steps
        recipes.append(random_recipe(rng))
    c["recipes"] = recipes
    c["bwd_in_autocast"] = rng.random() < 0.3
    c["zero_grad"] = rng.random() < 0.7
    lead = rng.choice(LEADS)
    steps = []
    pattern = rng.choice(["none", "mb", "random"])
    for i in range(rng.choice([2, 3, 3, 4])):
        first_mb = None if pattern == "none" else (i % 2 == 0) if pattern == "mb" else rng.choice([None, True, False])
        steps.append(dict(
            mode=rng.choice(["train"] * 6 + ["nograd", "inference", "fwd_only", "x_const", "two_mb"]),
            first_mb=first_mb, lead=lead if rng.random() < 0.8 else rng.choice(LEADS),
            xs=rng.choice([1.0, 1.0, 3.0, 0.05, 40.0]), dys=rng.choice([1.0, 0.01, 1e-4, 30.0]),
            loss=rng.choice(["dy", "dy", "sum", "square"]), fp8=rng.random() < 0.93,
            in32=rng.random() < 0.1, strided=rng.random() < 0.1, recipe=min(i * len(recipes) // 3,
                                                                             len(recipes) - 1)))
    c["steps"] = steps
    # tensor-parallel modes on one rank, FP8 primary weights, an update of the weights after each step
    c["parallel"] = rng.choice([None, None, "column", "row"])
    c["sp"] = c["parallel"] is not None and rng.random() < 0.5
    c["fp8_init"] = c["recipes"][0]["kind"] != "block" and rng.random() < 0.1
    c["update"] = rng.random() < 0.3
    if kind == "Linear":
        c["split"] = rng.random() < 0.1
        c["save_original_input"] = rng.random() < 0.15
    return c


def configs(seed, n):
    rng = random.Random(seed)
    return [random_config(rng) for _ in range(n)]


def build(c):
    if c["kind"] == "Stack":
        return Stack([build(sub) for sub in c["layers"]])
    dtype = DTYPES[c["dtype"]]
    torch.manual_seed(c["seed"])
    fuse = c["wgrad"] in ("fused", "fused_delayed")
    delay = c["wgrad"] in ("delayed", "fused_delayed")
    kw = dict(params_dtype=dtype, device="cpu", bias=c["bias"], return_bias=c["return_bias"], fuse_wgrad_accumulation=fuse,
              delay_wgrad_compute=delay)
    par = c.get("parallel")
    if c["kind"] == "LayerNormMLP":
        kw.update(set_parallel_mode=par is not None, sequence_parallel=c.get("sp", False))
    else:
        kw.update(parallel_mode=par, sequence_parallel=c.get("sp", False))
    init = te.quantized_model_init(recipe=make_recipe(c["recipes"][0])) if c.get("fp8_init") else \
        contextlib.nullcontext()
    with init:
        if c["kind"] == "Linear":
            split = {"a": 16, "b": c["out"] - 16} if c.get("split") and c["out"] > 16 else None
            m = te.Linear(c["hidden"], c["out"], parameters_split=split,
                          save_original_input=c.get("save_original_input", False), **kw)
        elif c["kind"] == "LayerNormLinear":
            m = te.LayerNormLinear(c["hidden"], c["out"], normalization=c["norm"], zero_centered_gamma=c["zcg"],
                                   return_layernorm_output=c["ret_ln"], **kw)
        else:
            params = {"limit": 0.75, "alpha": 1.5} if c["act"] == "clamped_swiglu" else None
            m = te.LayerNormMLP(c["hidden"], c["ffn"], normalization=c["norm"], zero_centered_gamma=c["zcg"],
                                return_layernorm_output=c["ret_ln"], activation=c["act"], activation_params=params,
                                checkpoint=c["mlp_ckpt"], **kw)
    gen = torch.Generator().manual_seed(c["seed"])
    with torch.no_grad():  # biases and norm parameters away from their zero / one initial values
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_((0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype))
    for name, p in m.named_parameters():
        is_weight = p.dim() == 2
        if is_weight and fuse:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        if (is_weight and c["wgrad"] == "frozen") or (not is_weight and "layer_norm" in name and c["frozen_norm"]):
            p.requires_grad_(False)
    return m


def _layers(m):
    return list(m.layers) if isinstance(m, Stack) else [m]


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _forward(m, c, x, first_mb):
    if c["ckpt"] is None:
        return m(x, is_first_microbatch=first_mb)
    return te.checkpoint(m, x, is_first_microbatch=first_mb, use_reentrant=c["ckpt"] == "reentrant")


def _loss(outs, s, gen, skip_last):
    """The loss of one forward's outputs (but the last with skip_last):
    each output against a random gradient (`dy`), summed, or squared and
    summed."""
    total = 0
    for o in outs[:-1] if skip_last else outs:
        if not o.requires_grad:
            continue
        if s["loss"] == "dy":
            total = total + (o.float() * (torch.randn(o.shape, generator=gen) * s["dys"])).sum()
        elif s["loss"] == "sum":
            total = total + o.sum() * s["dys"]
        else:
            total = total + (o.float() * s["dys"]).square().sum()
    return total


def _snap(t):
    return None if t is None else t.detach().clone()


def run(c, one_call):
    """The configuration's steps with the one-call steps on or off:
    [(label, tensor or None)], ending with ("raised", type name, message)
    where a step raised."""
    saved = _fp8_gemm.ONE_CALL
    _fp8_gemm.ONE_CALL = one_call
    res = []
    try:
        m = build(c)
        gen = torch.Generator().manual_seed(c["seed"] + 1)
        dtype = DTYPES[c["dtype"]]
        for i, s in enumerate(c["steps"]):
            recipe = make_recipe(c["recipes"][s["recipe"]])
            if c["zero_grad"]:
                m.zero_grad(set_to_none=True)
            mode = s["mode"]
            n_fwd = 2 if mode == "two_mb" else 1
            xs, outs = [], []
            for j in range(n_fwd):
                lead = s["lead"]
                x = torch.randn(*lead, c["hidden"] * (2 if s["strided"] else 1), generator=gen) * s["xs"]
                if s["strided"]:
                    x = x[..., ::2]
                x = x.to(torch.float32 if s["in32"] else dtype)
                if mode not in ("x_const", "nograd", "inference"):
                    x.requires_grad_()
                xs.append(x)
                first_mb = s["first_mb"] if j == 0 else (False if s["first_mb"] is not None else None)
                grad_ctx = torch.no_grad() if mode == "nograd" else \
                    torch.inference_mode() if mode == "inference" else contextlib.nullcontext()
                # a float32 input under torch.autocast (cast to the layer's compute dtype)
                amp = torch.autocast("cpu", dtype=torch.bfloat16 if dtype is torch.float32 else dtype) \
                    if s["in32"] else contextlib.nullcontext()
                with grad_ctx, amp, te.autocast(enabled=s["fp8"], recipe=recipe):
                    outs.append(_flat(_forward(m, c, x, first_mb)))
            flat = [o for os_ in outs for o in os_]
            res += [(f"step{i} out{k}", _snap(o)) for k, o in enumerate(flat)]
            if mode in ("train", "x_const", "two_mb"):
                skip_ln = c.get("ret_ln") and not c.get("ln_grad")  # the normalised output (last) without a gradient
                loss = sum(_loss(os_, s, gen, skip_ln) for os_ in outs)
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    with te.autocast(enabled=s["fp8"], recipe=recipe) if c["bwd_in_autocast"] else \
                            contextlib.nullcontext():
                        loss.backward()
                    for layer in _layers(m):
                        if layer.delay_wgrad_compute:
                            for _ in range(n_fwd):
                                layer.backward_dw()
                res += [(f"step{i} x{j}.grad", _snap(x.grad)) for j, x in enumerate(xs)]
                res += [(f"step{i} {n}.grad", _snap(p.grad)) for n, p in m.named_parameters()]
                res += [(f"step{i} {n}.main_grad", _snap(p.main_grad)) for n, p in m.named_parameters()
                        if hasattr(p, "main_grad")]
                if c.get("update"):  # a step of SGD (a weight changed between micro-batches stays cached)
                    with torch.no_grad():
                        for p in m.parameters():
                            g = p.main_grad if hasattr(p, "main_grad") else p.grad
                            if g is not None and p.requires_grad:
                                p.sub_((0.01 * g).to(p.dtype))
            for j, layer in enumerate(_layers(m)):
                meta = getattr(layer, "fp8_meta", None) or {}
                for key in ("scaling_fwd", "scaling_bwd"):
                    if key in meta:
                        t = meta[key]
                        res += [(f"step{i} layer{j} {key}.{a}", _snap(getattr(t, a)))
                                for a in ("scale", "scale_inv", "amax_history")]
    except Exception as e:  # noqa: BLE001  (compared with the other run's)
        res.append(("raised", type(e).__name__, str(e)))
    finally:
        _fp8_gemm.ONE_CALL = saved
    return res


def same_bits(a, b):
    """a and b hold the same values bit for bit (NaNs included), with the
    same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True


def differences(one, general):
    """What differs between two runs' results (empty: nothing)."""
    diffs = []
    if one and one[-1][0] == "raised" or general and general[-1][0] == "raised":
        ro = one[-1][1] if one[-1][0] == "raised" else None
        rg = general[-1][1] if general[-1][0] == "raised" else None
        if ro != rg or len(one) != len(general):
            diffs.append(f"raised: one-call {one[-1][1:] if ro else None}, general {general[-1][1:] if rg else None}"
                         f" after {len(one)} / {len(general)} results")
            return diffs
    if len(one) != len(general):
        return diffs + [f"{len(one)} results against {len(general)}"]
    for (la, a), (lb, b) in zip((r[:2] for r in one), (r[:2] for r in general)):
        if la != lb:
            return diffs + [f"result {la} against {lb}"]
        if la == "raised":
            continue
        if (a is None) != (b is None):
            diffs.append(f"{la}: one-call {'None' if a is None else 'a tensor'}, general "
                         f"{'None' if b is None else 'a tensor'}")
        elif a is not None and not same_bits(a, b):
            diffs.append(f"{la} differs")
    return diffs


SAMPLE = configs(1, 60)


@pytest.mark.parametrize("i", range(len(SAMPLE)))
def test_one_call_equals_the_general_path(i):
    """A drawn configuration's results, with and without the one-call
    steps: the same bits, or the same exception type at the same step."""
    c = SAMPLE[i]
    diffs = differences(run(c, True), run(c, False))
    assert not diffs, f"{c}: {diffs}"


def test_the_sample_runs_the_one_call_steps(monkeypatch):
    """The sample exercises what it compares: the one-call forward runs in
    most of its configurations, the one-call backward in a quarter at least,
    and none raises."""
    calls = collections.Counter()
    real_fwd, real_bwd = _fp8_gemm.fprop_one_call, _fp8_gemm.linear_bwd_one_call
    monkeypatch.setattr(_fp8_gemm, "fprop_one_call", lambda *a: calls.update(["f"]) or real_fwd(*a))
    monkeypatch.setattr(_fp8_gemm, "linear_bwd_one_call",
                        lambda *a: (lambda r: calls.update(["b"] if r is not None else []) or r)(real_bwd(*a)))
    fwd = bwd = 0
    for c in SAMPLE:
        calls.clear()
        res = run(c, True)
        assert res[-1][0] != "raised", (c, res[-1])
        fwd, bwd = fwd + (calls["f"] > 0), bwd + (calls["b"] > 0)
    assert fwd >= len(SAMPLE) * 3 // 4 and bwd >= len(SAMPLE) // 4, (fwd, bwd)
