"""Megatron-Core's GPT model at context_parallel_size=2 through the
`transformer_engine` alias (run_megatron_cp.py): a step's loss and
gradients equal the same model's at context_parallel_size=1 for the p2p,
all_gather and a2a comm types and for packed sequences (thd), and
Megatron's DDP and optimizer train it;
at four ranks the same with tensor parallelism 2 inside.
Skipped only when megatron-core is not installed."""
import importlib.util

import pytest
from launch import gpu_count, run_torchrun

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                    or importlib.util.find_spec("megatron.core") is None,
                                    reason="megatron-core is not installed")


@needs_megatron
def test_megatron_gpt_cp2_matches_cp1():
    out = run_torchrun("run_megatron_cp.py", 2, ["--packed"], timeout=600,
                       pass_line="PASS run_megatron_cp (CP=2, TP=1, p2p,all_gather,a2a, cpu)")
    assert "packed CP=2 TP=1 p2p: loss" in out, out[-3000:]
    for kind in ("p2p", "all_gather", "a2a"):
        assert f"CP=2 TP=1 {kind}: loss" in out and "29 gradients" in out, out[-3000:]
    # the comparison's negative test (in the same run): a gradient scaled by 1.001 is reported
    assert "negative check: decoder.layers.1.self_attention.linear_qkv.weight scaled by 1.001 is reported" in out


@needs_megatron
def test_megatron_gpt_tp2_cp2_matches_cp1():
    """Four ranks: tensor parallelism 2 with sequence parallelism inside
    context parallelism 2, against the same TP=2 model at CP=1 (a2a cannot
    split the one key/value head a TP rank holds here)."""
    out = run_torchrun("run_megatron_cp.py", 4, ["--tp", "2", "--cp-comm-types", "p2p,all_gather", "--steps", "2"],
                       timeout=600, pass_line="PASS run_megatron_cp (CP=2, TP=2, p2p,all_gather, cpu)")
    assert "CP=2 TP=2 p2p: loss" in out and "CP=2 TP=2 all_gather: loss" in out, out[-3000:]


@needs_megatron
@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 CUDA ranks (GPUs, or TEC_SHARE_GPU=2)")
def test_megatron_gpt_cp2_cuda():
    run_torchrun("run_megatron_cp.py", 2, ["--device", "cuda", "--packed"], timeout=600,
                 pass_line="PASS run_megatron_cp (CP=2, TP=1, p2p,all_gather,a2a, cuda)")
