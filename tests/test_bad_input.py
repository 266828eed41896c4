"""Bad input gives a Python exception that names the argument; nothing crashes."""
import pytest
import torch

import transformer_engine_c as tec
from transformer_engine_c import _engine


def test_wrong_last_dimension():
    m = tec.Linear(16, 8, device="cpu")
    with pytest.raises(ValueError, match=r"inp has last dimension 12; expected 16"):
        m(torch.randn(4, 12))


def test_integer_input():
    m = tec.LayerNormLinear(16, 8, device="cpu")
    with pytest.raises(TypeError, match=r"inp has dtype torch.int64"):
        m(torch.ones(4, 16, dtype=torch.long))


def test_dtype_mismatch():
    m = tec.Linear(16, 8, device="cpu", params_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"inp has dtype torch.float32 but the layer's parameters are torch.bfloat16"):
        m(torch.randn(4, 16))


def test_integer_params_dtype():
    with pytest.raises(TypeError, match="params_dtype"):
        tec.Linear(16, 8, device="cpu", params_dtype=torch.int32)


def test_mismatched_devices():
    m = tec.Linear(16, 8, device="cpu")
    x = torch.randn(4, 16, device="meta")
    with pytest.raises(ValueError, match=r"inp is on meta but the layer's parameters are on cpu"):
        m(x)


def test_bad_rank():
    m = tec.Linear(16, 8, device="cpu")
    with pytest.raises(ValueError, match=r"inp must be 2-D .* or 3-D"):
        m(torch.randn(16))


def test_non_contiguous_input_is_handled():
    m = tec.Linear(16, 8, device="cpu")
    x = torch.randn(16, 4).t()
    assert not x.is_contiguous()
    torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias))


def test_unknown_normalization():
    with pytest.raises(ValueError, match=r"normalization must be 'LayerNorm' or 'RMSNorm', got 'BatchNorm'"):
        tec.LayerNormLinear(16, 8, normalization="BatchNorm", device="cpu")


def test_symmetric_ar_type_is_named():
    for cls in (tec.Linear, tec.LayerNormLinear):
        with pytest.raises(NotImplementedError, match=r"symmetric_ar_type='multimem_all_reduce'"):
            cls(16, 8, symmetric_ar_type="multimem_all_reduce", device="cpu")


def test_delay_wgrad_with_bulk_wgrad():
    c = tec.CommOverlap((8, 16), torch.float32, device="cpu", name="bad_delay")
    try:
        with pytest.raises(ValueError, match="delay_wgrad_compute cannot be combined with ub_bulk_wgrad"):
            tec.Linear(16, 8, parallel_mode="column", delay_wgrad_compute=True, ub_bulk_wgrad=True, ub_comm=c,
                       device="cpu")
    finally:
        c.close()


def test_backward_dw_without_backward():
    m = tec.Linear(16, 8, delay_wgrad_compute=True, device="cpu")
    with pytest.raises(RuntimeError, match="no delayed weight gradient is pending"):
        m.backward_dw()


def test_fuse_wgrad_accumulation_needs_main_grad():
    m = tec.Linear(16, 8, fuse_wgrad_accumulation=True, device="cpu")
    y = m(torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="needs the weight's main_grad"):
        y.sum().backward()
    m.weight.main_grad = torch.zeros(8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="main_grad must be a contiguous float32 tensor of shape"):
        m(torch.randn(4, 16)).sum().backward()


def test_fp8_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="FP8"):
        tec.Linear(16, 8, device="cpu")(torch.randn(4, 16), fp8_output=True)
    with tec.fp8_autocast():  # the layers run in FP8 there, on shapes FP8 can run
        with pytest.raises(ValueError, match="FP8 execution requires .* of inp"):
            tec.Linear(16, 16, device="cpu")(torch.randn(4, 16))
        with pytest.raises(NotImplementedError, match="GroupedLinear"):
            tec.GroupedLinear(2, 16, 16, device="cpu")(torch.randn(16, 16), [8, 8])


def test_unknown_parallel_mode():
    with pytest.raises(ValueError, match=r"parallel_mode must be None, 'column' or 'row', got 'diagonal'"):
        tec.Linear(16, 8, parallel_mode="diagonal", device="cpu")


def test_tp_size_without_group():
    with pytest.raises(ValueError, match=r"tp_size=2 needs tp_group"):
        tec.Linear(16, 8, parallel_mode="column", tp_size=2, device="cpu")


def test_unknown_device():
    with pytest.raises((ValueError, RuntimeError), match="device"):
        tec.Linear(16, 8, device="xla")


def test_engine_rejects_shape_mismatch():
    with pytest.raises(ValueError, match=r"layer_norm_weight has shape \(8,\); expected \(16,\)"):
        _engine.norm_fwd(torch.randn(4, 16), torch.randn(8), None, 1e-5)
    with pytest.raises(ValueError, match=r"GEMM inner dimensions differ"):
        _engine.gemm(torch.randn(4, 16), torch.randn(8, 4), transb=True)


def test_engine_rejects_too_small_output():
    with pytest.raises(ValueError, match=r"out has shape \(2, 16\); expected \(4, 16\)"):
        _engine.norm_fwd(torch.randn(4, 16), torch.randn(16), None, 1e-5, out=torch.empty(2, 16))


def test_engine_rejects_non_contiguous_out():
    out = torch.empty(16, 4).t()
    with pytest.raises(ValueError, match=r"out must be contiguous"):
        _engine.norm_fwd(torch.randn(4, 16), torch.randn(16), None, 1e-5, out=out)


def test_c_entry_point_bad_arguments():
    from transformer_engine_c import _C
    with pytest.raises(TypeError, match=r"gemm\(\) takes 20 positional arguments"):
        _C.gemm(1, 2)
    with pytest.raises(TypeError, match=r"argument 8 must be an address"):
        _C.gemm(-1, 0, 0, 0, 0, 1, 1, 1, "x", 1, 0, 1, 0, 1, None, None, 0, None, 0, 0)
    with pytest.raises(ValueError, match=r"norm: missing pointer"):
        _C.norm_fwd(-1, 0, 4, 16, 0, 0, None, 0, None, 0, 1e-5, 0, 0)
    with pytest.raises(ValueError, match=r"argument 1 \(dtype\) must be in \[0, 2\], got 7"):
        _C.norm_fwd(-1, 7, 4, 16, 1, 1, None, 1, None, 1, 1e-5, 0, 0)


def test_cuda_request_without_backend():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-backend path is for CPU-only builds")
    from transformer_engine_c import _C
    if _C.has_cuda_backend():
        pytest.skip("the CUDA backend is loaded")
    with pytest.raises(tec.EngineError, match="CUDA backend is not loaded"):
        _C.gemm(0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, None, None, 0, None, 0, 0)


@pytest.mark.parametrize("layer", ["Linear", "LayerNormLinear"])
def test_valid_degenerate_inputs_as_torch(layer):
    """What torch accepts is accepted: a size-1 dimension with any stride, no
    tokens (empty outputs, zero parameter gradients), a non-contiguous
    weight; the results are torch's."""
    m = getattr(tec, layer)(16, 8, device="cpu")
    with torch.no_grad():
        m.bias.normal_()
    ref_w = m.weight.detach().clone()
    for x in [torch.randn(16, 1).t(), torch.randn(0, 16), torch.randn(4, 0, 16), torch.randn(0, 2, 16)]:
        x = x.detach().requires_grad_()
        m.zero_grad()
        y = m(x)
        assert y.shape == (*x.shape[:-1], 8)
        y.sum().backward()
        assert x.grad.shape == x.shape
        if x.numel() == 0:
            assert all(not p.grad.any() for p in m.parameters())
        elif layer == "Linear":
            torch.testing.assert_close(y, torch.nn.functional.linear(x, ref_w, m.bias))
    lin = tec.Linear(16, 8, device="cpu")
    lin.weight = torch.nn.Parameter(torch.randn(16, 8).t())  # a transposed view, as torch allows
    x = torch.randn(4, 16)
    lin(x).sum().backward()
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert lin.weight.grad.shape == (8, 16)


def test_wrong_type_ub_comm_is_named():
    for bad in ("fc1", {"fprop": 3}):
        with pytest.raises(TypeError, match="ub_comm must be a transformer_engine_c.CommOverlap"):
            tec.Linear(16, 8, parallel_mode="column", ub_overlap_ag=True, ub_comm=bad, device="cpu")
