"""Linear / LayerNormLinear with userbuffers overlap vs the same layers
without overlap, and a two-block model, under torchrun on CPU (gloo + the
shared-memory transport). One launch per TP size runs every configuration
(row rs/ag, column rs_dgrad, column bulk, LayerNormLinear ag+bulk and
ag+rs_dgrad with both norms, fp32 and bf16, the small-shape fallback)."""
import pytest

from launch import gpu_count, run_torchrun


@pytest.mark.parametrize("nproc", [2, 4])
def test_comm_gemm_overlap(nproc):
    out = run_torchrun("run_layer_with_overlap.py", nproc, ["--dtypes", "float32,bfloat16"], timeout=300,
                       pass_line="PASS run_layer_with_overlap")
    for check in ("construction", "layers", "fallback", "model", "mlp_model"):
        assert f"ok {check} tp={nproc}" in out


@pytest.mark.parametrize("nproc", [2, 4])
def test_comm_gemm_overlap_cuda(nproc):
    if gpu_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs, this machine has {gpu_count()}")
    out = run_torchrun("run_layer_with_overlap.py", nproc, ["--device", "cuda", "--dtypes", "float32,bfloat16"],
                       timeout=300, pass_line="PASS run_layer_with_overlap")
    for check in ("construction", "layers", "fallback", "model", "mlp_model"):
        assert f"ok {check} tp={nproc}" in out
