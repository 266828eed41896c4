"""`transformer_engine.common.recipe`'s names; see transformer_engine_c/recipe.py."""
from ..recipe import *  # noqa: F401,F403
from ..recipe import __all__  # noqa: F401
