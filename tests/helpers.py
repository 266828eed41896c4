"""Shared test helpers."""
import torch


def rel_err(out, ref):
    """Relative error of the whole tensor, computed in float64."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out).all(), "non-finite values (unwritten or poisoned output)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
