"""What the compiled path's operators keep between calls (module/_opcall.py's
OpState, _library's resolved keys) is never served stale: a changed plan
attribute, OpSpec, input shape or dtype gives the same results as the eager
layer, bit for bit, and a deleted layer's key stops resolving."""
import gc

import pytest
import torch

import transformer_engine_c as tec
from transformer_engine_c import _library
from transformer_engine_c.module import _opcall

from test_compile import DEV, _breaks, _fresh_dynamo, _run, _same  # noqa: F401  (_fresh_dynamo: the autouse fixture)


def _compiled_matches_eager(m, compiled, x):
    g = torch.randn(x.shape[:-1] + (m.hidden_size,), dtype=x.dtype, device=x.device)
    _same(_run(m, x, g), _run(compiled, x, g))
    assert _breaks() == 0


def test_a_changed_attribute_shape_or_dtype_is_not_served_stale():
    """One compiled LayerNormMLP through a shape change, an attribute that
    changes what its backward keeps (checkpoint: the inputs instead of the
    forward's intermediate tensors) and a dtype change: each call equals the
    eager layer's, and the operator's state was made again for the new plan."""
    torch.manual_seed(0)
    m = tec.LayerNormMLP(32, 64, device=DEV)
    compiled = torch.compile(m, fullgraph=True)
    _compiled_matches_eager(m, compiled, torch.randn(8, 32, device=DEV))
    first = m.__dict__["_op_state"]
    assert len(first.new_at) == 4  # normalised rows, statistics, fc1's and the activation's outputs
    _compiled_matches_eager(m, compiled, torch.randn(12, 32, device=DEV))
    assert m.__dict__["_op_state"] is first  # the same plan: its state kept across shapes
    m.checkpoint = True
    _compiled_matches_eager(m, compiled, torch.randn(12, 32, device=DEV))
    assert m.__dict__["_op_state"] is not first and not m.__dict__["_op_state"].new_at
    m.to(torch.bfloat16)
    _compiled_matches_eager(m, compiled, torch.randn(12, 32, device=DEV, dtype=torch.bfloat16))


def test_the_backward_does_not_take_a_forward_call_of_another_dtype():
    """The Call a backward takes from its layer's last forward is that
    forward's only where the input's memory, shape and dtype agree."""
    m = tec.Linear(32, 16, device=DEV)
    x = torch.randn(8, 32, device=DEV)
    args = [x, m.weight, m.bias]
    with torch.no_grad():
        m._op_forward(args, -1, True, False)
        kept = m.__dict__["_op_state"].last
        assert kept[0] == _opcall._call_key(x, -1)
        assert kept[0] != _opcall._call_key(x.to(torch.bfloat16), -1)
        assert kept[0] != _opcall._call_key(x[:4], -1)
        assert kept[0] != _opcall._call_key(x, 1)


def test_a_new_op_spec_checks_again():
    """Negative test: the once-per-shape check of what the Function saved is
    kept per OpSpec; a different declaration for the same layer and shape is
    checked again (and this wrong one raises)."""
    m = tec.LayerNormLinear(32, 32, device=DEV)
    args = [torch.randn(8, 32, device=DEV), m.layer_norm_weight, m.layer_norm_bias, m.weight, m.bias]
    with torch.no_grad():
        m._op_forward(args, -1, True, False)
        spec = m._op_spec
        m._op_spec = _opcall.OpSpec(spec.fn, weights=spec.weights, biases=spec.biases, call=spec.call,
                                    nograd=spec.nograd, saved=spec.saved, ctx=spec.ctx,
                                    new_shapes=lambda layer, a: tuple((s, torch.float64)
                                                                      for s, _ in spec.new_shapes(layer, a)))
        with pytest.raises(RuntimeError, match="LayerNormLinear.*declared"):
            m._op_forward(args, -1, True, False)


def test_a_deleted_layers_key_stops_resolving():
    """Negative test of the resolved-key table: a key that resolved while its
    layer lived raises once the layer is gone."""
    m = tec.Linear(16, 16, device=DEV)
    key = f"{m._op_key}|{m._op_signature()}"
    assert _library._layer(key) is m
    assert key in _library._RESOLVED
    del m
    gc.collect()
    assert key not in _library._RESOLVED
    with pytest.raises(RuntimeError, match="no live layer"):
        _library._layer(key)


def test_a_layer_pickles_and_copies_after_compiled_calls():
    """A layer whose compiled calls made its operator state still pickles
    (torch.save) and deep-copies; the copy keeps none of that state, and
    compiled it matches its eager self."""
    import copy
    import io

    torch.manual_seed(1)
    m = tec.LayerNormMLP(32, 64, device=DEV)
    _compiled_matches_eager(m, torch.compile(m, fullgraph=True), torch.randn(8, 32, device=DEV))
    assert m.__dict__.get("_op_state") is not None
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    for other in (torch.load(buf, weights_only=False), copy.deepcopy(m)):
        assert other.__dict__.get("_op_state") is None and other._op_key != m._op_key
        _compiled_matches_eager(other, torch.compile(other, fullgraph=True), torch.randn(8, 32, device=DEV))
