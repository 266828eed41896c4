"""Started with the alias on (by `-m transformer_engine_c.alias` or by
TEC_AS_TRANSFORMER_ENGINE=1 and the alias's site directory): `import
transformer_engine` here, in Megatron-Core and in a child Python process is
this package."""
import subprocess
import sys

import transformer_engine
import transformer_engine.pytorch as te

import transformer_engine_c

assert te is transformer_engine_c, te
assert transformer_engine_c.alias.is_installed()
from megatron.core.extensions import transformer_engine as mte  # noqa: E402

assert mte.HAVE_TE and mte.te is transformer_engine, (mte.HAVE_TE, mte.te)
child = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch as te, transformer_engine_c as t; "
                        "assert te is t; print(te.DotProductAttention.__module__)"], capture_output=True, text=True)
assert child.returncode == 0 and "transformer_engine_c.attention" in child.stdout, child.stderr[-2000:]
print("alias ok", transformer_engine.__version__, flush=True)
