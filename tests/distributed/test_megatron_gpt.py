"""Megatron-Core (the real package from PyPI, a test dependency) on this
package through the `transformer_engine` alias: its TE GPT layer spec, a
2-layer GPTModel at TP=2 with sequence parallelism on the CPU (gloo)
against a float64 reference, and training with Megatron's DDP and optimizer
(run_megatron_gpt.py), initialised on the CPU (use_cpu_initialization) and
as a CUDA run initialises (each layer its shard under the per-rank RNG
fork). Skipped only when megatron-core is not installed."""
import importlib.util
import os
import subprocess
import sys

import pytest
from launch import ROOT, gpu_count, run_torchrun, torchrun

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                                    "(pip install 'megatron-core==0.16.*' on CPython 3.11, 0.19.* on 3.12)")


@needs_megatron
@pytest.mark.parametrize("init", ["cpu", "device"])
def test_megatron_gpt_tp2_sequence_parallel_cpu(init):
    out = run_torchrun("run_megatron_gpt.py", 2, ["--init", init], timeout=600,
                       pass_line="PASS run_megatron_gpt (TP=2, cpu)")
    assert "compared loss and 29 parameter gradients" in out and f"init {init}" in out, out[-3000:]
    assert "plain: loss" in out and "largest gradient error" in out, out[-3000:]


@needs_megatron
def test_megatron_gpt_checker_catches_a_wrong_gradient():
    name = "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    proc = torchrun("run_megatron_gpt.py", 2, ["--corrupt", name, "--steps", "1"], timeout=600)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert f"plain: {name} gradient relative error" in proc.stdout, proc.stdout[-3000:]


@needs_megatron
def test_megatron_gpt_checker_catches_unequal_replicated_parameters():
    """Seeded only as Megatron-Core seeds (not the CPU generator, which
    PyTorch seeds per process), the position embeddings differ across the
    ranks: the run must fail naming them, before comparing gradients."""
    proc = torchrun("run_megatron_gpt.py", 2, ["--skip-cpu-seed", "--init", "device", "--steps", "1"], timeout=600)
    assert proc.returncode != 0, proc.stdout[-3000:]
    want = ("replicated parameter before the first step: embedding.position_embeddings.weight differs across "
            "the tensor-parallel ranks")
    assert want in proc.stdout, proc.stdout[-3000:]


@needs_megatron
def test_megatron_moe_grouped_experts_and_fused_router():
    """TEGroupedMLP over GroupedLinear and the fused router (this package's
    router functions) against Megatron's own sequential experts and PyTorch
    router, same weights; the negative case doubles the fused aux loss."""
    run_torchrun("run_megatron_moe.py", 2, timeout=600, pass_line="PASS run_megatron_moe (TP=EP=2)")
    proc = torchrun("run_megatron_moe.py", 2, ["--break-aux-loss"], timeout=600)
    assert proc.returncode != 0 and "mlp.router.weight: gradient relative error" in proc.stdout, proc.stdout[-3000:]


@needs_megatron
@pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("init", ["device", "cpu"])
def test_megatron_gpt_cuda(init):
    """TP=1 on one GPU, or TP=N with TEC_SHARE_GPU=N ranks sharing it; the
    layers initialised on the GPU, or on the CPU and moved."""
    n = max(1, min(gpu_count(), 2))
    run_torchrun("run_megatron_gpt.py", n, ["--device", "cuda", "--init", init], timeout=600,
                 pass_line=f"PASS run_megatron_gpt (TP={n}, cuda)")


@needs_megatron
def test_alias_runner_under_torchrun_and_env():
    """The launcher forms: `torchrun -m transformer_engine_c.alias SCRIPT` and
    TEC_AS_TRANSFORMER_ENGINE=1 with the alias's site directory on
    PYTHONPATH; each worker imports megatron.core with the alias."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_alias_check.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    site = subprocess.run([sys.executable, "-m", "transformer_engine_c.alias", "--pythonpath"], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.isfile(os.path.join(site, "sitecustomize.py")), site
    for extra_env, cmd in (({}, ["-m", "transformer_engine_c.alias", script]),
                           ({"TEC_AS_TRANSFORMER_ENGINE": "1",
                             "PYTHONPATH": os.pathsep.join([site, env["PYTHONPATH"]])}, [script])):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               "--standalone", *cmd], env={**env, **extra_env},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.stdout.count("alias ok") == 2, proc.stdout[-3000:]
