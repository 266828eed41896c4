"""TransformerEngine's quantized tensor names, for code that imports them;
see float8_tensor.py and quantized_tensor.py."""
from .quantized_tensor import QuantizedTensor  # noqa: F401
