"""te.autocast entered inside a function torch.compile traces (the FP8
autocast of Hugging Face Accelerate's autowrap around a compiled model): on
torch 2.13 and newer, compiled steps equal eager ones with their scaling
state; before 2.13 the autocast is refused while compiling, naming the way
out. The helpers are test_compile.py's."""
import pytest
import torch
import torch._dynamo

import transformer_engine_c as tec
from transformer_engine_c import quantization
from transformer_engine_c.quantization import FP8GlobalStateManager
from test_compile import DEV, _breaks, _fp8_steps, _fresh_dynamo, _same  # noqa: F401  (_fresh_dynamo: the autouse fixture)


AUTOCAST_INSIDE_TRACES = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def _refused_before_2_13(run):
    """run() compiles a function that enters the FP8 autocast itself: on
    torch before 2.13 refused while compiling, naming the torch it needs
    and the way out, with no autocast left entered."""
    with pytest.raises(Exception, match=r"inside a function torch.compile traces needs torch 2\.13 or newer \(this "
                                        r"is torch 2\.\d+.*enter the autocast around the call of the compiled"):
        run()
    assert not FP8GlobalStateManager.FP8_ENABLED and FP8GlobalStateManager.AUTOCAST_DEPTH == 0
    assert not quantization._in_graph
    torch._dynamo.reset()


def _fp8_inside_steps(m, recipe, xs, compile_with=None):
    """Steps of a function that enters the FP8 autocast itself and calls m
    (compiled with fullgraph and `compile_with`'s backend where given): as
    _fp8_steps, plus the autocast state after every step."""
    def step(x):
        with tec.autocast(enabled=True, recipe=recipe):
            return m(x)
    f = step if compile_with is None else torch.compile(step, fullgraph=True, backend=compile_with)

    def forward(x):
        y = f(x)
        assert not FP8GlobalStateManager.FP8_ENABLED and FP8GlobalStateManager.AUTOCAST_DEPTH == 0
        return y
    return _fp8_steps(m, recipe, xs, forward)


@pytest.mark.parametrize("recipe,backend", [("DelayedScaling", "inductor"), ("Float8CurrentScaling", "aot_eager"),
                                            ("Float8BlockScaling", "aot_eager")])
def test_fp8_autocast_inside_the_compiled_function_matches_eager(recipe, backend):
    """The FP8 autocast entered inside the traced function (Accelerate's FP8
    autowrap of a compiled model): N compiled steps leave the outputs,
    gradients and the recipe's state (scales, amax histories) of N eager
    steps, bit for bit, and the autocast state outside as it was; the same
    shapes do not compile again. Refused before torch 2.13."""
    def build():
        torch.manual_seed(15)
        return torch.nn.Sequential(tec.LayerNormLinear(64, 128, device=DEV), tec.Linear(128, 64, device=DEV))
    torch.manual_seed(16)
    xs = [torch.randn(32, 64, device=DEV) for _ in range(3)]
    make = getattr(tec.recipe, recipe)
    if not AUTOCAST_INSIDE_TRACES:
        return _refused_before_2_13(lambda: _fp8_inside_steps(build(), make(), xs, compile_with=backend))
    out_e, state_e = _fp8_inside_steps(build(), make(), xs)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out_c, state_c = _fp8_inside_steps(build(), make(), xs, compile_with=backend)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
    assert _breaks() == 0
    _same(out_e, out_c)
    _same(state_e, state_c)
    if recipe == "DelayedScaling":
        assert len(state_e) == 2 * 2 * 3


def test_fp8_autocast_inside_with_its_recipe_made_there():
    """The recipe made inside the traced function, or left to the default:
    a compiled step computes as an eager one, and leaves the same
    delayed-scaling state. Refused before torch 2.13."""
    def build():
        torch.manual_seed(17)
        return tec.Linear(32, 32, device=DEV)
    x = torch.randn(16, 32, device=DEV)

    def made_inside(m, x):
        with tec.fp8_autocast(enabled=True, fp8_recipe=tec.recipe.DelayedScaling(margin=1)):
            return m(x)

    def default(m, x):
        with tec.fp8_autocast(enabled=True):
            return m(x)
    for f in (made_inside, default):
        m_e, m_c = build(), build()
        if not AUTOCAST_INSIDE_TRACES:
            _refused_before_2_13(lambda: torch.compile(f, fullgraph=True, backend="aot_eager")(m_c, x))
            continue
        ref = f(m_e, x)
        FP8GlobalStateManager.reset()  # the compiled step's exit updates m_c alone
        _same(torch.compile(f, fullgraph=True, backend="aot_eager")(m_c, x), ref)
        FP8GlobalStateManager.reset()
        _same([m_c.fp8_meta["scaling_fwd"].scale, m_c.fp8_meta["scaling_fwd"].amax_history],
              [m_e.fp8_meta["scaling_fwd"].scale, m_e.fp8_meta["scaling_fwd"].amax_history])
    assert not FP8GlobalStateManager.FP8_ENABLED


def test_fp8_autocast_inside_refuses_what_cannot_cross():
    """A recipe field that is not a plain value (a callable amax algorithm)
    and an amax reduction group cannot cross into the compiled code: each
    raises naming the way out; a failure in a layer inside leaves no
    autocast entered. Before torch 2.13 each is refused for the torch."""
    m = tec.Linear(32, 32, device=DEV)
    algo = tec.recipe.DelayedScaling(amax_compute_algo=lambda h: h.max(0).values)
    for kw, match in ((dict(recipe=algo), "by value"), (dict(amax_reduction_group=object()), "amax_reduction_group")):
        def f(x):
            with tec.autocast(enabled=True, **kw):
                return m(x)

        def run():
            torch.compile(f, fullgraph=True, backend="aot_eager")(torch.randn(16, 32, device=DEV))
        if not AUTOCAST_INSIDE_TRACES:
            _refused_before_2_13(run)
            continue
        with pytest.raises(Exception, match=f"{match}.*around the call"):
            run()
        torch._dynamo.reset()
    recipe = tec.recipe.DelayedScaling()

    def g(x):
        with tec.autocast(enabled=True, recipe=recipe):
            return m(x)
    if not AUTOCAST_INSIDE_TRACES:
        return _refused_before_2_13(lambda: torch.compile(g, fullgraph=True, backend="aot_eager")(
            torch.randn(15, 32, device=DEV)))
    with pytest.raises(ValueError, match="divisible"):  # FP8's shape rule, checked when the layer runs
        torch.compile(g, fullgraph=True, backend="aot_eager")(torch.randn(15, 32, device=DEV))
    assert not FP8GlobalStateManager.FP8_ENABLED and FP8GlobalStateManager.AUTOCAST_DEPTH == 0
    assert not quantization._in_graph
