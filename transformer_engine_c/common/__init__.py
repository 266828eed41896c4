"""Mirror of `transformer_engine.common` for the names code written against
TransformerEngine imports from it (the recipes)."""
from . import recipe  # noqa: E402,F401
