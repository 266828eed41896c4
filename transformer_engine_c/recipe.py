"""TransformerEngine's quantization recipes (TE 2.x fields and defaults).

DelayedScaling and Float8CurrentScaling drive the per-tensor FP8 of
quantization.py and tensor/float8_tensor.py, Float8BlockScaling the block
scales of tensor/float8_blockwise_tensor.py. MXFP8BlockScaling and
NVFP4BlockScaling can be built (code written for TE constructs them) but an
autocast that enables one raises NotImplementedError naming it (see
`unsupported_reason`)."""
import dataclasses
import enum
import os
import typing

__all__ = ["Format", "QParams", "MMParams", "Recipe", "DelayedScaling", "Float8CurrentScaling",
           "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling"]


class _FormatHelper(typing.NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8 formats: E4M3 (forward and backward), E5M2, and HYBRID (E4M3
    forward, E5M2 backward). The value holds the largest finite values
    (max_fwd, max_bwd), as TE's."""
    E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
    E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = _FormatHelper(max_fwd=448.0, max_bwd=57344.0)


@dataclasses.dataclass()
class QParams:
    """How one tensor role is quantized under current or block scaling:
    scales rounded down to powers of two, and a floor for the amax."""
    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if not isinstance(self.amax_epsilon, (int, float)) or not self.amax_epsilon >= 0:
            raise ValueError(f"QParams.amax_epsilon must be a float >= 0, got {self.amax_epsilon!r}")


@dataclasses.dataclass()
class MMParams:
    """How one GEMM runs: use_split_accumulator False is cuBLASLt's fast
    FP8 accumulation (TE's fprop default), True the split accumulator."""
    use_split_accumulator: bool = True


def _check_format(recipe, allowed):
    if not isinstance(recipe.fp8_format, Format):
        raise TypeError(f"{type(recipe).__name__}.fp8_format must be a recipe.Format, got {recipe.fp8_format!r}")
    if recipe.fp8_format not in allowed:
        raise ValueError(f"{type(recipe).__name__}: fp8_format {recipe.fp8_format.name} is not supported "
                         f"(expected {' or '.join(f.name for f in allowed)}); pure E5M2 training is not supported")


class Recipe:
    """Base of the recipes; the predicates say which one it is, as in TE."""

    def delayed(self):
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self):
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self):
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def mxfp8(self):
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self):
        return isinstance(self, Float8BlockScaling)

    def nvfp4(self):
        return isinstance(self, NVFP4BlockScaling)

    def custom(self):
        return False

    def unsupported_reason(self):
        """None if this package can compute with the recipe, else why not."""
        return None


@dataclasses.dataclass()
class DelayedScaling(Recipe):
    """Per-tensor scales from the amax history of earlier steps.

    Each step's scale is fp8_max / amax / 2^margin, amax being the history's
    maximum ("max"), its latest entry ("most_recent") or what a callable
    returns (called with the [history_len, n] history tensor, returning
    [n]); scaling_factor_compute_algo(amax, scale, fp8_max, recipe), if
    given, replaces that rule. An amax of 0, inf or NaN keeps the old scale.
    reduce_amax: max-reduce the forward amaxes over the autocast's group when
    the outermost autocast exits (and the backward ones in the first
    module's backward)."""
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: typing.Union[str, typing.Callable] = "max"
    scaling_factor_compute_algo: typing.Optional[typing.Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self, (Format.HYBRID, Format.E4M3))
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be a number >= 0, got {self.margin!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError("DelayedScaling.amax_compute_algo must be 'max', 'most_recent' or a callable, got "
                             f"{self.amax_compute_algo!r}")
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise ValueError("DelayedScaling.scaling_factor_compute_algo must be None or a callable, got "
                             f"{self.scaling_factor_compute_algo!r}")
        if self.fp8_dpa or self.fp8_mha:
            raise NotImplementedError("DelayedScaling(fp8_dpa / fp8_mha): FP8 attention is not part of "
                                      "transformer_engine_c")

    def __repr__(self):
        return (f"recipe_type={type(self).__name__}, margin={self.margin}, format={self.fp8_format.name}, "
                f"amax_history_len={self.amax_history_len}, fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}")


@dataclasses.dataclass()
class Float8CurrentScaling(Recipe):
    """Per-tensor scales from each tensor's own amax at every cast."""
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = dataclasses.field(default_factory=QParams)
    fp8_quant_fwd_weight: QParams = dataclasses.field(default_factory=QParams)
    fp8_quant_bwd_grad: QParams = dataclasses.field(default_factory=QParams)
    fp8_gemm_fprop: MMParams = dataclasses.field(default_factory=lambda: MMParams(use_split_accumulator=False))
    fp8_gemm_dgrad: MMParams = dataclasses.field(default_factory=lambda: MMParams(use_split_accumulator=True))
    fp8_gemm_wgrad: MMParams = dataclasses.field(default_factory=lambda: MMParams(use_split_accumulator=True))
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self, (Format.HYBRID, Format.E4M3))
        if self.fp8_dpa or self.fp8_mha:
            raise NotImplementedError("Float8CurrentScaling(fp8_dpa / fp8_mha): FP8 attention is not part of "
                                      "transformer_engine_c")

    def __repr__(self):
        return (f"recipe_type={type(self).__name__}, format={self.fp8_format.name}, "
                f"fp8_quant_fwd_inp={self.fp8_quant_fwd_inp}, fp8_quant_fwd_weight={self.fp8_quant_fwd_weight}, "
                f"fp8_quant_bwd_grad={self.fp8_quant_bwd_grad}")


@dataclasses.dataclass()
class MXFP8BlockScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def unsupported_reason(self):
        return ("MXFP8BlockScaling is a Blackwell format (sm_100: E8M0 scales per 32 elements); "
                "transformer_engine_c offers DelayedScaling, Float8CurrentScaling and Float8BlockScaling")


def _f32_block_scales():
    """TE's NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1: Float8BlockScaling's
    default QParams keep fp32 scales instead of powers of two (read when
    this module is imported, as TE does)."""
    return os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"


_BLOCK_F32_SCALES = _f32_block_scales()


def _block_qparams():
    return QParams(power_2_scale=not _BLOCK_F32_SCALES, amax_epsilon=0.0)


@dataclasses.dataclass()
class Float8BlockScaling(Recipe):
    """Block scales (TE 2.x): 1x128 blocks for activations and gradients,
    128x128 for weights (x/w/grad_block_scaling_dim 1, 2, 1; any of them
    may be 1 or 2, but no GEMM may take two 128x128 operands), each block's
    scale from its own amax, powers of two unless
    NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1. Every GEMM uses the split
    accumulator. The rowwise and columnwise copies of a 1x128-scaled tensor
    are each quantized from the high-precision values."""
    use_f32_scales: bool = _BLOCK_F32_SCALES
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = dataclasses.field(default_factory=_block_qparams)
    fp8_quant_fwd_weight: QParams = dataclasses.field(default_factory=_block_qparams)
    fp8_quant_bwd_grad: QParams = dataclasses.field(default_factory=_block_qparams)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = dataclasses.field(default_factory=lambda: MMParams(use_split_accumulator=True))
    fp8_gemm_dgrad: MMParams = dataclasses.field(default_factory=lambda: MMParams(use_split_accumulator=True))
    fp8_gemm_wgrad: MMParams = dataclasses.field(default_factory=lambda: MMParams(use_split_accumulator=True))
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self, (Format.E4M3, Format.HYBRID))
        dims = {}
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or v not in (1, 2):
                raise ValueError(f"Float8BlockScaling.{name} must be 1 (1x128 blocks) or 2 (128x128), got {v!r}")
            dims[name] = v
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if dims[f"{a}_block_scaling_dim"] == 2 and dims[f"{b}_block_scaling_dim"] == 2:
                raise ValueError(f"Float8BlockScaling: {a}_block_scaling_dim and {b}_block_scaling_dim cannot both "
                                 "be 2 (a GEMM of two 128x128-scaled operands is not supported)")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, name).use_split_accumulator:
                raise ValueError(f"Float8BlockScaling.{name}: block scaling requires use_split_accumulator=True")
        if self.fp8_dpa or self.fp8_mha:
            raise NotImplementedError("Float8BlockScaling(fp8_dpa / fp8_mha): FP8 attention is not supported for "
                                      "Float8BlockScaling")

    def __repr__(self):
        return (f"recipe_type={type(self).__name__}, format={self.fp8_format.name}, "
                f"fp8_quant_fwd_inp={self.fp8_quant_fwd_inp}, fp8_quant_fwd_weight={self.fp8_quant_fwd_weight}, "
                f"fp8_quant_bwd_grad={self.fp8_quant_bwd_grad}, x_block_scaling_dim={self.x_block_scaling_dim}, "
                f"w_block_scaling_dim={self.w_block_scaling_dim}, "
                f"grad_block_scaling_dim={self.grad_block_scaling_dim}, fp8_gemm_fprop={self.fp8_gemm_fprop}, "
                f"fp8_gemm_dgrad={self.fp8_gemm_dgrad}, fp8_gemm_wgrad={self.fp8_gemm_wgrad}, "
                f"fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}")


@dataclasses.dataclass()
class NVFP4BlockScaling(Recipe):
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def unsupported_reason(self):
        return ("NVFP4BlockScaling is a Blackwell format (sm_100: FP4 with E4M3 scales per 16 elements); "
                "transformer_engine_c offers DelayedScaling, Float8CurrentScaling and Float8BlockScaling")


# ---- a recipe as a constant of a compiled graph

_SPEC_TYPES = {}


def spec(recipe):
    """The recipe as nested tuples of plain values (`from_spec` rebuilds an
    equal one): how an autocast entered inside a compiled function names its
    recipe to the operators. TypeError for a field that is not a plain value
    (a callable amax_compute_algo)."""
    if dataclasses.is_dataclass(recipe):
        return (type(recipe).__name__,
                tuple((f.name, spec(getattr(recipe, f.name))) for f in dataclasses.fields(recipe)))
    if isinstance(recipe, Format):
        return ("Format", recipe.name)
    if recipe is None or isinstance(recipe, (bool, int, float, str)):
        return recipe
    raise TypeError(f"a recipe field of type {type(recipe).__name__} is not a plain value")


def from_spec(value):
    """The recipe (or field value) `spec` described."""
    if isinstance(value, tuple):
        name, body = value
        if name == "Format":
            return Format[body]
        cls = {c.__name__: c for c in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling,
                                       NVFP4BlockScaling, QParams, MMParams)}[name]
        return cls(**{k: from_spec(v) for k, v in body})
    return value
