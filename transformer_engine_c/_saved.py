"""prepare_for_saving / restore_from_saved (temporary Python version; the C
implementation replaces it)."""


def prepare_for_saving(*tensors):
    objs = [t if getattr(t, "is_distributed_weight", False) else None for t in tensors]
    return list(tensors), objs


def restore_from_saved(objects, saved):
    return [o if o is not None else s for o, s in zip(objects, saved)]
