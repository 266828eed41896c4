"""What the torchrun runners share: the device they run on (set by setup()),
communicators on that device, and the comparisons against references."""
import torch

import transformer_engine_c as tec
from transformer_engine_c._launch import init_rank

DEV = torch.device("cpu")  # setup("cuda"): NCCL + the CUDA IPC transport


def setup(device_type):
    """Initialise this rank; tensors made without a device land on it."""
    global DEV
    rank, size, DEV = init_rank(device_type)
    torch.set_default_device(DEV)
    return rank, size, DEV


def comm(*args, **kw):
    """A communicator on DEV that overlaps at every size (the tests' shapes
    are far below the GPU's fallback threshold), unless told otherwise."""
    kw.setdefault("min_chunk_flops", 0)
    return tec.CommOverlap(*args, device=DEV, **kw)


def init_ub(*args, **kw):
    kw.setdefault("min_chunk_flops", 0)
    return tec.initialize_ub(*args, device=DEV, **kw)


def rel_err(a, b):
    """Relative error of the whole tensor, in float64 on the CPU (references
    are computed there)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def close(out, ref, what, tensorwise=False):
    """fp32: relative error of the whole tensor <= 1e-5. bf16: TE's rtol 0.025 /
    atol 0.00125 per element, or (tensorwise) 0.025 relative for the whole
    tensor: used where the non-overlapped reference sums its reduce-scatters in
    bf16 (gloo), so per-element atol is below the reference's own rounding."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    if out.dtype == torch.float32 or tensorwise:
        tol = 1e-5 if out.dtype == torch.float32 else 0.025
        err = rel_err(out, ref)
        assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"
    else:
        d = (out.float() - ref.float()).abs()
        bad = d > 0.00125 + 0.025 * ref.float().abs()
        assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {d.max().item():.3g}"


FP8_TOL = dict(rtol=0.125, atol=0.0625)  # TE's FP8 tolerances (test_layers_with_overlap_fp8)


def fp8_partials_atol(ref):
    """TE's FP8 atol, or one E4M3 step (2**-3 relative) at the output's
    largest magnitude if that is more: FP8 partials are each rounded to
    E4M3 before the sum, so where they cancel the sum's error is relative to
    the partials, not to the sum (the output's magnitudes stand in for the
    partials'); a wrong scale is still off by a large part of the output."""
    return max(FP8_TOL["atol"], 2.0 ** -3 * ref.detach().float().abs().max().item())


def compare(name, test, ref, rtol=0.025, atol=0.00125):
    """TE's _compare_tensors semantics: fail when the element of largest
    absolute difference is off both relatively and absolutely; a zero test
    tensor fails unless the reference is zero too. Returns an error or None."""
    test, ref = test.detach().float().cpu().flatten(), ref.detach().float().cpu().flatten()
    if test.numel() != ref.numel():
        return f"{name}: {test.numel()} elements vs {ref.numel()} in the reference"
    if not torch.isfinite(test).all():
        return f"{name}: non-finite values"
    if test.count_nonzero() == 0 and ref.count_nonzero() != 0:
        return f"{name} is a zero tensor but the reference is not"
    diff = (test - ref).abs()
    m = int(torch.argmax(diff))
    abs_err = diff[m].item()
    rel_err = abs_err / max(abs(ref[m].item()), 1e-5)
    if rel_err > rtol and abs_err > atol:
        return (f"{name} off at index {m}: {test[m].item()} vs {ref[m].item()} "
                f"(rel {rel_err:.3g} > {rtol}, abs {abs_err:.3g} > {atol})")
    return None
