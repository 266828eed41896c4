"""Shared test helpers."""
import contextlib

import torch

import transformer_engine_c as te


def rel_err(out, ref):
    """Relative error of the whole tensor, computed in float64."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out).all(), "non-finite values (unwritten or poisoned output)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _prepare_without_references(*objs):
    """prepare_for_saving as it would be without keep-by-reference: every
    object is saved as the tensor it is (a test double; negative tests only)."""
    return tuple(objs), len(objs)


def _restore_without_references(n, saved):
    assert len(saved) == n
    return list(saved)


@contextlib.contextmanager
def without_keep_by_reference():
    """Replace prepare_for_saving / restore_from_saved wherever the package
    and the layers bind them with the double above, so a negative test shows
    what keep-by-reference prevents. Restores the real functions on exit."""
    import transformer_engine_c as tec
    from transformer_engine_c import _saved
    from transformer_engine_c.module import layernorm_linear, linear

    places = [tec, _saved, linear, layernorm_linear]
    old = [(m, m.prepare_for_saving, m.restore_from_saved) for m in places]
    for m in places:
        m.prepare_for_saving, m.restore_from_saved = _prepare_without_references, _restore_without_references
    try:
        yield
    finally:
        for m, p, r in old:
            m.prepare_for_saving, m.restore_from_saved = p, r


class Stack(torch.nn.Module):
    """Layers applied in turn (the first output of each; a LayerNorm takes
    no is_first_microbatch)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x, is_first_microbatch=None):
        for layer in self.layers:
            x = layer(x) if isinstance(layer, te.LayerNorm) else layer(x, is_first_microbatch=is_first_microbatch)
            x = x[0] if isinstance(x, tuple) else x
        return x


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the block (small tensors: threads only cost
    time, and the drawn-configuration tests share a small machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
