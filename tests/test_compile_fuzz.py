"""The layers compiled (torch.compile, fullgraph=True) against the same
layers called eagerly, over randomly drawn configurations: the layer
(Linear, LayerNormLinear, LayerNormMLP, GroupedLinear, LayerNorm / RMSNorm,
DotProductAttention, TransformerLayer, stacks) and its options, the dtype,
2-D and 3-D inputs, token counts that change between calls (recompiles and
dynamic shapes), the grad modes, fused and delayed weight gradients with
is_first_microbatch sequences, frozen parameters, inputs without grad,
tec.checkpoint and torch's checkpoint inside the compiled function, and
the FP8 recipes (delayed and current scaling) entered around the compiled
call over several steps. Each configuration runs twice from the same seed,
eagerly and compiled; every output, gradient, main_grad and FP8 state
(scale, scale_inv, amax history) after every step must be the same bit for
bit (as tests/test_compile.py asserts: the same engine runs both), except
where Inductor compiles torch's own ops of a layer (GroupedLinear's bias
gradient, attention's softmax, a block's residuals): there to rounding.
Where one run raises the other must raise the same type at the same step.
A fixed sample of configurations runs here (aot_eager mostly, which
traces, functionalises and differentiates the operators as Inductor does);
`configs` draws more for a longer search (`python tests/test_compile_fuzz.py
SEED N`)."""
import contextlib
import random
import sys

import pytest
import torch
import torch._dynamo

import transformer_engine_c as te
from helpers import Stack, one_thread
from transformer_engine_c.attention.rope import RotaryPositionEmbedding
from transformer_engine_c.recipe import DelayedScaling, Float8CurrentScaling, Format

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LINEAR_KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP")
KINDS = LINEAR_KINDS * 3 + ("GroupedLinear", "LayerNorm", "RMSNorm", "DotProductAttention", "TransformerLayer",
                            "Stack", "Stack")
ACTIVATIONS = ("gelu", "relu", "qgelu", "srelu", "silu", "geglu", "reglu", "swiglu", "glu")
# Inductor compiles these layers' own torch ops (a sum, a softmax, residual adds): equal to rounding there
INDUCTOR_ROUNDING = ("GroupedLinear", "DotProductAttention", "TransformerLayer")


def random_config(rng, backend=None):
    """One configuration (plain data, printable as a reproducer's argument)."""
    kind = rng.choice(KINDS)
    c = dict(kind=kind, backend=backend or rng.choice(["aot_eager"] * 4 + ["inductor"]),
             dynamic=rng.choice([None, None, False, True]), dtype=rng.choice(["fp32", "fp32", "bf16"]),
             seed=rng.randrange(1000), hidden=rng.choice([16, 32, 48]), out=rng.choice([16, 32]),
             ffn=rng.choice([16, 32]), bias=rng.random() < 0.7, return_bias=rng.random() < 0.2)
    c["wgrad"] = rng.choice(["plain"] * 5 + ["fused", "delayed", "frozen"])
    c["wrap"] = rng.choice([None] * 6 + ["tec_reentrant", "tec_nonreentrant", "torch"])
    if kind in ("LayerNormLinear", "LayerNormMLP"):
        c.update(norm=rng.choice(["LayerNorm", "RMSNorm"]), zcg=rng.random() < 0.3, ret_ln=rng.random() < 0.2)
    if kind == "LayerNormMLP":
        c.update(act=rng.choice(ACTIVATIONS), mlp_ckpt=rng.random() < 0.2)
    if kind == "Linear":  # (parameters_split with fuse_wgrad_accumulation: refused compiled, by design)
        c.update(split=c["out"] == 32 and c["wgrad"] != "fused" and rng.random() < 0.2,
                 save_original_input=rng.random() < 0.2)
    if kind in LINEAR_KINDS:
        c["parallel"] = rng.choice([None, None, None, "column", "row"])
        c["sp"] = c["parallel"] is not None and rng.random() < 0.5
    c["frozen_norm"] = rng.random() < 0.1
    c["mcore"] = c["wgrad"] == "fused" and rng.random() < 0.5  # Megatron's grad_added_to_main_grad on the weights
    if kind in ("LayerNorm", "RMSNorm"):
        c["zcg"] = rng.random() < 0.4
    if kind == "GroupedLinear":
        c.update(groups=rng.choice([1, 2, 3]), wgrad=rng.choice(["plain"] * 3 + ["delayed", "frozen"]),
                 save_original_input=rng.random() < 0.2)
    if kind == "DotProductAttention":
        c.update(heads=rng.choice([1, 2, 4]), mask=rng.choice(["causal", "no_mask"]), wgrad="plain")
    if kind == "TransformerLayer":
        c.update(hidden=32, heads=rng.choice([2, 4]), norm=rng.choice(["LayerNorm", "RMSNorm"]),
                 act=rng.choice(["gelu", "swiglu"]), layer_type=rng.choice(["encoder", "encoder", "decoder"]),
                 fuse_qkv=rng.random() < 0.3, zcg=rng.random() < 0.2, return_bias=False, rope=rng.random() < 0.5,
                 wgrad=rng.choice(["plain", "plain", "fused", "frozen"]), wrap=rng.choice([None, None, "torch"]))
    if kind == "Stack":
        c["layers"] = [rng.choice(("Linear", "LayerNormLinear", "LayerNormMLP", "LayerNorm")) for _ in range(
            rng.choice([2, 3]))]
        c["return_bias"] = False
    # FP8 around the compiled call: the linear layers (alone, stacked, in a TransformerLayer), dims multiples of 16
    fp8_ok = kind in LINEAR_KINDS + ("TransformerLayer",) or kind == "Stack" and "LayerNorm" not in c["layers"]
    c["recipe"] = c["recipe2"] = None
    if fp8_ok and rng.random() < 0.35:
        c["recipe"] = _random_recipe(rng)
        if rng.random() < 0.2:  # the recipe changes between steps (another object, other parameters)
            c["recipe2"] = _random_recipe(rng)
    if c["recipe"] and c["wrap"] == "torch":  # torch's checkpoint recomputes an FP8 call outside FP8 (refused)
        c["wrap"] = "tec_nonreentrant"
    leads = [(16,), (32,), (8, 2), (4, 4), (0,)] if c["recipe"] else [(16,), (12,), (5,), (4, 3), (2, 5), (1,), (0,),
                                                                       (0, 3)]
    if kind in ("DotProductAttention", "TransformerLayer"):
        leads = [(8, 2), (4, 2), (16, 1)] if c["recipe"] else [(8, 2), (4, 2), (6, 1), (5, 3)]
    lead = rng.choice(leads)
    pattern = rng.choice(["none", "mb", "random"])
    steps = []
    for i in range(rng.choice([2, 3, 3, 4])):
        first_mb = None if pattern == "none" else (i % 2 == 0) if pattern == "mb" else rng.choice([None, True, False])
        mode = rng.choice(["train"] * 6 + ["nograd", "inference", "fwd_only", "x_const"])
        if c["wgrad"] == "delayed" and mode == "fwd_only":
            mode = "train"
        if c["wrap"] == "tec_reentrant" and mode == "x_const":
            # eagerly torch's reentrant checkpoint of inputs without grad gives no parameter gradients (it warns);
            # traced, tec.checkpoint is the non-reentrant one, which gives them
            mode = "train"
        if c["wrap"] and c["recipe"] and mode == "fwd_only":
            # eagerly an FP8 checkpointed forward whose backward never runs leaves its stashed scales for the
            # next recomputation (TE's rule, docs/fp8.md); compiled, nothing is stashed
            mode = "train"
        if c["wrap"] and kind == "DotProductAttention" and mode == "x_const":
            # torch's compiler refuses a checkpointed SDPA in a graph without gradients (an RNG op it will not
            # recompute), with or without this package
            mode = "train"
        steps.append(dict(mode=mode, first_mb=first_mb, lead=lead if rng.random() < 0.7 else rng.choice(leads),
                          in32=c["dtype"] == "bf16" and rng.random() < 0.2, strided=rng.random() < 0.1,
                          fp8=c["recipe"] is not None and rng.random() < 0.9))
    if kind == "DotProductAttention" and c["backend"] == "inductor":
        for s in steps:  # torch's Inductor fails on SDPA of some strided views (a meta shape check), without us
            s["strided"] = False
    if kind == "GroupedLinear":
        for s in steps:
            rows = 1
            for d in s["lead"]:
                rows *= d
            cuts = sorted(rng.randint(0, rows) for _ in range(c["groups"] - 1))
            s["splits"] = [b - a for a, b in zip([0] + cuts, cuts + [rows])]
    c["steps"] = steps
    # the layer called twice in one function (a second micro-batch in the same graph)
    c["twice"] = not c["return_bias"] and not c.get("ret_ln") and kind != "GroupedLinear" and rng.random() < 0.15
    if c["wrap"] == "tec_reentrant" and c["recipe"]:
        # eagerly FP8 weight casts cached by is_first_microbatch under torch's reentrant checkpoint are not
        # those of a plain call (left for another look; compiled, they are the plain call's)
        for s in steps:
            s["first_mb"] = None
    if c["twice"] and c["wrap"] and c["recipe"]:
        # eagerly the second call's recomputation (first in backward) pops the first call's FP8 stash (first in,
        # first out, as TE's), which owns the backward amax reduction: not the non-checkpointed result
        c["twice"] = False
    if c["twice"] and c["wrap"] and c["dynamic"]:
        # torch's compiler fails on two checkpoints of a LayerNorm with dynamic=True (an AssertionError of its own)
        c["dynamic"] = None
    return c


def _random_recipe(rng):
    return rng.choice([dict(kind="delayed", fmt=rng.choice(["HYBRID", "E4M3"]), hist=rng.choice([1, 4]),
                            algo=rng.choice(["max", "most_recent"]), margin=rng.choice([0, 0, 1])),
                       dict(kind="current", fmt=rng.choice(["HYBRID", "E4M3"]))])


def configs(seed, n, backend=None):
    rng = random.Random(seed)
    return [random_config(rng, backend) for _ in range(n)]


def make_recipe(spec):
    fmt = Format[spec["fmt"]]
    if spec["kind"] == "delayed":
        return DelayedScaling(fp8_format=fmt, amax_history_len=spec["hist"], amax_compute_algo=spec["algo"],
                              margin=spec.get("margin", 0))
    return Float8CurrentScaling(fp8_format=fmt)


class Attention(torch.nn.Module):
    """DotProductAttention of q, k, v cut from one [s, b, 3 * heads * 16] input."""

    def __init__(self, heads, mask):
        super().__init__()
        self.heads = heads
        self.attn = te.DotProductAttention(heads, 16, attn_mask_type=mask)

    def forward(self, x, is_first_microbatch=None):
        s, b, _ = x.shape
        q, k, v = x.view(s, b, 3, self.heads, 16).unbind(2)
        return self.attn(q, k, v)


class Grouped(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, m_splits, is_first_microbatch=None):
        return self.layer(x, m_splits, is_first_microbatch=is_first_microbatch)


def _linear(kind, c, hidden, out, dtype, **kw):
    kw.update(params_dtype=dtype, device="cpu", bias=c["bias"], fuse_wgrad_accumulation=c["wgrad"] == "fused",
              delay_wgrad_compute=c["wgrad"] == "delayed")
    par = c.get("parallel")
    kw["sequence_parallel"] = c.get("sp", False)
    if kind == "Linear":
        split = {"a": 16, "b": out - 16} if c.get("split") else None
        return te.Linear(hidden, out, parallel_mode=par, parameters_split=split,
                         save_original_input=c.get("save_original_input", False), **kw)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(hidden, out, parallel_mode=par, normalization=c.get("norm", "LayerNorm"),
                                  zero_centered_gamma=c.get("zcg", False), **kw)
    return te.LayerNormMLP(hidden, c["ffn"], set_parallel_mode=par is not None,
                           normalization=c.get("norm", "LayerNorm"), zero_centered_gamma=c.get("zcg", False),
                           activation=c.get("act", "gelu"), checkpoint=c.get("mlp_ckpt", False), **kw)


def build(c):
    dtype = DTYPES[c["dtype"]]
    torch.manual_seed(c["seed"])
    kind = c["kind"]
    if kind in LINEAR_KINDS:
        extra = dict(return_bias=c["return_bias"])
        if kind != "Linear":
            extra["return_layernorm_output"] = c["ret_ln"]
        m = _linear(kind, c, c["hidden"], c["out"], dtype, **extra)
    elif kind == "GroupedLinear":
        m = Grouped(te.GroupedLinear(c["groups"], c["hidden"], c["out"], bias=c["bias"], return_bias=c["return_bias"],
                                     params_dtype=dtype, device="cpu", delay_wgrad_compute=c["wgrad"] == "delayed",
                                     save_original_input=c["save_original_input"]))
    elif kind in ("LayerNorm", "RMSNorm"):
        m = getattr(te, kind)(c["hidden"], zero_centered_gamma=c["zcg"], params_dtype=dtype, device="cpu")
    elif kind == "DotProductAttention":
        m = Attention(c["heads"], c["mask"])
    elif kind == "TransformerLayer":
        m = te.TransformerLayer(32, 64, c["heads"], hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
                                device="cpu", normalization=c["norm"], activation=c["act"], layer_type=c["layer_type"],
                                fuse_qkv_params=c["fuse_qkv"], zero_centered_gamma=c["zcg"], bias=c["bias"],
                                fuse_wgrad_accumulation=c["wgrad"] == "fused")
    else:
        layers, hidden = [], c["hidden"]
        for k in c["layers"]:
            if k == "LayerNorm":
                layers.append(te.LayerNorm(hidden, params_dtype=dtype, device="cpu"))
            else:
                out = hidden if k == "LayerNormMLP" else c["out"]
                layers.append(_linear(k, c, hidden, out, dtype))
                hidden = out
        m = Stack(layers)
    gen = torch.Generator().manual_seed(c["seed"])
    with torch.no_grad():  # biases and norm parameters away from their zero / one initial values
        for p in m.parameters():
            if p.dim() == 1:
                p.add_((0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype))
    for p in m.parameters():
        if p.dim() == 2 and c["wgrad"] == "fused":
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            if c.get("mcore"):
                p.grad_added_to_main_grad = False
        if p.dim() == 2 and c["wgrad"] == "frozen" or p.dim() == 1 and c.get("frozen_norm"):
            p.requires_grad_(False)
    return m


def _in_features(c):
    if c["kind"] == "DotProductAttention":
        return 3 * c["heads"] * 16
    return c["hidden"]


def _layers(m):
    return [mod for mod in m.modules() if getattr(mod, "delay_wgrad_compute", False)]


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


def make_fn(m, c):
    """The function both runs call: the layer, under the drawn checkpoint."""
    wrap = c["wrap"]

    def fn(x, first_mb, extra):
        args = (x,) + extra
        kw = {} if c["kind"] in ("LayerNorm", "RMSNorm") else {"is_first_microbatch": first_mb}
        if c["kind"] == "TransformerLayer" and c["layer_type"] == "decoder":
            kw["encoder_output"] = x.detach() * 0.5
        if c["kind"] == "TransformerLayer" and c["rope"]:
            kw["rotary_pos_emb"] = RotaryPositionEmbedding(32 // c["heads"])(x.shape[0])
        if c.get("twice"):
            return call(m, wrap, args, kw) + call(m, wrap, (args[0] * 0.5,) + args[1:], kw)
        return call(m, wrap, args, kw)
    return fn


def call(m, wrap, args, kw):
    """m(*args, **kw) under the drawn checkpoint."""
    if wrap is None:
        return m(*args, **kw)
    if wrap == "torch":
        return torch.utils.checkpoint.checkpoint(m, *args, use_reentrant=False, **kw)
    return te.checkpoint(m, *args, use_reentrant=wrap == "tec_reentrant", **kw)


def _snap(t):
    return None if t is None else t.detach().clone()


def run(c, compiled):
    """The configuration's steps, eagerly or compiled: [(label, tensor or
    None)], ending with ("raised", type name, message) where a step raised."""
    res = []
    try:
        m = build(c)
        fn = make_fn(m, c)
        if compiled:
            fn = torch.compile(fn, fullgraph=True, backend=c["backend"], dynamic=c["dynamic"])
        gen = torch.Generator().manual_seed(c["seed"] + 1)
        dtype = DTYPES[c["dtype"]]
        for i, s in enumerate(c["steps"]):
            m.zero_grad(set_to_none=True)
            mode = s["mode"]
            x = torch.randn(*s["lead"], _in_features(c) * (2 if s.get("strided") else 1), generator=gen)
            if s.get("strided"):
                x = x[..., ::2]
            x = x.to(torch.float32 if s.get("in32") else dtype)
            if mode in ("train", "fwd_only"):
                x.requires_grad_()
            extra = (s["splits"],) if c["kind"] == "GroupedLinear" else ()
            grad_ctx = torch.no_grad() if mode == "nograd" else \
                torch.inference_mode() if mode == "inference" else contextlib.nullcontext()
            spec = c["recipe2"] if c.get("recipe2") and 2 * i >= len(c["steps"]) else c["recipe"]
            fp8 = te.autocast(enabled=True, recipe=make_recipe(spec)) if s["fp8"] else \
                contextlib.nullcontext()
            # a float32 input under torch.autocast: cast to the bf16 layer's compute dtype
            amp = torch.autocast("cpu", dtype=torch.bfloat16) if s.get("in32") else contextlib.nullcontext()
            with grad_ctx, amp, fp8:
                outs = _flat(fn(x, s["first_mb"], extra))
            # whether each output needs grad is compared too, but under tec.checkpoint(use_reentrant=True):
            # eagerly torch's reentrant checkpoint makes every output differentiable (a frozen bias too)
            rg = c["wrap"] != "tec_reentrant"
            res += [(f"step{i} out{k}" + (f" requires_grad={o.requires_grad}" if rg else ""), _snap(o))
                    for k, o in enumerate(outs)]
            if mode in ("train", "x_const"):
                loss = 0
                for o in outs:
                    dy = torch.randn(o.shape, generator=gen)
                    if o.requires_grad:
                        loss = loss + (o.float() * dy).sum()
                if isinstance(loss, torch.Tensor):
                    loss.backward()
                    for layer in _layers(m):
                        for _ in range(2 if c.get("twice") else 1):
                            layer.backward_dw()
                res.append((f"step{i} x.grad", _snap(x.grad)))
                # a weight with Megatron's grad_added_to_main_grad gets TE's dummy gradient (torch.empty): its
                # shape and dtype are compared, and the flag
                res += [(f"step{i} {n}.grad", _snap(p.grad) if not hasattr(p, "grad_added_to_main_grad") else
                         None if p.grad is None else p.grad.new_zeros(p.grad.shape))
                        for n, p in m.named_parameters()]
                res += [(f"step{i} {n}.grad_added_to_main_grad={p.grad_added_to_main_grad}", None)
                        for n, p in m.named_parameters() if hasattr(p, "grad_added_to_main_grad")]
                res += [(f"step{i} {n}.main_grad", _snap(p.main_grad)) for n, p in m.named_parameters()
                        if hasattr(p, "main_grad")]
            for j, layer in enumerate(m.modules()):
                meta = getattr(layer, "fp8_meta", None) or {}
                for key in ("scaling_fwd", "scaling_bwd"):
                    if meta.get(key) is not None:
                        res += [(f"step{i} module{j} {key}.{a}", _snap(getattr(meta[key], a)))
                                for a in ("scale", "scale_inv", "amax_history")]
    except Exception as e:  # noqa: BLE001  (compared with the other run's)
        res.append(("raised", _root(e), str(e)[:2000]))
    return res


def _root(e):
    """The exception's type name; for one raised while the compiler traced,
    the user code's exception it wraps (where torch kept it)."""
    seen = e
    while type(seen).__module__.startswith("torch._dynamo") or type(seen).__name__ in (
            "BackendCompilerFailed", "TorchRuntimeError", "InternalTorchDynamoError"):
        inner = seen.__cause__ or getattr(seen, "inner_exception", None)
        if inner is None:
            break
        seen = inner
    name = type(seen).__name__
    # torch before 2.13 reports a user exception raised while tracing as Observed<its type>, without it
    return name[len("Observed"):] if name.startswith("Observed") and name != "ObservedException" else name


def same_bits(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True


def close(a, b, fp8, bf16):
    """Equal to rounding; under FP8 (where a rounding difference can move a
    value to the next FP8 step, and a small gradient summed from them can
    cancel) by the whole tensor's relative error, loosely."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    tol = 2e-2 if bf16 else 1e-5  # the compute dtype's (an fp32 main_grad sums bf16 gradients)
    a, b = a.float(), b.float()
    if torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True):
        return True
    return fp8 and bool((a - b).norm() <= 0.2 * a.norm() + 1e-6)


def differences(c, eager, comp):
    """What differs between the eager and the compiled run (empty: nothing)."""
    diffs = []
    re_ = eager[-1][1] if eager and eager[-1][0] == "raised" else None
    rc = comp[-1][1] if comp and comp[-1][0] == "raised" else None
    if re_ or rc:
        if re_ != rc or len(eager) != len(comp):
            return [f"raised: eager {eager[-1][1:] if re_ else None}, compiled {comp[-1][1:] if rc else None} "
                    f"after {len(eager)} / {len(comp)} results"]
    if len(eager) != len(comp):
        return [f"{len(eager)} results against {len(comp)}"]
    rounding = c["backend"] == "inductor" and c["kind"] in INDUCTOR_ROUNDING
    for (la, a), (lb, b) in zip((r[:2] for r in eager), (r[:2] for r in comp)):
        if la != lb:
            return diffs + [f"result {la} against {lb}"]
        if la == "raised":
            continue
        if (a is None) != (b is None):
            diffs.append(f"{la}: eager {'None' if a is None else 'a tensor'}, compiled "
                         f"{'None' if b is None else 'a tensor'}")
        elif a is not None and not (close(a, b, c["recipe"] is not None, c["dtype"] == "bf16") if rounding else same_bits(a, b)):
            err = (a.float() - b.float()).abs().max().item() if a.shape == b.shape and a.numel() else None
            diffs.append(f"{la} differs ({tuple(a.shape)} {a.dtype} / {tuple(b.shape)} {b.dtype}, max {err})")
    return diffs


def compare(c):
    torch._dynamo.reset()
    eager = run(c, False)
    torch._dynamo.reset()
    comp = run(c, True)
    torch._dynamo.reset()
    return differences(c, eager, comp), eager, comp


SAMPLE = configs(6, 26, "aot_eager") + configs(60, 3, "inductor")


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.mark.parametrize("i", range(len(SAMPLE)))
def test_compiled_equals_eager(i):
    """A drawn configuration's results, eagerly and compiled: the same bits
    (to rounding where Inductor compiles a layer's torch ops), or the same
    exception type at the same step."""
    c = SAMPLE[i]
    diffs, _, _ = compare(c)
    assert not diffs, f"{c}: {diffs}"



def test_the_sample_covers_the_layers_and_options():
    """The fixed sample draws what it is meant to compare: every kind of
    layer, FP8 under both recipes, the checkpoints, the weight-gradient
    policies, a token count that changes between steps, each grad mode."""
    kinds = {c["kind"] for c in SAMPLE}
    assert kinds >= set(KINDS), set(KINDS) - kinds
    fp8 = [c for c in SAMPLE if c["recipe"]]
    assert {c["recipe"]["kind"] for c in fp8} == {"delayed", "current"} and len(fp8) >= 6
    assert any(c["recipe2"] for c in fp8) and any(c["wrap"] for c in fp8)
    assert {c["wrap"] for c in SAMPLE} >= {"tec_reentrant", "tec_nonreentrant", "torch"}
    assert {c["wgrad"] for c in SAMPLE} >= {"fused", "delayed", "frozen"}
    assert any(c.get("sp") for c in SAMPLE) and {c["backend"] for c in SAMPLE} == {"aot_eager", "inductor"}
    assert any(c["mcore"] for c in SAMPLE) and any(c["twice"] for c in SAMPLE)
    assert any(c["kind"] == "TransformerLayer" and c["recipe"] for c in SAMPLE)
    assert any(len({s["lead"] for s in c["steps"]}) > 1 for c in SAMPLE)
    steps = [s for c in SAMPLE for s in c["steps"]]
    assert {s["mode"] for s in steps} == {"train", "nograd", "inference", "fwd_only", "x_const"}
    assert any(s["strided"] for s in steps) and any(s["in32"] for s in steps) and any(0 in s["lead"] for s in steps)


_PLAIN = dict(kind="LayerNormMLP", backend="aot_eager", dynamic=None, dtype="fp32", seed=5, hidden=32, out=32, ffn=32,
              bias=True, return_bias=False, wgrad="fused", wrap=None, norm="LayerNorm", zcg=False, ret_ln=False,
              act="gelu", mlp_ckpt=False, parallel=None, recipe=dict(kind="delayed", fmt="HYBRID", hist=4, algo="max"),
              steps=[dict(mode="train", first_mb=True, lead=(16,), fp8=True),
                     dict(mode="train", first_mb=False, lead=(8, 2), fp8=True)])


def test_the_checker_catches_a_planted_fault(monkeypatch):
    """Negative tests of the comparison: the compiled path's operator with
    one gradient off by one ulp, then with its FP8 scale history left one
    step behind, then raising another type: each is reported; unplanted,
    the same configuration is clean."""
    from transformer_engine_c.module import _opcall

    assert not compare(_PLAIN)[0]
    real = _opcall._present

    def off_by_one_ulp(*args):
        out = real(*args)
        g = out[0]
        if g is not None:
            out[0] = torch.nextafter(g, torch.full_like(g, float("inf")))
        return out
    monkeypatch.setattr(_opcall, "_present", off_by_one_ulp)
    diffs = compare(_PLAIN)[0]
    assert diffs and all("differs" in d for d in diffs) and any("x.grad" in d for d in diffs), diffs
    monkeypatch.setattr(_opcall, "_present", real)

    real_fwd = _opcall._forward

    def stale_history(layer, args, first_mb, grad, fp8):
        meta = (getattr(layer, "fp8_meta", None) or {}).get("scaling_fwd")
        history = None if meta is None else meta.amax_history.clone()
        out = real_fwd(layer, args, first_mb, grad, fp8)
        if history is not None:
            meta.amax_history.copy_(history)
        return out
    monkeypatch.setattr(_opcall, "_forward", stale_history)
    diffs = compare(_PLAIN)[0]
    assert any("scaling_fwd.amax_history differs" in d for d in diffs), diffs
    monkeypatch.setattr(_opcall, "_forward", real_fwd)

    def raises(*a):
        raise TypeError("planted")
    monkeypatch.setattr(_opcall, "_backward", raises)
    diffs = compare(_PLAIN)[0]
    assert len(diffs) == 1 and diffs[0].startswith("raised: eager None, compiled ('TypeError'"), diffs


if __name__ == "__main__":  # a longer search: python tests/test_compile_fuzz.py SEED N [BACKEND]
    torch.set_num_threads(1)
    seed, n = int(sys.argv[1]), int(sys.argv[2])
    for k, c in enumerate(configs(seed, n, sys.argv[3] if len(sys.argv) > 3 else None)):
        diffs, eager, comp = compare(c)
        raised = eager[-1][1] if eager and eager[-1][0] == "raised" else ""
        print(f"{seed}:{k} {c['backend']} {c['kind']} {'DIFF ' + repr(diffs[:4]) if diffs else 'ok'} {raised}",
              flush=True)
        if diffs:
            print("   ", c, flush=True)
