"""TransformerEngine's quantization recipe names, as plain data: code written
for TE builds these (and passes them to fp8_autocast / autocast) even when
quantization is off. Constructing one is fine; using one with quantization
enabled raises NotImplementedError (this package computes in fp32, bf16 and
fp16 only)."""
import dataclasses
import enum

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
           "Float8BlockScaling", "NVFP4BlockScaling"]


class Format(enum.Enum):
    """FP8 formats: E4M3, E5M2, and HYBRID (E4M3 forward, E5M2 backward)."""
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


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


@dataclasses.dataclass
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: object = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass
class Float8CurrentScaling(Recipe):
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass
class MXFP8BlockScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass
class Float8BlockScaling(Recipe):
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass
class NVFP4BlockScaling(Recipe):
    fp8_dpa: bool = False
    fp8_mha: bool = False
