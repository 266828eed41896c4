"""Float8Tensor and the two quantizers (tensor/float8_tensor.py): TE's
attributes, dequantize, the transpose, torch ops on the dequantized values,
copy_ through the quantizer, current scaling's scale (power of two, amax
epsilon), and saving for backward through both saving protocols."""
import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c.tensor.float8_tensor import (Float8CurrentScalingQuantizer, Float8Quantizer,
                                                       Float8Tensor)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def ref_fp8(x, fp8_dtype, scale):
    m = torch.finfo(fp8_dtype).max
    return (x.float() * scale).clamp(-m, m).to(fp8_dtype).view(torch.uint8)


def test_delayed_quantizer_makes_a_float8_tensor(device):
    x = (torch.randn(32, 48, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16).to(device)
    scale = torch.tensor([20.0], device=device)
    amax = torch.zeros(1, device=device)
    t = Float8Quantizer(scale, amax, E4M3)(x)
    assert isinstance(t, Float8Tensor) and t.shape == x.shape and t.dtype == torch.bfloat16
    assert t._fp8_dtype is E4M3 and t._data.dtype == torch.uint8 and t._quantizer is not None
    assert torch.equal(t._data.cpu(), ref_fp8(x.cpu(), E4M3, 20.0))
    assert torch.equal(t._transpose.cpu(), t._data.cpu().t())
    assert t._scale_inv.item() == torch.tensor(1 / 20.0).item()
    assert amax.item() == x.float().abs().max().item()
    deq = t.dequantize()
    assert deq.dtype == torch.bfloat16 and type(deq) is torch.Tensor
    assert torch.equal(deq.cpu(), (t._data.cpu().view(E4M3).float() * t._scale_inv.cpu()).to(torch.bfloat16))
    assert (deq.float() - x.float()).abs().max().item() <= x.float().abs().max().item() / 16


def test_rowwise_only_and_transpose_on_demand():
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), E5M2, columnwise=False)
    t = q(torch.randn(8, 16))
    assert t._transpose is None
    assert torch.equal(t.get_transpose(), t._data.t())
    t.update_usage(rowwise_usage=False)
    assert t._data is None and torch.equal(t.dequantize(), Float8Quantizer(
        torch.ones(1), torch.zeros(1), E5M2)(t.dequantize()).dequantize())


def test_current_scaling_quantizer(device):
    x = torch.randn(16, 32, device=device) * 5
    q = Float8CurrentScalingQuantizer(E4M3, device)
    t = q(x)
    amax = x.abs().max()
    assert q.amax.item() == amax.item()
    # fp8_max / amax, one IEEE division (TE's rule); a Python float over a tensor would be
    # torch's reciprocal-then-multiply, an ulp off
    assert q.scale.item() == (torch.tensor(448.0, device=device) / amax).item()
    assert torch.equal(t._data.cpu(), ref_fp8(x.cpu(), E4M3, q.scale.cpu()))
    p = Float8CurrentScalingQuantizer(E4M3, device, force_pow_2_scales=True)
    p(x)
    s = p.scale.item()
    assert s == 2.0 ** int(torch.tensor(s).log2().floor().item()) and s <= 448.0 / amax.item() < 2 * s
    e = Float8CurrentScalingQuantizer(E4M3, device, amax_epsilon=1.0)
    e(torch.full((4, 16), 1e-3, device=device))
    assert e.scale.item() == 448.0  # amax floored at epsilon


def test_torch_ops_see_the_dequantized_values():
    t = Float8CurrentScalingQuantizer(E4M3, "cpu")(torch.randn(8, 16))
    d = t.dequantize()
    assert torch.equal(t + 1, d + 1) and torch.equal(t @ torch.eye(16), d @ torch.eye(16))
    assert type(t + 1) is torch.Tensor
    det = t.detach()
    assert isinstance(det, Float8Tensor) and det._data is t._data
    c = t.clone()
    assert isinstance(c, Float8Tensor) and c._data.data_ptr() != t._data.data_ptr() and torch.equal(c._data, t._data)
    assert "Float8Tensor(fp8_dtype=torch.float8_e4m3fn" in repr(t)


def test_copy_into_a_float8_tensor_quantizes():
    q = Float8Quantizer(torch.tensor([4.0]), torch.zeros(1), E4M3)
    t = q.make_empty((8, 16), dtype=torch.float32)
    assert t._data.shape == (8, 16) and t._transpose.shape == (16, 8)
    src = torch.randn(8, 16)
    t.copy_(src)
    assert torch.equal(t._data, ref_fp8(src, E4M3, 4.0)) and t._scale_inv.item() == 0.25
    with pytest.raises(ValueError, match="dst must be a Float8Tensor of src's shape"):
        q.update_quantized(torch.randn(4, 4), t)


def test_saving_round_trip_through_the_engine_and_te_forms():
    t = Float8CurrentScalingQuantizer(E4M3, "cpu")(torch.randn(8, 16))
    data, tr, si = t._data, t._transpose, t._scale_inv
    x = torch.randn(3)
    saved, objs = te.prepare_for_saving(t, x)
    assert len(saved) == 4 and saved[0] is data and saved[3] is x
    assert t._data is None  # handed to autograd until restored
    back = te.restore_from_saved(objs, saved)
    assert back[0] is t and back[1] is x
    assert t._data is data and t._transpose is tr and t._scale_inv is si
    tensors, state = t.prepare_for_saving()  # TE's method form: the rest comes back
    assert state is t
    assert t.restore_from_saved(list(tensors) + [x]) == [x]
    assert t._data is data


def test_saved_float8_tensor_in_autograd():
    q = Float8CurrentScalingQuantizer(E4M3, "cpu")

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            xq = q(x)
            saved, ctx.objs = te.prepare_for_saving(xq)
            ctx.save_for_backward(*saved)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (xq,) = te.restore_from_saved(ctx.objs, ctx.saved_tensors)
            return g * xq.dequantize()

    x = torch.randn(4, 16, requires_grad=True)
    Fn.apply(x).sum().backward()
    assert torch.equal(x.grad, q(x.detach()).dequantize())


def test_bad_input():
    with pytest.raises(TypeError, match="fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        Float8Quantizer(torch.ones(1), torch.zeros(1), torch.bfloat16)
    with pytest.raises(TypeError, match="scale must be a float32 tensor of one element"):
        Float8Quantizer(torch.ones(2), torch.zeros(1), E4M3)
    with pytest.raises(ValueError, match="with_amax_reduction needs amax_reduction_group"):
        Float8CurrentScalingQuantizer(E4M3, "cpu", with_amax_reduction=True)
    with pytest.raises(ValueError, match="data must be torch.uint8"):
        Float8Tensor(shape=(2, 2), dtype=torch.float32, data=torch.zeros(2, 2), fp8_scale_inv=torch.ones(1),
                     fp8_dtype=E4M3)
    with pytest.raises(TypeError, match="expected a tensor"):
        Float8CurrentScalingQuantizer(E4M3, "cpu")([1.0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (GPU tests run on the GPU machines)")
def test_casts_and_scale_updates_replay_in_a_cuda_graph():
    """Delayed scaling's casts and update and current scaling's casts hold
    no host synchronisation: captured once, replayed, they match eager steps."""
    from transformer_engine_c import _fp8_meta as M
    from transformer_engine_c.recipe import DelayedScaling
    recipe = DelayedScaling(amax_history_len=3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(64, 64, device="cuda", generator=gen) * (1 + 3 * i) for i in range(4)]

    def build():
        meta = M.make_fp8_meta(recipe, device="cuda")["scaling_fwd"]
        q = Float8Quantizer(meta.scale[0:1], meta.amax_history[0][0:1], E4M3)
        cs = Float8CurrentScalingQuantizer(E4M3, "cuda")
        return meta, q, q.make_empty((64, 64), device="cuda"), cs, cs.make_empty((64, 64), device="cuda")

    def body(x, meta, q, out, cs, cout):
        q.update_quantized(x, out)
        cs.update_quantized(x, cout)
        M.amax_and_scale_update(meta, 448.0, recipe)

    eager = build()
    eager_out = []
    for x in inputs:
        body(x, *eager)
        eager_out.append((eager[2]._data.clone(), eager[4]._data.clone(), eager[0].scale.clone()))

    graphed = build()
    x = torch.empty(64, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        body(x.zero_(), *graphed)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body(x, *graphed)
    meta = graphed[0]
    meta.scale.fill_(1.0)
    meta.scale_inv.fill_(1.0)
    meta.amax_history.zero_()
    for i, xi in enumerate(inputs):
        x.copy_(xi)
        g.replay()
        d, c, s = eager_out[i]
        assert torch.equal(graphed[2]._data, d) and torch.equal(graphed[4]._data, c)
        assert torch.equal(meta.scale, s), f"step {i}: {meta.scale.tolist()} vs {s.tolist()}"
    assert eager_out[1][2][0].item() != 1.0  # the scales did move
