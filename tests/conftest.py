import pytest
import torch

# one broken CUDA state stops the run at once, naming the test (tests/_cuda_state.py)
from _cuda_state import pytest_collection_modifyitems, pytest_runtest_logreport, pytest_runtest_protocol  # noqa: F401

CUDA_SKIP = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA GPU on this machine (GPU tests run on the GPU machines)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_SKIP)]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True, scope="session")
def _custom_op_aliasing_is_an_error():
    """A compiled graph checks that the package's operators return no output
    sharing storage with an argument or another output. torch reports a
    violation as an error only where the environment says CI, else as a
    warning that a test may ignore: here it is always an error."""
    import torch._functorch.config as aot_config
    if not hasattr(aot_config, "error_on_custom_op_aliasing"):  # torch without the check
        yield
        return
    with aot_config.patch(error_on_custom_op_aliasing=True):
        yield
