"""Megatron-Core's RoPE entry (rope_utils.apply_rotary_pos_emb) with
apply_rope_fusion=True reaches this package's apply_rotary_pos_emb through
the transformer_engine alias; its output and input gradient equal Megatron's
own unfused RoPE (sbhd interleaved or not, thd), on the CPU. Megatron's fused thd call
passes no `interleaved` to TE, so thd is checked non-interleaved only. Run by
tests/test_rope.py in a subprocess with TEC_AS_TRANSFORMER_ENGINE=1; prints
"PASS megatron_rope_check"."""
import types

import torch
from megatron.core.models.common.embeddings import rope_utils

import transformer_engine.pytorch as tep

assert rope_utils.fused_apply_rotary_pos_emb is not None, "Megatron found no fused RoPE"
cp = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
torch.manual_seed(0)
for interleaved, cu in ((False, None), (True, None), (False, torch.tensor([0, 5, 12, 20], dtype=torch.int32))):
    # on the CPU with the inputs: the table is made on the GPU where there is one, as TE's
    freqs = tep.RotaryPositionEmbedding(16, rotary_percent=0.75, interleaved=interleaved)(12).cpu()
    t = (torch.randn(12, 2, 4, 16) if cu is None else torch.randn(20, 4, 16)).requires_grad_()
    results = []
    for fusion in (True, False):
        cfg = types.SimpleNamespace(apply_rope_fusion=fusion, rotary_interleaved=interleaved, mrope_section=None,
                                    multi_latent_attention=False)
        y = rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, cp_group=cp)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        results.append((y.detach(), torch.autograd.grad(y, t, dy)[0]))
    for a, b in zip(*results):
        err = ((a - b).norm() / b.norm()).item()
        assert err < 1e-6, (interleaved, cu is not None, err)
print("PASS megatron_rope_check")
