"""TransformerEngine's `MultiheadAttention`, composed of the package's layers:
the query/key/value projection (LayerNormLinear `layernorm_qkv` with
input_layernorm, else Linear `qkv`; for cross-attention `layernorm_query` /
`query_layer` and Linear `key_value` over encoder_output), optional q/k
normalisation (`q_norm`, `k_norm`), rotary position embedding (the engine's
fused RoPE), DotProductAttention `core_attention` and the output Linear
`proj`. Submodule and parameter names, their registration order and the qkv
layouts are TE 2.x's, so that state dicts carry over:
  * fuse_qkv_params=False: `query_weight`, `key_weight`, `value_weight`
    (then the biases), [q heads | k groups | v groups] along the output;
  * fuse_qkv_params=True: one `weight`; with qkv_weight_interleaved (TE's
    default) its rows are grouped per key/value group: the group's
    num_heads / num_gqa_groups query heads, its key, its value.
Tensor parallelism (set_parallel_mode: qkv column, proj row), sequence
parallelism and the userbuffers flags (ub_name "qkv" and "proj") are the
layers'. Exercised by tests/test_transformer_layer.py.

Raises NotImplementedError naming the argument: inference_params (KV-cache
inference), qk_norm_type="L2Normalization"; DotProductAttention raises for
what it does not do (context parallelism, ALiBi, FP8 attention, ...)."""
import torch

from ..module.layernorm_linear import LayerNormLinear
from ..module.linear import Linear
from ..module.normalization import LayerNorm, RMSNorm
from ..distributed import resolve_tp
from .dot_product_attention import DotProductAttention
from . import context_parallel
from .rope import apply_rotary_pos_emb

__all__ = ["MultiheadAttention"]

ATTENTION_TYPES = ("self", "cross")
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


def _sub(name, suffix):
    return None if name is None else f"{name}.{suffix}"


class MultiheadAttention(torch.nn.Module):
    """TE's MultiheadAttention (constructor and forward arguments in TE's
    order; `device` defaults, as this package's layers, to the current CUDA
    device if there is one, else the CPU)."""

    def __init__(self, hidden_size, num_attention_heads, kv_channels=None, attention_dropout=0.1,
                 layernorm_epsilon=1e-5, init_method=None, output_layer_init_method=None, layer_number=None,
                 attn_mask_type="causal", window_size=None, tp_group=None, tp_size=1, num_gqa_groups=None,
                 fuse_wgrad_accumulation=False, get_rng_state_tracker=None, sequence_parallel=False,
                 params_dtype=None, return_bias=False, return_layernorm_output=False, input_layernorm=False,
                 attention_type="self", set_parallel_mode=False, fuse_qkv_params=False, zero_centered_gamma=False,
                 qkv_weight_interleaved=True, rotary_pos_interleaved=False, ub_overlap_ag=False,
                 ub_overlap_rs=False, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=False, ub_bulk_wgrad=False,
                 bias=True, normalization="LayerNorm", device=None, qkv_format="sbhd", name=None,
                 qk_norm_type=None, qk_norm_eps=1e-6, qk_norm_before_rope=False, seq_length=None,
                 micro_batch_size=None, softmax_type="vanilla"):
        super().__init__()
        if attention_type not in ATTENTION_TYPES:
            raise ValueError(f"attention_type must be one of {ATTENTION_TYPES}, got {attention_type!r}")
        if layer_number is not None and layer_number <= 0:
            raise ValueError(f"layer_number must be a positive int, got {layer_number}")
        if not isinstance(num_attention_heads, int) or num_attention_heads <= 0:
            raise ValueError(f"num_attention_heads must be a positive int, got {num_attention_heads!r}")
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, window_size
        self.layer_number = 1 if layer_number is None else layer_number
        self.input_layernorm, self.attention_type = bool(input_layernorm), attention_type
        self.get_rng_state_tracker, self.tp_group = get_rng_state_tracker, tp_group
        self.return_layernorm_output, self.return_bias = bool(return_layernorm_output), bool(return_bias)
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_attention_heads = num_attention_heads
        self.cp_size, self.cp_rank = 1, 0
        self.softmax_type, self.name = softmax_type, name
        kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        self.qkv_weight_interleaved = bool(qkv_weight_interleaved and fuse_qkv_params)
        self.rotary_pos_interleaved = bool(rotary_pos_interleaved)
        self.qk_norm_before_rope = bool(qk_norm_before_rope)
        tp_size = resolve_tp(tp_group, tp_size)[1] if tp_group is not None else int(tp_size)
        self.tp_size = tp_size
        self.sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else int(num_gqa_groups)
        if num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of num_gqa_groups "
                             f"({self.num_gqa_groups})")
        if num_attention_heads % tp_size or self.num_gqa_groups % tp_size:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) and num_gqa_groups "
                             f"({self.num_gqa_groups}) must be divisible by the tensor-parallel size {tp_size}")
        self.num_attention_heads_per_partition = num_attention_heads // tp_size
        self.num_gqa_groups_per_partition = self.num_gqa_groups // tp_size
        self.hidden_size_per_attention_head = kv_channels
        self.hidden_size_q = kv_channels * num_attention_heads
        self.hidden_size_kv = kv_channels * self.num_gqa_groups

        gemm_kw = dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=tp_size,
                       get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel,
                       params_dtype=self.params_dtype, device=device)
        self.q_norm, self.k_norm = self._qk_norms(qk_norm_type, qk_norm_eps, device)
        qkv_mode = "column" if set_parallel_mode else None
        if attention_type == "self":
            split = None if fuse_qkv_params else {"query": self.hidden_size_q, "key": self.hidden_size_kv,
                                                  "value": self.hidden_size_kv}
            out = self.hidden_size_q + 2 * self.hidden_size_kv
            if self.input_layernorm:
                self.layernorm_qkv = LayerNormLinear(
                    hidden_size, out, eps=layernorm_epsilon, init_method=init_method, bias=bias, return_bias=False,
                    parallel_mode=qkv_mode, return_layernorm_output=return_layernorm_output, parameters_split=split,
                    zero_centered_gamma=zero_centered_gamma, ub_bulk_wgrad=ub_bulk_wgrad,
                    ub_bulk_dgrad=ub_bulk_dgrad, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                    ub_overlap_ag=ub_overlap_ag, normalization=normalization, ub_name="qkv",
                    name=_sub(name, "layernorm_linear_qkv"), **gemm_kw)
            else:
                self.qkv = Linear(hidden_size, out, init_method=init_method, bias=bias, return_bias=False,
                                  parallel_mode=qkv_mode, parameters_split=split, name=_sub(name, "linear_qkv"),
                                  **gemm_kw)
        else:
            if self.input_layernorm:
                self.layernorm_query = LayerNormLinear(
                    hidden_size, self.hidden_size_q, eps=layernorm_epsilon, init_method=init_method, bias=bias,
                    return_bias=False, parallel_mode=qkv_mode,
                    parameters_split=None if fuse_qkv_params else ("query",),
                    return_layernorm_output=return_layernorm_output, zero_centered_gamma=zero_centered_gamma,
                    ub_bulk_wgrad=ub_bulk_wgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                    ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_overlap_ag=ub_overlap_ag,
                    normalization=normalization, ub_name="qkv", name=_sub(name, "layernorm_linear_q"), **gemm_kw)
            else:
                self.query_layer = Linear(hidden_size, self.hidden_size_q, init_method=init_method, bias=bias,
                                          return_bias=False, parallel_mode=qkv_mode, **gemm_kw)
            self.key_value = Linear(hidden_size, 2 * self.hidden_size_kv, init_method=init_method, bias=bias,
                                    return_bias=False, parallel_mode=qkv_mode,
                                    parameters_split=None if fuse_qkv_params else ("key", "value"),
                                    name=_sub(name, "linear_kv"), **gemm_kw)
        self.core_attention = DotProductAttention(
            num_attention_heads, kv_channels, num_gqa_groups=self.num_gqa_groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel, tp_group=tp_group,
            layer_number=self.layer_number, attention_type=attention_type, softmax_type=softmax_type)
        self.proj = Linear(self.hidden_size_q, hidden_size, init_method=output_layer_init_method, bias=bias,
                           return_bias=return_bias, parallel_mode="row" if set_parallel_mode else None,
                           ub_overlap_rs=ub_overlap_rs, ub_overlap_ag=ub_overlap_ag, ub_name="proj",
                           name=_sub(name, "proj"), **gemm_kw)

    def _qk_norms(self, qk_norm_type, eps, device):
        if qk_norm_type is None:
            return None, None
        if qk_norm_type == "L2Normalization":
            raise NotImplementedError("MultiheadAttention: qk_norm_type='L2Normalization' is not supported "
                                      "(use 'RMSNorm' or 'LayerNorm')")
        norms = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}
        if qk_norm_type not in norms:
            raise ValueError(f"qk_norm_type must be None, 'L2Normalization', 'RMSNorm' or 'LayerNorm', got "
                             f"{qk_norm_type!r}")
        make = norms[qk_norm_type]
        n = self.hidden_size_per_attention_head
        return make(n, eps=eps, device=device), make(n, eps=eps, device=device)

    def set_tensor_parallel_group(self, tp_group):
        """TE's setter: the layers' collectives use `tp_group` from now on."""
        self.tp_group = tp_group
        for child in self.children():
            if hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream=None, cp_comm_type="p2p"):
        """TE's setter: core_attention attends over the group's shards, and
        rotary embeddings use this rank's positions in the whole sequence."""
        cfg = context_parallel.cp_config(cp_group, cp_global_ranks, cp_stream, cp_comm_type, "MultiheadAttention")
        self.cp_size, self.cp_rank = (1, 0) if cfg is None else (cfg.size, cfg.rank)
        for child in self.modules():
            if child is not self and hasattr(child, "set_context_parallel_group"):
                child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _project(self, with_norm, plain, hidden_states, is_first_microbatch):
        """(the projection of hidden_states, the norm's output or None): through
        the submodule `with_norm` (LayerNormLinear) under input_layernorm, else
        `plain` (Linear). Submodules are read from _modules directly (as the
        layers read their parameters: nn.Module.__getattr__ costs several
        dict lookups, on every call), and get is_first_microbatch only where
        it is given (a keyword costs on every call)."""
        layer = self._modules[with_norm if self.input_layernorm else plain]
        out = layer(hidden_states) if is_first_microbatch is None else layer(
            hidden_states, is_first_microbatch=is_first_microbatch)
        return out if self.input_layernorm and self.return_layernorm_output else (out, None)

    def _self_qkv(self, hidden_states, is_first_microbatch):
        """(q, k, v, the norm's output or None) of self-attention."""
        mixed, ln_out = self._project("layernorm_qkv", "qkv", hidden_states, is_first_microbatch)
        groups, hn = self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head
        per_group = self.num_attention_heads_per_partition // groups
        lead = mixed.shape[:-1]
        if per_group == 1:  # no grouped query heads: one view, three slices of it
            if self.qkv_weight_interleaved:  # [..., heads, 3, hn]
                q, k, v = mixed.view(*lead, groups, 3, hn).unbind(-2)
            else:  # [..., 3, heads, hn]
                q, k, v = mixed.view(*lead, 3, groups, hn).unbind(-3)
            return q, k, v, ln_out
        if self.qkv_weight_interleaved:  # [..., groups, per_group + 2, hn]
            q, k, v = mixed.view(*lead, groups, per_group + 2, hn).split((per_group, 1, 1), dim=-2)
        else:  # [..., per_group + 2, groups, hn]
            q, k, v = mixed.view(*lead, per_group + 2, groups, hn).split((per_group, 1, 1), dim=-3)
        q = q.reshape(*lead, groups * per_group, hn)
        k, v = k.reshape(*lead, groups, hn), v.reshape(*lead, groups, hn)
        return q, k, v, ln_out

    def _cross_qkv(self, hidden_states, encoder_output, is_first_microbatch):
        if encoder_output is None:
            raise ValueError("MultiheadAttention: cross-attention needs encoder_output")
        if encoder_output.dim() != hidden_states.dim() or (
                self.qkv_format != "thd" and encoder_output.shape[self.qkv_format.index("b")] !=
                hidden_states.shape[self.qkv_format.index("b")]):
            raise ValueError(f"MultiheadAttention: encoder_output {tuple(encoder_output.shape)} must be laid out as "
                             f"hidden_states {tuple(hidden_states.shape)} ({self.qkv_format}), with the same batch")
        kv = self.key_value(encoder_output, is_first_microbatch=is_first_microbatch)
        groups, hn = self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head
        lead = kv.shape[:-1]
        if self.qkv_weight_interleaved:  # [..., groups, 2 * hn]: each group's key, then its value
            k, v = kv.view(*lead, groups, 2 * hn).split(hn, dim=-1)
        else:  # [..., 2 * groups, hn]: every key, then every value
            k, v = kv.view(*lead, 2 * groups, hn).split(groups, dim=-2)
        k, v = k.reshape(*lead, groups, hn), v.reshape(*lead, groups, hn)
        q, ln_out = self._project("layernorm_query", "query_layer", hidden_states, is_first_microbatch)
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, hn)
        return q, k, v, ln_out

    def forward(self, hidden_states, attention_mask=None, encoder_output=None, attn_mask_type=None,
                window_size=None, is_first_microbatch=None, checkpoint_core_attention=False, inference_params=None,
                rotary_pos_emb=None, core_attention_bias_type="no_bias", core_attention_bias=None,
                alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None, fast_zero_fill=True,
                pad_between_seqs=None):
        """hidden_states [s, b, hidden] (sbhd), [b, s, hidden] (bshd) or
        [t, hidden] (thd). Returns the output, then proj's bias with
        return_bias, then the norm's output with input_layernorm and
        return_layernorm_output (TE's order)."""
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        window_size = self.window_size if window_size is None else window_size
        if inference_params is not None:
            raise NotImplementedError("MultiheadAttention: inference_params (KV-cache inference) is not supported")
        if core_attention_bias_type not in BIAS_TYPES:
            raise ValueError(f"core_attention_bias_type must be one of {BIAS_TYPES}, got "
                             f"{core_attention_bias_type!r}")
        if attention_mask is not None and ("padding" in attn_mask_type or attn_mask_type == "arbitrary"):
            masks = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask,)
            if any(getattr(m, "dtype", None) != torch.bool for m in masks):
                raise TypeError("MultiheadAttention: attention_mask must be boolean (True: masked out)")
        fmt = self.qkv_format
        need = 2 if fmt == "thd" else 3
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != need:
            raise ValueError(f"MultiheadAttention: hidden_states must be {need}-D in {fmt}, got "
                             f"{tuple(getattr(hidden_states, 'shape', ()))}")
        if self.attention_type == "self":
            q, k, v, ln_out = self._self_qkv(hidden_states, is_first_microbatch)
        else:
            q, k, v, ln_out = self._cross_qkv(hidden_states, encoder_output, is_first_microbatch)

        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            padded = pad_between_seqs or (self.cp_size > 1 and cu_seqlens_q_padded is not None)  # CP shards by them
            cu_q, cu_kv = (cu_seqlens_q_padded, cu_seqlens_kv_padded) if padded else (cu_seqlens_q, cu_seqlens_kv)
            rope_kw = dict(tensor_format=fmt, fused=True, cp_size=self.cp_size, cp_rank=self.cp_rank,
                           interleaved=self.rotary_pos_interleaved)
            q = apply_rotary_pos_emb(q, q_emb, cu_seqlens=cu_q, **rope_kw)
            k = apply_rotary_pos_emb(k, k_emb, cu_seqlens=cu_kv, **rope_kw)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)

        # core_attention gets the arguments that differ from its defaults (TE's, as here): every keyword
        # passed costs host time on every call.
        extra = {"qkv_format": fmt, "attn_mask_type": attn_mask_type, "window_size": window_size}
        if attention_mask is not None:
            extra["attention_mask"] = attention_mask
        if (cu_seqlens_q is not None or cu_seqlens_kv is not None or cu_seqlens_q_padded is not None
                or cu_seqlens_kv_padded is not None or max_seqlen_q is not None or max_seqlen_kv is not None):
            extra.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                         cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                         max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv)
        if (checkpoint_core_attention or core_attention_bias_type != "no_bias" or core_attention_bias is not None
                or alibi_slopes is not None or not fast_zero_fill or pad_between_seqs is not None):
            extra.update(checkpoint_core_attention=checkpoint_core_attention,
                         core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
                         alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill, pad_between_seqs=pad_between_seqs)
        modules = self._modules
        context = modules["core_attention"](q, k, v, **extra)
        proj = modules["proj"]
        out = proj(context) if is_first_microbatch is None else proj(context, is_first_microbatch=is_first_microbatch)
        if ln_out is None:  # out, or (out, proj's bias) with return_bias
            return out
        return out + (ln_out,) if self.return_bias else (out, ln_out)
