"""RoPE (transformer_engine_c.attention.rope): the engine kernel (tec_rope,
fused=True) against a float64 reference of the rotation written here, and
against the unfused PyTorch path, forward and backward, for sbhd / bshd /
thd, interleaved or not, a partial rotary dimension, strided inputs,
start_positions and context parallelism's positions; the angle table of
RotaryPositionEmbedding; the checks (each raises)."""
import math

import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c import _engine
from transformer_engine_c.attention.rope import (RotaryPositionEmbedding, apply_fused_qkv_rotary_pos_emb,
                                                 apply_rotary_pos_emb)
from helpers import TOL, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ref_rotate(x, angles, interleaved):
    """float64 rotation of x [..., d] by angles [..., d2] (broadcast)."""
    x, angles = x.double(), angles.double()
    d2 = angles.shape[-1]
    head, tail = x[..., :d2], x[..., d2:]
    if interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
        rot = torch.stack((-b, a), dim=-1).flatten(-2)
    else:
        a, b = head.chunk(2, dim=-1)
        rot = torch.cat((-b, a), dim=-1)
    return torch.cat((head * angles.cos() + rot * angles.sin(), tail), dim=-1)


def _positions(n, cp_size, cp_rank):
    half = n // 2
    return [j if cp_size == 1 else
            (cp_rank * half + j if j < half else cp_size * n - (cp_rank + 1) * half + j - half) for j in range(n)]


def _reference(t, freqs, fmt, interleaved, cu_seqlens=None, start_positions=None, cp_size=1, cp_rank=0):
    """The rotation in float64 on the CPU, returned on t's device."""
    return _reference_cpu(t, freqs.cpu(), fmt, interleaved, cu_seqlens, start_positions, cp_size,
                          cp_rank).to(t.device)


def _reference_cpu(t, freqs, fmt, interleaved, cu_seqlens, start_positions, cp_size, cp_rank):
    table = freqs.reshape(freqs.shape[0], -1).double()
    out = torch.empty(t.shape, dtype=torch.float64)
    if fmt == "thd":
        cu = (cu_seqlens // cp_size).tolist()
        out.zero_()
        for i in range(len(cu) - 1):
            pos = torch.tensor(_positions(cu[i + 1] - cu[i], cp_size, cp_rank), dtype=torch.long)
            if start_positions is not None:
                pos = pos + int(start_positions[i])
            out[cu[i]:cu[i + 1]] = _ref_rotate(t[cu[i]:cu[i + 1]].cpu(), table[pos].unsqueeze(1), interleaved)
        return out
    tt = t.cpu() if fmt == "sbhd" else t.cpu().transpose(0, 1)  # [s, b, h, d]
    s, b = tt.shape[:2]
    pos = torch.tensor(_positions(s, cp_size, cp_rank), dtype=torch.long).view(s, 1).expand(s, b)
    if start_positions is not None:
        pos = pos + start_positions.cpu().long().view(1, b)
    res = _ref_rotate(tt, table[pos].unsqueeze(2), interleaved)
    return res if fmt == "sbhd" else res.transpose(0, 1)


def _input(fmt, dtype, device, s=9, b=3, h=4, d=16, strided=False):
    shape = {"sbhd": (s, b, h, d), "bshd": (b, s, h, d), "thd": (s * b, h, d)}[fmt]
    if strided:  # a view of every other head of a wider tensor, as q out of a fused qkv
        wide = torch.randn(*shape[:-2], 2 * shape[-2], d, device=device).to(dtype)
        return wide[..., ::2, :]
    return torch.randn(*shape, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_against_float64(device, dtype, fmt, interleaved):
    torch.manual_seed(0)
    freqs = RotaryPositionEmbedding(12, interleaved=interleaved)(20).to(device)  # d2 = 12 < d = 16
    x = _input(fmt, dtype, device, strided=True)
    cu = torch.tensor([0, 5, 5, 14, 27], dtype=torch.int32, device=device) if fmt == "thd" else None
    y = apply_rotary_pos_emb(x, freqs, fmt, interleaved=interleaved, fused=True, cu_seqlens=cu)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert rel_err(y, _reference(x, freqs, fmt, interleaved, cu)) < TOL[dtype]
    # backward: the transpose of the rotation (autograd of the float64 reference)
    xr = x.detach().cpu().double().requires_grad_()
    ref = _reference(xr, freqs.cpu(), fmt, interleaved, cu.cpu() if cu is not None else None)
    dy = torch.randn(y.shape, device=device).to(dtype)
    ref.backward(dy.cpu().double())
    xg = x.detach().requires_grad_()
    apply_rotary_pos_emb(xg, freqs, fmt, interleaved=interleaved, fused=True, cu_seqlens=cu).backward(dy)
    assert rel_err(xg.grad, xr.grad) < TOL[dtype]


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_against_unfused(device, fmt, interleaved, dtype):
    """TE's test_fused_rope: fused and unfused agree, forward and backward."""
    torch.manual_seed(1)
    freqs = RotaryPositionEmbedding(16, rotary_percent=0.5, interleaved=interleaved)(32).to(device)
    cu = torch.tensor([0, 7, 16, 30], dtype=torch.int32, device=device) if fmt == "thd" else None
    x = _input(fmt, dtype, device, s=10, b=3)
    outs, grads = [], []
    dy = torch.randn(x.shape, device=device).to(dtype)
    for fused in (True, False):
        xg = x.detach().clone().requires_grad_()
        y = apply_rotary_pos_emb(xg, freqs, fmt, interleaved=interleaved, fused=fused, cu_seqlens=cu)
        y.backward(dy)
        outs.append(y.detach())
        grads.append(xg.grad)
    tol = 2e-6 if dtype == torch.float32 else 2e-2  # unfused rounds cos/sin to the dtype first, as TE's
    assert rel_err(outs[0], outs[1]) < tol
    assert rel_err(grads[0], grads[1]) < tol


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_start_positions(device, fmt):
    torch.manual_seed(2)
    freqs = RotaryPositionEmbedding(16)(40).to(device)
    x = _input(fmt, torch.float32, device, s=8, b=3)
    cu = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=device) if fmt == "thd" else None
    starts = torch.tensor([0, 5, 11], dtype=torch.int32, device=device)
    ref = _reference(x, freqs, fmt, False, cu, starts)
    for fused in (True, False):
        y = apply_rotary_pos_emb(x, freqs, fmt, start_positions=starts, fused=fused, cu_seqlens=cu)
        assert rel_err(y, ref) < 2e-6, fused


@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
@pytest.mark.parametrize("cp_rank", [0, 1])
def test_context_parallel_positions(device, fmt, cp_rank):
    """cp_size=2: this rank's two chunks take the whole sequence's positions
    (chunk cp_rank and chunk 3 - cp_rank)."""
    torch.manual_seed(3)
    freqs = RotaryPositionEmbedding(16)(64).to(device)
    x = _input(fmt, torch.float32, device, s=8, b=2)
    cu = torch.tensor([0, 16, 32], dtype=torch.int32, device=device) if fmt == "thd" else None  # whole sequences
    ref = _reference(x, freqs, fmt, False, cu, None, 2, cp_rank)
    for fused in (True, False):
        y = apply_rotary_pos_emb(x, freqs, fmt, fused=fused, cu_seqlens=cu, cp_size=2, cp_rank=cp_rank)
        assert rel_err(y, ref) < 2e-6, fused


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_qkv(device, fmt, interleaved):
    """TE's test_fused_qkv_rope: the packed qkv's query and key rotated as
    apply_rotary_pos_emb rotates them split, forward and backward."""
    torch.manual_seed(4)
    d, h = 8, 2
    qkv = torch.randn(6, 3, h, 6 * d, device=device)
    if fmt == "bshd":
        qkv = qkv.transpose(0, 1).contiguous()
    fq = RotaryPositionEmbedding(d, interleaved=interleaved)(6).to(device)
    fk = RotaryPositionEmbedding(d, rotary_percent=0.5, interleaved=interleaved)(6).to(device)
    outs, grads = [], []
    for packed in (True, False):
        t = qkv.detach().clone().requires_grad_()
        if packed:
            q, k, v = apply_fused_qkv_rotary_pos_emb(t, fq, fk, [4 * d, d, d], fmt, interleaved=interleaved)
        else:
            q, k, v = torch.split(t, [4 * d, d, d], dim=-1)
            q = apply_rotary_pos_emb(q.reshape(*q.shape[:2], 4 * h, d), fq, fmt, interleaved=interleaved)
            k = apply_rotary_pos_emb(k, fk, fmt, interleaved=interleaved)
        (q.square().sum() + (k * 3).sum() + v.sum()).backward()
        outs.append((q.detach(), k.detach(), v.detach()))
        grads.append(t.grad)
    for a, b in zip(*outs):
        assert a.shape == b.shape and rel_err(a, b) < 2e-6
    assert rel_err(grads[0], grads[1]) < 2e-6
    with pytest.raises(ValueError, match="qkv_split_arg_list"):
        apply_fused_qkv_rotary_pos_emb(qkv, fq, fk, [4 * d, d, 2 * d], fmt)


def test_thd_tokens_outside_sequences_are_zero():
    x = torch.randn(10, 2, 8)
    freqs = RotaryPositionEmbedding(8)(10)
    y = apply_rotary_pos_emb(x, freqs, "thd", fused=True, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    assert torch.equal(y[7:], torch.zeros_like(y[7:]))


def test_rotary_position_embedding_table():
    rpe = RotaryPositionEmbedding(8, rotary_base=500.0)
    f = rpe(6, offset=2).cpu()  # the table is made on the current CUDA device where there is one, as TE's
    assert f.shape == (6, 1, 1, 8) and f.dtype == torch.float32
    inv = [500.0 ** (-j / 8) for j in (0, 2, 4, 6)]
    expect = torch.tensor([[(p + 2) * v for v in inv] * 2 for p in range(6)])
    assert torch.allclose(f.view(6, 8), expect, rtol=1e-6)
    fi = RotaryPositionEmbedding(8, rotary_base=500.0, interleaved=True)(6, offset=2).cpu().view(6, 8)
    assert torch.allclose(fi, expect[:, :4].repeat_interleave(2, dim=1), rtol=1e-6)
    assert RotaryPositionEmbedding(16, rotary_percent=0.5)(3).shape == (3, 1, 1, 8)
    # linear interpolation needs both arguments, as in TE
    assert torch.equal(RotaryPositionEmbedding(8, seq_len_interpolation_factor=2)(4), RotaryPositionEmbedding(8)(4))
    scaled = RotaryPositionEmbedding(8, seq_len_interpolation_factor=2, pretrained_max_position_embeddings=4)
    assert torch.allclose(scaled(8), RotaryPositionEmbedding(8)(8) / 2)
    assert torch.allclose(scaled(16), RotaryPositionEmbedding(8)(16) * (4 / 16))
    assert list(rpe.state_dict()) == ["inv_freq"]
    assert te.RotaryPositionEmbedding is RotaryPositionEmbedding


def test_rotary_position_embedding_kept_table():
    """The kept table is returned again only while nothing it was made from
    changed: another length, offset or attribute, a moved or changed
    inv_freq, a table changed in place by its caller, inference mode, each
    give what a fresh module gives."""
    def fresh(m, *args):
        new = RotaryPositionEmbedding(8, seq_len_interpolation_factor=m.seq_len_interpolation_factor,
                                      pretrained_max_position_embeddings=m.pretrained_max_position_embeddings,
                                      interleaved=m.interleaved)
        new.inv_freq = m.inv_freq.clone()
        return new(*args)
    m = RotaryPositionEmbedding(8).cpu()
    a = m(6)
    assert m(6) is a  # kept
    for args in ((7,), (6, 2), (6,)):
        assert torch.equal(m(*args), fresh(m, *args)), args
    m.interleaved = True
    assert torch.equal(m(6), fresh(m, 6)) and not torch.equal(m(6), a)
    m.interleaved = False
    m.seq_len_interpolation_factor, m.pretrained_max_position_embeddings = 2, 4
    assert torch.equal(m(6), fresh(m, 6)) and not torch.equal(m(6), a)
    m.seq_len_interpolation_factor = m.pretrained_max_position_embeddings = None
    b = m(6)
    b.mul_(0)  # the caller changed it: made again
    assert torch.equal(m(6), a) and m(6) is not b
    with torch.no_grad():
        m.inv_freq.mul_(2)  # changed in place (an optimizer, load_state_dict)
    assert torch.equal(m(6), fresh(m, 6)) and torch.allclose(m(6), a * 2)
    m.load_state_dict({"inv_freq": torch.ones(4)})
    assert torch.equal(m(6), fresh(m, 6))
    m.to(torch.float64)  # a new inv_freq
    assert m.inv_freq.dtype == torch.float64 and torch.equal(m(6), fresh(m, 6)) and m(6).dtype == torch.float32
    with torch.inference_mode():
        c = m(5)
    assert torch.equal(m(5), c) and not m(5).is_inference()
    t = torch.tensor(5)
    assert torch.equal(m(t), m(5))  # not an int: made per call


def test_checks():
    x = torch.randn(6, 2, 2, 8)
    freqs = RotaryPositionEmbedding(8)(4)  # 4 rows for 6 positions
    with pytest.raises(ValueError, match="outside the 4 rows"):
        apply_rotary_pos_emb(x, freqs, fused=True)
    with pytest.raises(ValueError, match="past the 4 rows"):
        apply_rotary_pos_emb(x, freqs, fused=False)
    freqs = RotaryPositionEmbedding(8)(8)
    with pytest.raises(ValueError, match="tensor_format"):
        apply_rotary_pos_emb(x, freqs, "bhsd")
    with pytest.raises(ValueError, match="cu_seqlens"):
        apply_rotary_pos_emb(x[:, 0], freqs, "thd", fused=True)
    with pytest.raises(ValueError, match="head size"):
        apply_rotary_pos_emb(x, RotaryPositionEmbedding(16)(8), fused=True)
    with pytest.raises(ValueError, match="start_positions"):
        apply_rotary_pos_emb(x, freqs, start_positions=torch.zeros(3, dtype=torch.int32), fused=True)
    with pytest.raises(ValueError, match="cp_size"):
        apply_rotary_pos_emb(x, freqs, start_positions=torch.zeros(2, dtype=torch.int32), cp_size=2)
    with pytest.raises(ValueError, match="cp_rank"):
        apply_rotary_pos_emb(x, freqs, cp_size=2, cp_rank=2)
    # the engine checks again
    y = torch.empty_like(x)
    with pytest.raises(ValueError, match="d2"):
        te._C.rope(-1, 0, 0, 0, 0, 6, 2, 2, 8, 32, 16, 8, 1, x.data_ptr(), y.data_ptr(), freqs.data_ptr(), 8, 7,
                   0, 0, 1, 0, 0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        te._C.rope(-1, 0, 2, 0, 0, 6, 2, 2, 8, 32, 16, 8, 1, x.data_ptr(), y.data_ptr(), freqs.data_ptr(), 8, 8,
                   0, 0, 1, 0, 0)
    starts = torch.zeros(2, dtype=torch.int32)
    for args, match in (((2, 2, 0), "cp_rank"), ((2, 0, starts.data_ptr()), "start_positions"),
                        ((2, 1, 0), None)):
        cp_size, cp_rank, sp = args
        xs = x[:5] if match is None else x  # an odd local length under context parallelism
        with pytest.raises(ValueError, match=match or "even"):
            te._C.rope(-1, 0, 0, 0, 0, xs.shape[0], 2, 2, 8, 32, 16, 8, 1, xs.data_ptr(), y.data_ptr(),
                       freqs.data_ptr(), 8, 8, 0, sp, cp_size, cp_rank, 0)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        _engine.rope(x.double(), freqs, "sbhd", False)
    assert math.isfinite(float(_engine.rope(x, freqs, "sbhd", False).sum()))


def test_megatron_rope_fusion():
    """Megatron-Core's apply_rope_fusion=True runs this package's fused RoPE
    (through the alias) and agrees with Megatron's unfused RoPE."""
    import os
    import subprocess
    import sys
    pytest.importorskip("megatron.core")
    from transformer_engine_c.alias import site_dir
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TEC_AS_TRANSFORMER_ENGINE="1",
               PYTHONPATH=os.pathsep.join([site_dir(), os.path.dirname(here), here]))
    proc = subprocess.run([sys.executable, os.path.join(here, "megatron_rope_check.py")], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and "PASS megatron_rope_check" in proc.stdout, proc.stdout[-4000:]
