import pytest
import torch

CUDA_SKIP = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA GPU on this machine (GPU tests run on the GPU machines)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_SKIP)]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
