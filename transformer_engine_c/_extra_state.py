"""TransformerEngine's `transformer_engine.pytorch._extra_state` names: the
environment variable that lets a trusted checkpoint's `_extra_state` be
loaded by Python's full unpickler (module/_extra_state.py reads and writes
the state)."""
from .module._extra_state import UNSAFE_PICKLE_EXTRA_STATE_ENV, unsafe_pickle_extra_state_enabled

__all__ = ["UNSAFE_PICKLE_EXTRA_STATE_ENV", "unsafe_pickle_extra_state_enabled"]
