"""TransformerEngine's `TransformerLayer`: an attention block and an MLP
block, composed of the package's own layers with TE 2.x's submodule and
parameter names and order (state dicts carry over with TE's keys):
  self_attention   MultiheadAttention (layernorm_qkv / qkv, core_attention, proj)
  inter_attention  MultiheadAttention, cross-attention (layer_type="decoder")
  layernorm_mlp    LayerNormMLP
  layernorm        LayerNorm / RMSNorm after the block (output_layernorm)
Each block adds its output, plus the projection's bias, after hidden
dropout, to the residual: the block's input, or its norm's output with
apply_residual_connection_post_layernorm. The projections add their bias
in the GEMM (the sublayers are built with return_bias=False): TE's
bias-dropout-add, dropout(out + bias) + residual, with out + bias rounded
once, in the GEMM's epilogue. parallel_attention_mlp feeds the
same input to both blocks and adds both outputs once (Falcon).
drop_path_rate drops whole rows along the first dimension, as TE's DropPath
does. Tensor and sequence parallelism (set_parallel_mode, tp_group,
sequence_parallel) and the userbuffers flags (gated by ub_tp_comm_overlap,
as in TE) go to the layers. Exercised by tests/test_transformer_layer.py
and tests/distributed/run_transformer_layer_tp.py.

What the sublayers do not do raises NotImplementedError naming it:
inference_params, qk_norm_type="L2Normalization", and DotProductAttention's
(ALiBi, context parallelism, FP8 attention, softmax types other than
vanilla)."""
import torch

from .attention.multi_head_attention import MultiheadAttention
from .distributed import resolve_tp
from .module._config import TPConfig
from .module._plan import _any_autocast
from .module.layernorm_mlp import LayerNormMLP
from .module.normalization import LayerNorm, RMSNorm

__all__ = ["TransformerLayer"]

LAYER_TYPES = ("encoder", "decoder")
_ABSENT = object()  # an attribute a sublayer lacks
MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
              "padding_causal_bottom_right", "arbitrary")


class DropPath(torch.nn.Module):
    """Stochastic depth: in training, each index of the first dimension is
    zeroed with probability drop_prob and the rest scaled by 1 / (1 -
    drop_prob)."""

    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = float(drop_prob)

    def forward(self, hidden_state):
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        keep = 1.0 - self.drop_prob
        shape = (hidden_state.shape[0],) + (1,) * (hidden_state.dim() - 1)
        mask = torch.empty(shape, dtype=hidden_state.dtype, device=hidden_state.device).bernoulli_(keep)
        return hidden_state * (mask / keep)


def _sub(name, suffix):
    return None if name is None else f"{name}.{suffix}"


def _mask_type(what, value):
    """A mask type given to forward (the constructor's were checked there)."""
    if value not in MASK_TYPES:
        raise ValueError(f"{what} must be one of {MASK_TYPES}, got {value!r}")
    return value


def _check_mask(mask, what):
    if mask is None:
        return
    masks = mask if isinstance(mask, (tuple, list)) else (mask,)
    if any(m.dtype != torch.bool for m in masks):
        raise TypeError(f"TransformerLayer: {what} must be a boolean tensor or a pair of them (True: masked out)")


class TransformerLayer(torch.nn.Module):
    """TE's TransformerLayer (constructor and forward arguments in TE's order;
    `device` defaults, as this package's layers, to the current CUDA device
    if there is one, else the CPU)."""

    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups=None,
                 layernorm_epsilon=1e-5, hidden_dropout=0.1, attention_dropout=0.1, init_method=None,
                 output_layer_init_method=None, layer_number=None, kv_channels=None, self_attn_mask_type="causal",
                 window_size=None, enc_dec_attn_mask_type="no_mask", enc_dec_window_size=None, tp_group=None,
                 tp_size=1, params_dtype=None, get_rng_state_tracker=None, fuse_wgrad_accumulation=False,
                 seq_length=None, micro_batch_size=None, sequence_parallel=False,
                 apply_residual_connection_post_layernorm=False, output_layernorm=False,
                 parallel_attention_mlp=False, layer_type="encoder", drop_path_rate=0.0, set_parallel_mode=False,
                 fuse_qkv_params=False, rotary_pos_interleaved=False, zero_centered_gamma=False,
                 qkv_weight_interleaved=True, ub_tp_comm_overlap=False, ub_overlap_ag=True, ub_overlap_rs=True,
                 ub_overlap_rs_dgrad=False, ub_bulk_dgrad=True, ub_bulk_wgrad=True, bias=True, activation="gelu",
                 normalization="LayerNorm", device=None, attn_input_format="sbhd", name=None, qk_norm_type=None,
                 qk_norm_eps=1e-6, qk_norm_before_rope=False, softmax_type="vanilla"):
        super().__init__()
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {layer_type!r}")
        if parallel_attention_mlp:
            if layer_type != "encoder":
                raise ValueError("parallel_attention_mlp needs layer_type='encoder'")
            if apply_residual_connection_post_layernorm:
                raise ValueError("parallel_attention_mlp cannot be combined with "
                                 "apply_residual_connection_post_layernorm")
            if output_layernorm:
                raise ValueError("parallel_attention_mlp cannot be combined with output_layernorm")
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError("fuse_wgrad_accumulation needs fuse_qkv_params=True (one QKV weight), as in TE")
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        if not 0.0 <= float(drop_path_rate) < 1.0:
            raise ValueError(f"drop_path_rate must be in [0, 1), got {drop_path_rate}")
        for what, value in (("self_attn_mask_type", self_attn_mask_type),
                            ("enc_dec_attn_mask_type", enc_dec_attn_mask_type)):
            if value not in MASK_TYPES:
                raise ValueError(f"{what} must be one of {MASK_TYPES}, got {value!r}")
        self.self_attn_mask_type, self.window_size = self_attn_mask_type, window_size
        self.enc_dec_attn_mask_type, self.enc_dec_window_size = enc_dec_attn_mask_type, enc_dec_window_size
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        ub = bool(ub_tp_comm_overlap)
        ub_flags = dict(ub_bulk_wgrad=ub and ub_bulk_wgrad, ub_bulk_dgrad=ub and ub_bulk_dgrad,
                        ub_overlap_ag=ub and ub_overlap_ag, ub_overlap_rs=ub and ub_overlap_rs,
                        ub_overlap_rs_dgrad=ub and ub_overlap_rs_dgrad)
        self.layer_number, self.layer_type = layer_number, layer_type
        self.output_layernorm = bool(output_layernorm)
        self.apply_residual_connection_post_layernorm = bool(apply_residual_connection_post_layernorm)
        self.parallel_attention_mlp = bool(parallel_attention_mlp)
        if not fuse_qkv_params:
            qkv_weight_interleaved = False
        self.kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        self.tp_size = resolve_tp(tp_group, tp_size)[1] if tp_group is not None else int(tp_size)
        self.sequence_parallel = self.tp_size > 1 and bool(sequence_parallel)
        # the layer's group, for what has none of its own (the output LayerNorm's partial gradients)
        self.tp = TPConfig(None, self.sequence_parallel, tp_group, self.tp_size)
        self.seq_length, self.get_rng_state_tracker = seq_length, get_rng_state_tracker
        self.attn_input_format, self.softmax_type, self.name = attn_input_format, softmax_type, name
        self.hidden_dropout = float(hidden_dropout)

        attention_args = (hidden_size, num_attention_heads, self.kv_channels, attention_dropout, layernorm_epsilon,
                          init_method, output_layer_init_method)
        common = dict(layer_number=layer_number, tp_group=tp_group, tp_size=self.tp_size,
                      num_gqa_groups=num_gqa_groups, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=self.sequence_parallel,
                      params_dtype=params_dtype, return_layernorm_output=apply_residual_connection_post_layernorm,
                      set_parallel_mode=set_parallel_mode, fuse_qkv_params=fuse_qkv_params,
                      zero_centered_gamma=zero_centered_gamma, qkv_weight_interleaved=qkv_weight_interleaved,
                      rotary_pos_interleaved=rotary_pos_interleaved, qkv_format=attn_input_format,
                      seq_length=seq_length, micro_batch_size=micro_batch_size, softmax_type=softmax_type,
                      bias=bias, normalization=normalization, device=device, qk_norm_type=qk_norm_type,
                      qk_norm_eps=qk_norm_eps, qk_norm_before_rope=qk_norm_before_rope, **ub_flags)
        self.self_attention = MultiheadAttention(
            *attention_args, **common, input_layernorm=not output_layernorm, attention_type="self",
            return_bias=False, name=_sub(name, "self_attention"))
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *attention_args, **common, attn_mask_type=enc_dec_attn_mask_type, input_layernorm=True,
                attention_type="cross", return_bias=False, name=_sub(name, "inter_attention"))
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            tp_group=tp_group, tp_size=self.tp_size, get_rng_state_tracker=get_rng_state_tracker,
            init_method=init_method, output_layer_init_method=output_layer_init_method, bias=bias,
            return_bias=False, sequence_parallel=self.sequence_parallel,
            params_dtype=params_dtype, return_layernorm_output=apply_residual_connection_post_layernorm,
            seq_length=seq_length, micro_batch_size=micro_batch_size, set_parallel_mode=set_parallel_mode,
            zero_centered_gamma=zero_centered_gamma, activation=activation, normalization=normalization,
            device=device, name=_sub(name, "layernorm_mlp"), **ub_flags)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0.0 else None
        if self.output_layernorm:
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, sequence_parallel=self.sequence_parallel,
                                  params_dtype=params_dtype, zero_centered_gamma=zero_centered_gamma, device=device)

    def set_tensor_parallel_group(self, tp_group):
        """TE's setter: every sublayer's collectives use `tp_group` from now on."""
        self.tp = TPConfig(None, self.tp.sp, tp_group, self.tp.size)
        for child in self.modules():
            if child is not self and hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream=None, cp_comm_type="p2p"):
        """TE's setter: the attention layers split each sequence over the group."""
        for child in self.children():
            if hasattr(child, "set_context_parallel_group"):
                child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def reset_fp8_meta_tensors(self):
        for child in self.modules():
            if child is not self and hasattr(child, "reset_fp8_meta_tensors"):
                child.reset_fp8_meta_tensors()

    def _dropout_add(self, x, residual, drop_path=None):
        """residual + drop_path(dropout(x)), x holding the projection's bias
        (TE's bias-dropout-add); the dropouts only where they do something."""
        if self.training and self.hidden_dropout > 0.0:
            x = torch.nn.functional.dropout(x, p=self.hidden_dropout, training=True)
        if drop_path is not None:
            x = drop_path(x)
        return residual + x

    def forward(self, hidden_states, attention_mask=None, self_attn_mask_type=None, window_size=None,
                encoder_output=None, enc_dec_attn_mask=None, enc_dec_attn_mask_type=None, enc_dec_window_size=None,
                is_first_microbatch=None, checkpoint_core_attention=False, inference_params=None,
                rotary_pos_emb=None, core_attention_bias_type="no_bias", core_attention_bias=None,
                alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None, fast_zero_fill=True,
                pad_between_seqs=None):
        """hidden_states [s, b, hidden] (sbhd; this rank's part of the
        sequence under sequence parallelism), [b, s, hidden] (bshd) or
        [t, hidden] (thd, with cu_seqlens_q). Returns the layer's output, of
        the input's shape."""
        self_mask = self.self_attn_mask_type if self_attn_mask_type is None else _mask_type(
            "self_attn_mask_type", self_attn_mask_type)
        window_size = self.window_size if window_size is None else window_size
        enc_mask = self.enc_dec_attn_mask_type if enc_dec_attn_mask_type is None else _mask_type(
            "enc_dec_attn_mask_type", enc_dec_attn_mask_type)
        if inference_params is not None:
            raise NotImplementedError("TransformerLayer: inference_params (KV-cache inference) is not supported")
        hidden_states = hidden_states.contiguous()
        if self.sequence_parallel and self.seq_length is not None \
                and hidden_states.shape[0] != self.seq_length // self.tp_size:
            raise ValueError(f"TransformerLayer: under sequence parallelism hidden_states holds this rank's "
                             f"{self.seq_length // self.tp_size} of {self.seq_length} positions, got "
                             f"{hidden_states.shape[0]}")
        if attention_mask is not None and ("padding" in self_mask or self_mask == "arbitrary"):
            _check_mask(attention_mask, "attention_mask")
        if enc_dec_attn_mask is not None and ("padding" in enc_mask or enc_mask == "arbitrary"):
            _check_mask(enc_dec_attn_mask, "enc_dec_attn_mask")
        if _any_autocast():
            device_type = hidden_states.device.type
            if torch.is_autocast_enabled(device_type):
                hidden_states = hidden_states.to(torch.get_autocast_dtype(device_type))

        # The sublayers get the arguments that differ from their defaults (TE's, as here): every keyword
        # passed costs host time on every call.
        common = {} if is_first_microbatch is None else {"is_first_microbatch": is_first_microbatch}
        if (checkpoint_core_attention or rotary_pos_emb is not None or core_attention_bias_type != "no_bias"
                or core_attention_bias is not None or alibi_slopes is not None or not fast_zero_fill
                or pad_between_seqs is not None):
            common.update(checkpoint_core_attention=checkpoint_core_attention, rotary_pos_emb=rotary_pos_emb,
                          core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
                          alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill,
                          pad_between_seqs=pad_between_seqs)
        modules = self._modules  # not nn.Module.__getattr__ (several dict lookups, every call)
        attention = modules["self_attention"]
        kw = dict(common)
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        # else the attention's own (the same); a wrapped or replaced attention gets them always
        if self_mask != getattr(attention, "attn_mask_type", None):
            kw["attn_mask_type"] = self_mask
        if window_size is not getattr(attention, "window_size", _ABSENT):
            kw["window_size"] = window_size
        if cu_seqlens_q is not None or cu_seqlens_q_padded is not None or max_seqlen_q is not None:
            kw.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_q, cu_seqlens_q_padded=cu_seqlens_q_padded,
                      cu_seqlens_kv_padded=cu_seqlens_q_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_q)
        attn_out = attention(hidden_states, **kw)
        if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            out, residual = attn_out
            hidden_states = self._dropout_add(out, residual, self.drop_path)
        elif not self.parallel_attention_mlp:
            hidden_states = self._dropout_add(attn_out, hidden_states, self.drop_path)

        if self.layer_type == "decoder":
            enc_window = self.enc_dec_window_size if enc_dec_window_size is None else enc_dec_window_size
            cross = self.inter_attention(
                hidden_states, attention_mask=enc_dec_attn_mask, attn_mask_type=enc_mask, window_size=enc_window,
                encoder_output=encoder_output, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, **common)
            if self.apply_residual_connection_post_layernorm:
                out, residual = cross
            else:
                out, residual = cross, hidden_states
            hidden_states = self._dropout_add(out, residual)

        mlp = modules["layernorm_mlp"]
        mlp_out = mlp(hidden_states) if is_first_microbatch is None else mlp(
            hidden_states, is_first_microbatch=is_first_microbatch)
        if self.apply_residual_connection_post_layernorm:
            out, residual = mlp_out
            output = self._dropout_add(out, residual, self.drop_path)
        elif self.parallel_attention_mlp:
            output = self._dropout_add(attn_out + mlp_out, hidden_states, self.drop_path)
        else:
            output = self._dropout_add(mlp_out, hidden_states, self.drop_path)
        if self.output_layernorm:
            output = self.layernorm(output)
        return output
