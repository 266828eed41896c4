"""TransformerEngine's `DotProductAttention` on PyTorch's
scaled_dot_product_attention (its flash and memory-efficient kernels where
they apply: no mask or plain causal attention of equal lengths; an explicit
boolean mask otherwise).

Layouts `sbhd`, `bshd` ([s, b, heads, d] / [b, s, heads, d], output
[s, b, heads * d_v] / [b, s, heads * d_v]) and `thd` (sequences packed
along the first dimension, delimited by `cu_seqlens_q` / `cu_seqlens_kv`,
output [t, heads * d_v]). Mask types, TE's meaning (an `attention_mask`
element True is masked out):
  * no_mask; causal (top-left aligned: query i sees keys j <= i) and
    causal_bottom_right (j <= i + s_kv - s_q);
  * padding: `attention_mask` [b, 1, 1, s] (self-attention) or a pair
    ([b, 1, 1, s_q], [b, 1, 1, s_kv]); padding_causal and
    padding_causal_bottom_right add the causal mask;
  * arbitrary: `attention_mask` broadcastable to [b, heads, s_q, s_kv].
`window_size` (left, right) limits each query to keys i - left .. i + right
(-1: unbounded); its diagonal is top-left aligned for causal and
padding_causal, bottom-right for the other types, unless
`bottom_right_diagonal` says; under a padding mask a bottom-right
diagonal is at each sequence's own corner (its actual lengths), as TE's.
Query rows with no key left produce zeros. Heads are split over the
tensor-parallel group: the inputs hold this rank's num_attention_heads /
tp_size heads (and num_gqa_groups / tp_size key/value heads). attention_dropout is drawn under
the RNG tracker's fork() when one is given and sequence_parallel is off, as
TE does.

Under FP8 autocast attention runs in the compute dtype (TE's recipes
without fp8_dpa / fp8_mha). A cp_group of more than one rank splits each
sequence over the group (context_parallel.py says how, and what it
supports). Raises NotImplementedError naming the feature: FP8 attention
(fp8_output, a recipe's fp8_dpa / fp8_mha),
softmax types other than vanilla, return_max_logit, ALiBi, KV-cache
inference (inference_params), score_mod."""
import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._fp8_meta import initial_fp8_meta
from ..module.base import ExtraStateMixin
from ..quantization import FP8GlobalStateManager
from . import context_parallel

__all__ = ["DotProductAttention"]

MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
              "padding_causal_bottom_right", "arbitrary")
QKV_FORMATS = ("sbhd", "bshd", "thd")


def _fp8_attention_asked():
    """Whether FP8 autocast's recipe asks for FP8 attention. Without fp8_dpa /
    fp8_mha, attention under FP8 autocast runs in the compute dtype, as in
    TE."""
    if not FP8GlobalStateManager.FP8_ENABLED:
        return False
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    return bool(getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False))


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _window(window_size, mask_type):
    causal = "causal" in mask_type
    if window_size is None:
        return (-1, 0) if causal else (-1, -1)
    try:
        left, right = (int(v) for v in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size must be (left, right) with each >= -1, got {window_size}")
    if causal and right not in (0, -1):
        raise ValueError(f"window_size={window_size}: a causal mask type needs right = 0 (or -1)")
    return (left, 0) if causal else (left, right)


class AttentionPlan:
    """What DotProductAttention decides once per (qkv_format, attn_mask_type,
    window_size, bottom_right_diagonal): the checked format and mask type,
    the (left, right) window, the diagonal (`br`: True, False or None, the
    mask type's own), and whether the kernels' is_causal can stand for the
    mask (`causal`, where query and key lengths are equal and no bias)."""

    __slots__ = ("fmt", "mask_type", "window", "br", "causal", "padding", "arbitrary", "ndim")

    def __init__(self, fmt, mask_type, window_size, br):
        _check_choice("qkv_format", fmt, QKV_FORMATS)
        _check_choice("attn_mask_type", mask_type, MASK_TYPES)
        self.fmt, self.mask_type = fmt, mask_type
        self.window = _window(window_size, mask_type)
        self.br = True if mask_type.endswith("bottom_right") else br  # these types' diagonal by definition
        self.causal = mask_type == "causal" and self.window == (-1, 0) and not self.br
        self.padding, self.arbitrary = mask_type.startswith("padding"), mask_type == "arbitrary"
        self.ndim = 3 if fmt == "thd" else 4


_PLANS_KEPT = 64  # distinct configurations a layer keeps plans for (a layer sees a few)


def _cacheable(window_size):
    """Whether a window_size can key a kept plan: None or a tuple of ints (a
    list or tensors could change in place)."""
    return window_size is None or type(window_size) is tuple and all(type(v) is int for v in window_size)


def _band(sq, skv, mask_type, window, device, bottom_right=None, shift=None):
    """[sq, skv] allowed-mask of the causal diagonal and the window, or None
    if every pair is allowed. The diagonal is bottom-right aligned for the
    *_bottom_right and non-causal mask types, top-left for causal and
    padding_causal (TE's bottom_right_diagonal=None), or as `bottom_right`
    says. A bottom-right diagonal is shifted by skv - sq, or with `shift`
    ([b]: each batch's actual key/value length less its query length, of a
    padding mask) by each batch's own, as TE; the mask is then
    [b, 1, sq, skv]."""
    left, right = window
    if left == -1 and right == -1:
        return None
    if bottom_right is None:
        bottom_right = mask_type not in ("causal", "padding_causal")
    i = torch.arange(sq, device=device).view(sq, 1)
    if bottom_right:
        i = i + (skv - sq) if shift is None else i.view(1, 1, sq, 1) + shift.view(-1, 1, 1, 1)
    j = torch.arange(skv, device=device).view(1, skv)
    allowed = torch.ones(sq, skv, dtype=torch.bool, device=device)
    if right != -1:
        allowed = allowed & (j <= i + right)
    if left != -1:
        allowed = allowed & (j >= i - left)
    return allowed


class _Band:
    """A mask of the causal diagonal and the window alone, kept for its
    shape and device (_kept_band): `mask` [1, 1, sq, skv], True where a
    query attends, with the rows that allow no key opened (the kernels need
    one; None: every pair attends), and `empty` those rows [1, 1, sq, 1] to
    zero after the kernel, None where every row has a key."""

    __slots__ = ("mask", "empty")

    def __init__(self, mask, empty):
        self.mask, self.empty = mask, empty


# Kept bands, shared by the layers (a model's layers see the same few): the oldest goes past _BANDS_KEPT,
# and a mask past _BAND_MAX elements is built per call instead.
_BANDS = {}
_BANDS_KEPT = 8
_BAND_MAX = 1 << 24


def _kept_band(sq, skv, mask_type, window, device, br):
    """The _Band of these lengths, mask type, window, diagonal (`br`) and
    device, kept (its mask and whether a row is empty are then found once,
    not per call: no mask building and no synchronisation on a CUDA
    device); None where none is kept or used (under torch.compile; in a
    CUDA graph capture, whose graph must own what it reads, where a kept
    mask could be freed after the capture; past _BAND_MAX elements): the
    caller builds the mask."""
    if torch.compiler.is_compiling() or device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    key = (sq, skv, mask_type, window, br, device)
    band = _BANDS.get(key)
    if band is not None:
        return band
    if sq * skv > _BAND_MAX:
        return None
    allowed = _band(sq, skv, mask_type, window, device, br)
    if allowed is None:
        band = _Band(None, None)
    else:
        allowed = allowed.view(1, 1, sq, skv)
        empty = ~allowed.any(-1, keepdim=True)
        band = _Band(allowed | empty, empty if bool(empty.any()) else None)
    if len(_BANDS) >= _BANDS_KEPT:
        old = _BANDS.pop(next(iter(_BANDS)))
        if old.mask is not None and old.mask.is_cuda:  # its memory is free again once this stream has read it
            stream = torch.cuda.current_stream(old.mask.device)
            for t in (old.mask, old.empty):
                if t is not None:
                    t.record_stream(stream)
    _BANDS[key] = band
    return band


def _attend(q, k, v, allowed, is_causal, scale, dropout_p, bias, band=None):
    """q [b, h, sq, d], k/v [b, hk, skv, d]; allowed broadcastable to
    [b, h, sq, skv] (True: attend) or None, or instead `band` (a kept
    _Band). Returns [b, h, sq, dv]."""
    h, hk = q.shape[1], k.shape[1]
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    empty_rows = None
    mask = allowed
    if band is not None:
        mask = band.mask
    elif allowed is not None:  # left as it broadcasts: the kernels broadcast it
        empty_rows = ~allowed.any(-1, keepdim=True)
        mask = allowed | empty_rows  # rows with no key attend anywhere, then are zeroed
    if bias is not None:
        bias = bias.to(q.dtype)
        mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=is_causal and mask is None, scale=scale)
    if band is not None:
        if band.empty is not None:
            out = out.masked_fill(band.empty, 0.0)
    elif empty_rows is not None:  # whether any row is empty is not read on the host: no synchronisation
        out = out.masked_fill(empty_rows, 0.0)
    return out


def _padding_allowed(attention_mask, b, sq, skv, self_attention):
    """Allowed-mask [b, 1, sq, skv] of TE's padding masks (True: padded),
    and each batch's actual key/value length less its query length ([b])."""
    if isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError("attention_mask: a padding mask pair must be (q_mask, kv_mask)")
        q_mask, kv_mask = attention_mask
    else:
        if attention_mask is None:
            raise ValueError("attention_mask is required with a padding mask type (True: padded position)")
        q_mask = kv_mask = attention_mask
        if not self_attention or sq != skv:
            raise ValueError("attention_mask: cross-attention padding needs the pair (q_mask, kv_mask)")
    for m, n, what in ((q_mask, sq, "query"), (kv_mask, skv, "key/value")):
        if not isinstance(m, torch.Tensor) or m.numel() != b * n:
            raise ValueError(f"attention_mask: the {what} padding mask must be [b, 1, 1, s] = [{b}, 1, 1, {n}], got "
                             f"{tuple(getattr(m, 'shape', ()))}")
    q_ok = ~q_mask.to(torch.bool).reshape(b, 1, sq, 1)
    kv_ok = ~kv_mask.to(torch.bool).reshape(b, 1, 1, skv)
    shift = kv_ok.reshape(b, skv).sum(1) - q_ok.reshape(b, sq).sum(1)
    return q_ok & kv_ok, shift


def _check_cu_seqlens(name, cu, cu_padded, tokens):
    """cu_seqlens (and its padded form) must delimit sequences of
    non-negative length within the `tokens` rows of the input."""
    for t, n in ((cu, name), (cu_padded, f"{name}_padded")):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool):
            raise TypeError(f"{n} must be an integer tensor, got {type(t).__name__} "
                            f"{getattr(t, 'dtype', '')}".rstrip())
    lens = torch.diff(cu)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((lens < 0).any()):
        raise ValueError(f"{name} must be non-decreasing offsets [b + 1] from 0, got {cu.tolist()}")
    if cu_padded is None:
        if int(cu[-1]) > tokens:
            raise ValueError(f"{name} describes {int(cu[-1])} tokens; the input holds {tokens}")
        return
    if cu_padded.shape != cu.shape or bool((torch.diff(cu_padded) < lens).any()) or int(cu_padded[-1]) > tokens:
        raise ValueError(f"{name}_padded ({cu_padded.tolist()}) must hold each sequence of {name} "
                         f"({cu.tolist()}) within the input's {tokens} tokens")


class DotProductAttention(ExtraStateMixin, torch.nn.Module):
    """TransformerEngine's DotProductAttention (constructor and forward
    arguments in TE's order; see the module docstring for what each
    supports)."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, bottom_right_diagonal=None,
                 sequence_parallel=False, tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
                 attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p",
                 softmax_scale=None, softmax_type="vanilla", return_max_logit=False, name=None):
        super().__init__()
        self.fp8_meta = initial_fp8_meta()  # TE's (its DotProductAttention is a TE module)
        _check_choice("qkv_format", qkv_format, QKV_FORMATS)
        _check_choice("attn_mask_type", attn_mask_type, MASK_TYPES)
        _check_choice("attention_type", attention_type, ("self", "cross"))
        if softmax_type != "vanilla":
            raise NotImplementedError(f"DotProductAttention: softmax_type={softmax_type!r} is not supported "
                                      "(only 'vanilla')")
        if return_max_logit:
            raise NotImplementedError("DotProductAttention: return_max_logit (qk-clip) is not supported")
        self.bottom_right_diagonal = None if bottom_right_diagonal is None else bool(bottom_right_diagonal)
        if tp_group is not None and dist.is_initialized():
            tp_size = dist.get_world_size(tp_group)
        tp_size = int(tp_size)
        heads = int(num_attention_heads)
        groups = heads if num_gqa_groups is None else int(num_gqa_groups)
        if heads <= 0 or groups <= 0 or heads % groups:
            raise ValueError(f"num_attention_heads ({heads}) must be a positive multiple of num_gqa_groups "
                             f"({groups})")
        if heads % tp_size or groups % tp_size:
            raise ValueError(f"num_attention_heads ({heads}) and num_gqa_groups ({groups}) must be divisible "
                             f"by the tensor-parallel size {tp_size}")
        if not 0.0 <= float(attention_dropout) < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        self.num_attention_heads, self.num_gqa_groups, self.tp_size, self.tp_group = heads, groups, tp_size, tp_group
        self.num_attention_heads_per_partition = heads // tp_size
        self.num_gqa_groups_per_partition = groups // tp_size
        channels = (kv_channels, kv_channels) if isinstance(kv_channels, int) else tuple(kv_channels)
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = (int(c) for c in channels)
        self.kv_channels = kv_channels
        self.qkv_format, self.attn_mask_type, self.attention_type = qkv_format, attn_mask_type, attention_type
        self.window_size = window_size
        _window(window_size, attn_mask_type)
        self.attention_dropout = float(attention_dropout)
        self.sequence_parallel = bool(sequence_parallel)
        self.layer_number, self.name = layer_number, name
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head_k) if softmax_scale is None
                              else float(softmax_scale))
        self.softmax_type = softmax_type
        self._plans = {}  # AttentionPlan per configuration (_plan)
        self.rng_states_tracker = None
        if not self.sequence_parallel and get_rng_state_tracker is not None:
            self.rng_states_tracker = get_rng_state_tracker()
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p"):
        """TE's setter; a group of more than one rank (or the pair of groups of
        cp_comm_type 'a2a+p2p') is context parallelism: query, key and value
        are then this rank's shard of each sequence (context_parallel.py)."""
        self._cp = context_parallel.cp_config(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (
            cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_tensor_parallel_group(self, tp_group):
        self.tp_group = tp_group

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None, cu_seqlens_q=None,
                cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type=None, window_size=None, bottom_right_diagonal=None,
                checkpoint_core_attention=False, core_attention_bias_type="no_bias", core_attention_bias=None,
                alibi_slopes=None, fast_zero_fill=True, inference_params=None, pad_between_seqs=None,
                fp8_output=False, bf16_backward=False, num_splits=None, score_mod=None, score_mod_bprop=None,
                score_mod_tensors=None, score_mod_bprop_tensors=None, qkv_layer=None):
        """q/k/v in `qkv_format` (default the constructor's); `attn_mask_type`
        and `window_size` default to the constructor's. num_splits (a
        flash-decoding knob) does not change the result and is ignored."""
        plan = self._plan(self.qkv_format if qkv_format is None else qkv_format,
                          self.attn_mask_type if attn_mask_type is None else attn_mask_type,
                          self.window_size if window_size is None else window_size,
                          self.bottom_right_diagonal if bottom_right_diagonal is None else bool(bottom_right_diagonal))
        bias = None
        if (fp8_output or alibi_slopes is not None or inference_params is not None or score_mod is not None
                or score_mod_bprop is not None or qkv_layer is not None or core_attention_bias_type != "no_bias"
                or FP8GlobalStateManager.FP8_ENABLED):
            bias = self._checked_bias(fp8_output, alibi_slopes, inference_params, score_mod, score_mod_bprop,
                                      qkv_layer, core_attention_bias_type, core_attention_bias)
        q, k, v = query_layer, key_layer, value_layer
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            for t, n in ((q, "query_layer"), (k, "key_layer"), (v, "value_layer")):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"DotProductAttention: {n} must be a tensor, got {type(t).__name__}")
        nd, qs, ks = plan.ndim, q.shape, k.shape
        if (len(qs) != nd or len(ks) != nd or v.dim() != nd or qs[-2] != self.num_attention_heads_per_partition
                or ks[-2] != self.num_gqa_groups_per_partition or v.shape[-2] != ks[-2] or qs[-1] != ks[-1]):
            self._check_heads(q, k, v, plan.fmt)
        args = (q, k, v, attention_mask, plan, bias, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                cu_seqlens_kv_padded)
        if checkpoint_core_attention and torch.is_grad_enabled():
            from ..checkpoint import checkpoint
            tracker = self.rng_states_tracker
            return checkpoint(self._forward, *args, use_reentrant=False,
                              get_rng_state_tracker=(lambda: tracker) if tracker is not None else None)
        return self._forward(*args)

    def _plan(self, fmt, mask_type, window_size, br):
        """The AttentionPlan of these (resolved) arguments, kept in the layer
        per key: a changed argument or attribute is another key."""
        key = (fmt, mask_type, window_size, br)
        plans = self.__dict__.get("_plans")
        cacheable = plans is not None and (window_size is None or _cacheable(window_size))
        if cacheable:
            plan = plans.get(key)
            if plan is not None:
                return plan
        plan = AttentionPlan(fmt, mask_type, window_size, br)
        if cacheable and not torch.compiler.is_compiling():
            if len(plans) >= _PLANS_KEPT:
                plans.clear()
            plans[key] = plan
        return plan

    def _checked_bias(self, fp8_output, alibi_slopes, inference_params, score_mod, score_mod_bprop, qkv_layer,
                      bias_type, core_attention_bias):
        """The arguments a plain call leaves at their defaults: NotImplementedError
        for what is not supported, else the score bias to add (None with
        'no_bias')."""
        # Inside an FP8 autocast attention computes in high precision, as TE's does
        # without the recipe's fp8_dpa (which the recipes here refuse).
        for flag, what in ((fp8_output, "fp8_output (FP8 attention)"),
                           (_fp8_attention_asked(), "FP8 attention (the recipe's fp8_dpa / fp8_mha)"),
                           (alibi_slopes is not None or bias_type == "alibi", "ALiBi"),
                           (inference_params is not None, "inference_params (KV-cache inference)"),
                           (score_mod is not None or score_mod_bprop is not None, "score_mod"),
                           (qkv_layer is not None, "qkv_layer")):
            if flag:
                raise NotImplementedError(f"DotProductAttention: {what} is not supported")
        _check_choice("core_attention_bias_type", bias_type, ("no_bias", "pre_scale_bias", "post_scale_bias",
                                                              "alibi"))
        if bias_type == "no_bias":
            return None
        if core_attention_bias is None:
            raise ValueError(f"core_attention_bias is required with core_attention_bias_type={bias_type!r}")
        if bias_type == "pre_scale_bias":
            return core_attention_bias * self.softmax_scale
        return core_attention_bias

    def _check_heads(self, q, k, v, fmt):
        need = 3 if fmt == "thd" else 4
        for t, n in ((q, "query_layer"), (k, "key_layer"), (v, "value_layer")):
            if t.dim() != need:
                raise ValueError(f"DotProductAttention: {n} must be {need}-D in {fmt}, got {tuple(t.shape)}")
        hd = -2
        hq, hk = q.shape[hd], k.shape[hd]
        if hq != self.num_attention_heads_per_partition or hk != self.num_gqa_groups_per_partition \
                or v.shape[hd] != hk:
            raise ValueError(f"DotProductAttention: this rank holds {self.num_attention_heads_per_partition} "
                             f"query and {self.num_gqa_groups_per_partition} key/value heads; got query "
                             f"{tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)} ({fmt})")
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(f"DotProductAttention: query and key head sizes differ ({q.shape[-1]} vs {k.shape[-1]})")

    def _forward(self, q, k, v, attention_mask, plan, bias, cu_q, cu_kv, cu_q_pad, cu_kv_pad):
        p = self.attention_dropout if self.training else 0.0
        if p > 0 and self.rng_states_tracker is not None:
            with self.rng_states_tracker.fork():
                return self._attention(q, k, v, attention_mask, plan, bias, cu_q, cu_kv, cu_q_pad, cu_kv_pad, p)
        return self._attention(q, k, v, attention_mask, plan, bias, cu_q, cu_kv, cu_q_pad, cu_kv_pad, p)

    def _attention(self, q, k, v, attention_mask, plan, bias, cu_q, cu_kv, cu_q_pad, cu_kv_pad, p):
        fmt, mask_type, window, br = plan.fmt, plan.mask_type, plan.window, plan.br
        if self._cp is not None:
            return context_parallel.attention(q, k, v, self._cp, fmt, mask_type, window, self.softmax_scale,
                                              cu_q, cu_kv, cu_q_pad, cu_kv_pad, bias, p)
        if fmt == "thd":
            return self._forward_thd(q, k, v, mask_type, window, bias, cu_q, cu_kv, cu_q_pad, cu_kv_pad, p, br)
        if fmt == "sbhd":
            q, k, v = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        b, h, sq, _ = q.shape
        skv = k.shape[2]
        # the kernels' is_causal, where no bias needs the explicit mask (no mask is built)
        plain_causal = plan.causal and sq == skv and bias is None
        band = None
        if not (plain_causal or plan.padding or plan.arbitrary):  # the diagonal and window alone: kept
            band = _kept_band(sq, skv, mask_type, window, q.device, br)
        allowed = None if plain_causal or band is not None else _band(sq, skv, mask_type, window, q.device, br)
        if allowed is not None:
            allowed = allowed.view(1, 1, sq, skv)
        if plan.padding:
            pad, shift = _padding_allowed(attention_mask, b, sq, skv, self.attention_type == "self")
            if allowed is not None:  # a bottom-right diagonal at each sequence's own corner
                allowed = _band(sq, skv, mask_type, window, q.device, br, shift)
            allowed = pad if allowed is None else allowed & pad
        elif plan.arbitrary:
            if attention_mask is None:
                raise ValueError("attention_mask is required with attn_mask_type='arbitrary'")
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"attention_mask: an arbitrary mask is one tensor, got "
                                f"{type(attention_mask).__name__}")
            am = ~attention_mask.to(torch.bool)
            try:
                torch.broadcast_shapes(am.shape, (b, h, sq, skv))
            except RuntimeError:
                raise ValueError(f"attention_mask: an arbitrary mask must broadcast to [b, heads, s_q, s_kv] = "
                                 f"{[b, h, sq, skv]}, got {tuple(am.shape)}") from None
            allowed = am if allowed is None else allowed & am
        out = _attend(q, k, v, allowed, plain_causal, self.softmax_scale, p, bias, band)
        out = out.permute(2, 0, 1, 3) if fmt == "sbhd" else out.transpose(1, 2)
        return out.reshape(out.shape[0], out.shape[1], h * out.shape[-1])

    def _forward_thd(self, q, k, v, mask_type, window, bias, cu_q, cu_kv, cu_q_pad, cu_kv_pad, p, br):
        if cu_q is None or cu_kv is None:
            raise ValueError("DotProductAttention: qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv")
        if bias is not None:
            raise NotImplementedError("DotProductAttention: core_attention_bias with qkv_format='thd' is not "
                                      "supported")
        if mask_type == "arbitrary":
            raise NotImplementedError("DotProductAttention: attn_mask_type='arbitrary' with qkv_format='thd' is "
                                      "not supported")
        _check_cu_seqlens("cu_seqlens_q", cu_q, cu_q_pad, q.shape[0])
        _check_cu_seqlens("cu_seqlens_kv", cu_kv, cu_kv_pad, k.shape[0])
        lens_q = torch.diff(cu_q).tolist()
        lens_kv = torch.diff(cu_kv).tolist()
        if len(lens_q) != len(lens_kv):
            raise ValueError(f"cu_seqlens_q ({len(lens_q) + 1} entries) and cu_seqlens_kv ({len(lens_kv) + 1}) "
                             "must describe the same number of sequences")
        start_q = (cu_q if cu_q_pad is None else cu_q_pad).tolist()
        start_kv = (cu_kv if cu_kv_pad is None else cu_kv_pad).tolist()
        mt = mask_type.replace("padding_", "").replace("padding", "no_mask")
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        pieces = []
        for i, (lq, lk) in enumerate(zip(lens_q, lens_kv)):
            if lq == 0:
                continue
            a, c = int(start_q[i]), int(start_kv[i])
            qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (q[a:a + lq], k[c:c + lk], v[c:c + lk]))
            causal = mt == "causal" and lq == lk and window == (-1, 0) and not br
            allowed = None if causal else _band(lq, lk, mt, window, q.device, br)
            oi = _attend(qi, ki, vi, allowed if allowed is None else allowed.view(1, 1, lq, lk), causal,
                         self.softmax_scale, p, None)
            pieces.append((a, lq, oi[0].transpose(0, 1)))
        if cu_q_pad is None and pieces and sum(n for _, n, _ in pieces) == q.shape[0]:
            out = torch.cat([o for _, _, o in pieces])
        else:
            for a, n, o in pieces:
                out = out.index_copy(0, torch.arange(a, a + n, device=q.device), o)
        return out.reshape(out.shape[0], out.shape[1] * out.shape[2])
