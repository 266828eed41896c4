"""TransformerEngine's `InferenceParams` (the KV cache of incremental
decoding), for code that imports and builds it: it keeps TE's
constructor arguments, and every use of the cache raises
NotImplementedError naming InferenceParams, as DotProductAttention does for
a forward given `inference_params` (KV-cache inference is not offered)."""
import torch

__all__ = ["InferenceParams"]


def _refuse(what):
    raise NotImplementedError(f"InferenceParams.{what}: KV-cache inference (InferenceParams) is not supported by "
                              "transformer_engine_c; run the full sequence without inference_params")


class InferenceParams:
    """TE's KV-cache state (its constructor's arguments, kept as given)."""

    def __init__(self, max_batch_size, max_sequence_length, num_heads_kv=None, head_dim_k=None, dtype=None,
                 head_dim_v=None, is_paged=False, total_num_pages=None, page_size=None, max_ctx_len=None,
                 qkv_format="bshd", custom_cache_manager=None):
        for name, v in (("max_batch_size", max_batch_size), ("max_sequence_length", max_sequence_length)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"InferenceParams: {name} must be a positive int, got {v!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"InferenceParams: dtype must be a torch.dtype or None, got {dtype!r}")
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.num_heads_kv, self.head_dim_k, self.head_dim_v, self.dtype = num_heads_kv, head_dim_k, head_dim_v, dtype
        self.is_paged, self.total_num_pages, self.page_size = bool(is_paged), total_num_pages, page_size
        self.max_ctx_len, self.input_qkv_format = max_ctx_len, qkv_format
        self.custom_cache_manager = custom_cache_manager
        self.sequences = {}

    def reset(self):
        _refuse("reset")

    def allocate_memory(self, layer_number):
        _refuse("allocate_memory")

    def pre_step(self, step_dict):
        _refuse("pre_step")

    def step(self, layer_number, new_k, new_v, qkv_format):
        _refuse("step")

    def get_seqlens_pre_step(self):
        _refuse("get_seqlens_pre_step")

    def convert_paged_to_nonpaged(self, layer_number):
        _refuse("convert_paged_to_nonpaged")
