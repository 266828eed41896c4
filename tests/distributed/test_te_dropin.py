"""TransformerEngine's own BF16/FP32 Linear and LayerNormLinear distributed
tests, mirrored case by case (run_te_numerics.py: TE's run_numerics.py;
run_te_layer_overlap.py: TE's run_layer_with_overlap.py BF16 cases), launched
under torchrun: on CPU with gloo at 2 ranks, at 4 ranks as two tensor-parallel
domains of 2 (tp < world), and on CUDA with NCCL where the GPUs are there
(overlap forced at TE's small shapes with TEC_UB_MIN_CHUNK_FLOPS=0)."""
import pytest
import torch

from launch import gpu_count, run_torchrun

OVERLAP_CASES = ["Linear row", "Linear column BULK DGRAD/WGRAD", "Linear column DGRAD+RS",
                 "LayerNormLinear row", "LayerNormLinear column BULK DGRAD/WGRAD",
                 "LayerNormLinear column DGRAD+RS"]


def _need_gpus(n):
    if gpu_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, this machine has {gpu_count()}")


@pytest.fixture
def forced_overlap(monkeypatch):
    """TE's test shapes are below the GPU's fallback threshold: force overlap."""
    monkeypatch.setenv("TEC_UB_MIN_CHUNK_FLOPS", "0")


def _check_numerics(out, tp):
    assert f"tp={tp}" in out
    # TE's cases, one line each (the runner prints "ok <case>" only when it passed)
    for mode in ("column", "row"):
        for sp in (False, True):
            for kw in ("defaults", "bias=False", "init_method=constant_init", "fuse_wgrad_accumulation=True",
                       "return_bias=True", "params_dtype=torch.float16", "delay_wgrad_compute=True"):
                assert f"ok Linear {mode} sp={sp} {kw}\n" in out, (mode, sp, kw)
    for sp in (False, True):
        for kw in ("defaults", "bias=False", "init_method=constant_init", "fuse_wgrad_accumulation=True",
                   "return_bias=True", "params_dtype=torch.float16", "zero_centered_gamma=False",
                   "return_layernorm_output=True", "delay_wgrad_compute=True"):
            assert f"ok LayerNormLinear column sp={sp} {kw}\n" in out, (sp, kw)


def test_te_numerics():
    out = run_torchrun("run_te_numerics.py", 2, timeout=300)
    _check_numerics(out, 2)


def test_te_numerics_cuda():
    _need_gpus(2)
    out = run_torchrun("run_te_numerics.py", 2, ["--device", "cuda"], timeout=300)
    _check_numerics(out, 2)


def _check_overlap(out, tp):
    for case in OVERLAP_CASES:
        assert f"ok {case} tp={tp}\n" in out, case


@pytest.mark.parametrize("nproc,tp", [(2, None), (4, 2)], ids=["tp2", "tp2-of-4"])
def test_te_layers_with_overlap(nproc, tp):
    args = ["--all"] + (["--tp", str(tp)] if tp else [])
    out = run_torchrun("run_te_layer_overlap.py", nproc, args, timeout=300)
    _check_overlap(out, tp or nproc)


@pytest.mark.parametrize("nproc,tp", [(2, None), (4, 2)], ids=["tp2", "tp2-of-4"])
def test_te_layers_with_overlap_cuda(nproc, tp, forced_overlap):
    _need_gpus(nproc)
    args = ["--all", "--device", "cuda"] + (["--tp", str(tp)] if tp else [])
    out = run_torchrun("run_te_layer_overlap.py", nproc, args, timeout=300)
    _check_overlap(out, tp or nproc)


def _check_overlap_fp8(out, recipe, tp):
    for case in OVERLAP_CASES:
        assert f"ok {case} fp8={recipe} tp={tp}\n" in out, case


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_layers_with_overlap_fp8(recipe):
    """TE's test_layers_with_overlap_fp8: FP8 overlap against FP8 without
    overlap (three steps, and equal delayed-scaling scales afterwards)."""
    out = run_torchrun("run_te_layer_overlap.py", 2, ["--all", "--fp8", recipe], timeout=300)
    _check_overlap_fp8(out, recipe, 2)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_layers_with_overlap_fp8_cuda(recipe, forced_overlap):
    _need_gpus(2)
    out = run_torchrun("run_te_layer_overlap.py", 2, ["--all", "--fp8", recipe, "--device", "cuda"], timeout=300)
    _check_overlap_fp8(out, recipe, 2)


def _check_overlap_fp8_buf(out, recipe, tp):
    for case in OVERLAP_CASES:
        assert f"ok {case} fp8={recipe} fp8_buf tp={tp}\n" in out, case


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_layers_with_overlap_fp8_buf(recipe):
    """The same with ub_cfgs fp8_buf on proj_fprop and fc2_fprop: under
    DelayedScaling the row layers' forward reduce-scatters send FP8 partials
    (their bytes counted, the output role's amax recorded), under current
    scaling compute-dtype ones; TE's FP8 tolerances against no overlap."""
    out = run_torchrun("run_te_layer_overlap.py", 2, ["--all", "--fp8", recipe, "--fp8-buf"], timeout=300)
    _check_overlap_fp8_buf(out, recipe, 2)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_layers_with_overlap_fp8_buf_cuda(recipe, forced_overlap):
    _need_gpus(2)
    out = run_torchrun("run_te_layer_overlap.py", 2, ["--all", "--fp8", recipe, "--fp8-buf", "--device", "cuda"],
                       timeout=300)
    _check_overlap_fp8_buf(out, recipe, 2)


def test_compare_is_te_worst_element_rule():
    """The runners' comparison (TE's _compare_tensors) catches what it must
    and passes what TE passes."""
    import run_te_numerics
    from common import compare
    ref = torch.linspace(-2, 2, 101)
    assert compare("same", ref.clone(), ref, 0.025, 0.00125) is None
    off = ref.clone()
    off[70] *= 1.1  # 10% off at an element of size ~0.8
    assert "off at" in compare("one element", off, ref, 0.025, 0.00125)
    tiny = ref.clone()
    tiny[50] += 1e-3  # the reference is 0 there: relatively huge, absolutely under atol
    assert compare("below atol", tiny, ref, 0.025, 0.00125) is None
    assert "zero tensor" in compare("zeros", torch.zeros_like(ref), ref, 0.025, 0.00125)
    assert "non-finite" in compare("nan", ref.clone().fill_(float("nan")), ref, 0.025, 0.00125)
    assert "elements" in compare("shape", ref[:50], ref, 0.025, 0.00125)
    assert run_te_numerics.tolerances(torch.bfloat16) == (1.6e-2, 1e-5)
