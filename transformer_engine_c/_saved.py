"""prepare_for_saving / restore_from_saved for the layers: the C
implementation (csrc/python/saving.c documents the protocol)."""
from ._C import prepare_for_saving, restore_from_saved

__all__ = ["prepare_for_saving", "restore_from_saved"]
