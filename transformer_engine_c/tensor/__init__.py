"""TransformerEngine's quantized tensor names, for code that imports them;
see float8_tensor.py."""
