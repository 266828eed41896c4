"""TransformerEngine's MXFP8 and NVFP4 quantizer and tensor classes, which
need a Blackwell GPU (sm_100) and are not offered by this package. The
quantizers construct with TE's arguments, as TE's do on any GPU, so that
code can build them ahead of time (a parametrize list, a recipe's factory)
and skip where `check_mxfp8_support()` / `check_nvfp4_support()` answer
False, as they always do here; quantizing with one raises
NotImplementedError naming the format. The tensor classes exist for
`isinstance` (never true here); constructing one raises."""
from ..constants import DType
from .float8_tensor import _fp8_dtype
from .quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer

__all__ = ["MXFP8Quantizer", "MXFP8Tensor", "MXFP8TensorStorage", "NVFP4Quantizer", "NVFP4Tensor",
           "NVFP4TensorStorage"]

_FORMATS = {"MXFP8": "MXFP8 (32-element blocks with E8M0 scales)",
            "NVFP4": "NVFP4 (FP4 E2M1 with 16-element blocks)"}


def _refuse(name, what=""):
    fmt = "MXFP8" if name.startswith("MXFP8") else "NVFP4"
    raise NotImplementedError(f"{name}{what}: {_FORMATS[fmt]} is Blackwell's (sm_100) format, which "
                              "transformer_engine_c does not offer (check_mxfp8_support / check_nvfp4_support "
                              "answer False); use Float8CurrentScaling, DelayedScaling or Float8BlockScaling")


class _BlackwellQuantizer(Quantizer):
    """TE's usage flags and call forms; every form that would quantize raises."""

    def __init__(self, rowwise, columnwise):
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        self.internal = False

    def set_usage(self, *, rowwise=None, columnwise=None):
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def copy(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __call__(self, tensor):
        _refuse(type(self).__name__, " cannot quantize")

    def quantize(self, tensor, *, out=None):
        _refuse(type(self).__name__, ".quantize")

    def update_quantized(self, src, dst, *, noop_flag=None):
        _refuse(type(self).__name__, ".update_quantized")

    def make_empty(self, shape, *, dtype=None, device=None, requires_grad=False):
        _refuse(type(self).__name__, ".make_empty")

    def __repr__(self):
        return (f"{type(self).__name__}(dtype={self.dtype}, rowwise_usage={self.rowwise_usage}, "
                f"columnwise_usage={self.columnwise_usage}, not offered)")


class MXFP8Quantizer(_BlackwellQuantizer):
    """TE's MXFP8 quantizer: constructs as TE's (`fp8_dtype` a DType or a
    torch float8 dtype); quantizing raises NotImplementedError."""

    def __init__(self, fp8_dtype, *, rowwise=True, columnwise=True):
        try:
            self.dtype = _fp8_dtype(fp8_dtype)
        except (TypeError, ValueError) as e:
            raise ValueError(f"MXFP8Quantizer: fp8_dtype must be DType.kFloat8E4M3 / kFloat8E5M2 or a torch "
                             f"float8 dtype, got {fp8_dtype!r}") from e
        super().__init__(rowwise, columnwise)


class NVFP4Quantizer(_BlackwellQuantizer):
    """TE's NVFP4 quantizer: constructs with TE's arguments (kept as
    attributes of the same names); quantizing raises NotImplementedError."""

    def __init__(self, fp4_dtype=None, rowwise=True, columnwise=True, with_amax_reduction=False,
                 amax_reduction_group=None, with_rht=False, with_post_rht_amax=False, with_2d_quantization=False,
                 stochastic_rounding=False, with_random_sign_mask=True, **options):
        if fp4_dtype is None:
            fp4_dtype = DType.kFloat4E2M1
        if fp4_dtype != DType.kFloat4E2M1:
            raise ValueError(f"NVFP4Quantizer: fp4_dtype must be DType.kFloat4E2M1, got {fp4_dtype!r}")
        self.dtype = DType.kFloat4E2M1
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.with_rht = bool(with_rht)
        self.with_post_rht_amax = bool(with_post_rht_amax)
        self.with_2d_quantization = bool(with_2d_quantization)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.with_random_sign_mask = bool(with_random_sign_mask)
        self.options = dict(options)
        super().__init__(rowwise, columnwise)


class MXFP8TensorStorage(QuantizedTensorStorage):
    """TE's MXFP8 storage class (not offered: construction raises)."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__)


class NVFP4TensorStorage(QuantizedTensorStorage):
    """TE's NVFP4 storage class (not offered: construction raises)."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__)


class MXFP8Tensor(MXFP8TensorStorage, QuantizedTensor):
    """TE's MXFP8 tensor (not offered: construction raises)."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__)


class NVFP4Tensor(NVFP4TensorStorage, QuantizedTensor):
    """TE's NVFP4 tensor (not offered: construction raises)."""

    def __new__(cls, *args, **kwargs):
        _refuse(cls.__name__)
