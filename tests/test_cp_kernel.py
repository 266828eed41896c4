"""The pieces of context parallelism that need no peers
(transformer_engine_c/attention/context_parallel.py): a block's attention
and its log-sum-exp against float64 scaled_dot_product_attention, two
blocks merged by their log-sum-exp against the attention over both, the
backward from the merged log-sum-exp, PyTorch's flash kernel blocks against the float32 ones, and the balanced
sharding helpers."""
import pytest
import torch
import torch.nn.functional as F

from transformer_engine_c.attention import context_parallel as cp
from transformer_engine_c.attention import cp_blocks


def _inputs(b=2, h=4, hk=2, s=10, d=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, s, dv, generator=g, dtype=torch.float64)
    return q, k, v


def _reference(q, k, v, allowed, scale):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=allowed, scale=scale)


def test_two_blocks_merge_to_the_whole_attention_forward_and_backward():
    q, k, v = _inputs()
    s, scale = q.shape[2], 0.37
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _reference(qr, kr, vr, allowed, scale)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    cut = 4  # keys [0, cut) and [cut, s): one block each, merged
    o1, l1, _ = cp.block_forward(q, k[:, :, :cut], v[:, :, :cut], scale, allowed[:, :cut])
    o2, l2, _ = cp.block_forward(q, k[:, :, cut:], v[:, :, cut:], scale, allowed[:, cut:])
    assert torch.isinf(l2[:, :, :cut]).all() and (o2[:, :, :cut] == 0).all()  # rows with no key in the block
    out = torch.full_like(o1, 0.0)
    lse = torch.full_like(l1, float("-inf"))
    for o, m in ((o1, l1), (o2, l2)):
        out, lse = cp._merge(out, lse, o, m)
    assert (out.double() - ref).abs().max() < 1e-5
    delta = (dout * out.double()).sum(-1).float()
    dq1, dk1, dv1 = cp.block_backward(dout, q, k[:, :, :cut], v[:, :, :cut], out, lse, delta, scale,
                                      allowed[:, :cut])
    dq2, dk2, dv2 = cp.block_backward(dout, q, k[:, :, cut:], v[:, :, cut:], out, lse, delta, scale,
                                      allowed[:, cut:])
    assert (dq1 + dq2 - qr.grad).abs().max() < 1e-5
    assert (torch.cat((dk1, dk2), 2) - kr.grad).abs().max() < 1e-5
    assert (torch.cat((dv1, dv2), 2) - vr.grad).abs().max() < 1e-5


def test_a_block_with_the_wrong_mask_is_caught():
    """The comparison above can fail: a block attending past the diagonal."""
    q, k, v = _inputs(seed=1)
    s = q.shape[2]
    ref = _reference(q, k, v, torch.ones(s, s, dtype=torch.bool).tril(), 0.3)
    out, _, _ = cp.block_forward(q, k, v, 0.3, torch.ones(s, s, dtype=torch.bool))
    assert (out.double() - ref).abs().max() > 1e-2


def test_row_tiles_give_the_same_result():
    q, k, v = _inputs(s=24)
    whole = cp.block_forward(q, k, v, 0.5)
    old = cp_blocks._TILE_ELEMENTS
    cp_blocks._TILE_ELEMENTS = 2 * 4 * 24 * 5  # five rows a tile
    try:
        tiled = cp.block_forward(q, k, v, 0.5)
    finally:
        cp_blocks._TILE_ELEMENTS = old
    assert torch.allclose(whole[0], tiled[0], atol=1e-6) and torch.allclose(whole[1], tiled[1], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, cp.CAUSAL])
def test_the_flash_kernel_blocks_match_the_float32_blocks(dtype, mask):
    """Blocks PyTorch's flash kernel serves (no mask, square causal; GQA)
    against block_forward's own arithmetic: output, log-sum-exp and the
    backward from them."""
    q, k, v = (t.to(dtype) for t in _inputs(dv=8, seed=2))
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(q.shape, generator=g).to(dtype)
    results = []
    for fused in (True, False):
        cp.reset_stats()
        old = cp_blocks.use_fused_blocks
        cp_blocks.use_fused_blocks = fused
        try:
            o, lse, aux = cp.block_forward(q, k, v, 0.3, mask)
            out = o.to(dtype)
            delta = (dout.float() * out.float()).sum(-1)
            grads = cp.block_backward(dout, q, k, v, out, lse, delta, 0.3, mask, aux)
        finally:
            cp_blocks.use_fused_blocks = old
        assert cp.stats()["fused_blocks" if fused else "math_blocks"] == 1
        results.append((o, lse, *grads))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        err = ((a - b).norm() / b.norm()).item()
        assert err < tol, (name, err)


def test_shards_are_the_balanced_chunks():
    x = torch.arange(16)
    assert cp.shard_sequence(x, 0, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp.shard_sequence(x, 0, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    cu = torch.tensor([0, 4, 12])
    assert cp.shard_thd(torch.arange(12), cu, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]


def test_position_mask_rows_are_the_mask_of_positions():
    """PositionMask (built a few rows at a time) against the rule written
    out element by element: same sequence, both tokens (not padding), the
    causal diagonal and the window; and a block masked by it equals the
    block masked by the whole tensor."""
    q_pos, q_sid = torch.tensor([0, 1, 2, 3, 0, 1, 2]), torch.tensor([0, 0, 0, 0, 1, 1, 1])
    k_pos, k_sid = torch.tensor([0, 1, 2, 0, 1, 2, 3]), torch.tensor([0, 0, 0, 1, 1, 1, 1])
    q_valid = torch.tensor([True, True, True, False, True, True, True])
    k_valid = torch.tensor([True, True, True, True, True, False, True])
    for causal, window in ((True, (-1, 0)), (True, (1, 0)), (False, (1, 1)), (False, (-1, -1))):
        pm = cp.PositionMask(q_pos, q_sid, k_pos, k_sid, causal, window, q_valid, k_valid)
        whole = torch.cat([pm.rows(a, min(a + 3, 7)) for a in range(0, 7, 3)])
        want = torch.zeros(7, 7, dtype=torch.bool)
        for i in range(7):
            for j in range(7):
                d = int(k_pos[j]) - int(q_pos[i])
                ok = bool(q_sid[i] == k_sid[j] and q_valid[i] and k_valid[j])
                ok = ok and (d <= 0 if causal else (window[1] == -1 or d <= window[1]))
                want[i, j] = ok and (window[0] == -1 or -d <= window[0])
        assert torch.equal(whole, want), (causal, window)
        q, k, v = _inputs(b=1, s=7, seed=4)
        a = cp.block_forward(q, k, v, 0.4, pm)
        b = cp.block_forward(q, k, v, 0.4, want)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
