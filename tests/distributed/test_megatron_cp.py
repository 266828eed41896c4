"""Megatron-Core's GPT model at context_parallel_size=2 through the
`transformer_engine` alias (run_megatron_cp.py): a step's loss and
gradients equal the same model's at context_parallel_size=1 for the p2p,
all_gather and a2a comm types, and Megatron's DDP and optimizer train it.
Skipped only when megatron-core is not installed."""
import importlib.util

import pytest
from launch import run_torchrun, torchrun

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                    or importlib.util.find_spec("megatron.core") is None,
                                    reason="megatron-core is not installed")


@needs_megatron
def test_megatron_gpt_cp2_matches_cp1():
    out = run_torchrun("run_megatron_cp.py", 2, timeout=600,
                       pass_line="PASS run_megatron_cp (CP=2, p2p,all_gather,a2a)")
    for kind in ("p2p", "all_gather", "a2a"):
        assert f"CP=2 {kind}: loss" in out and "29 gradients" in out, out[-3000:]


@needs_megatron
def test_megatron_cp_checker_catches_a_wrong_gradient():
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    proc = torchrun("run_megatron_cp.py", 2, ["--corrupt", name, "--cp-comm-types", "p2p", "--steps", "1"],
                    timeout=600)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert f"p2p: {name} gradient relative error" in proc.stdout, proc.stdout[-3000:]
