"""The process tests/test_reliability_fuzz.py feeds: reads one call per line
(JSON), runs it, answers one line per call ("ok", or the exception's type
name and message). A crash ends the process, and the test reports the call
it was running. Addresses: the string "P" stands for a 64 KiB scratch
buffer (large enough for every small size the fuzz generates)."""
import json
import sys

import torch

import transformer_engine_c as tec
from transformer_engine_c import _C, _engine

SCRATCH = torch.zeros(16384)  # 64 KiB
P = SCRATCH.data_ptr()
COMM = tec.CommOverlap((64, 64), torch.float32, tp_size=1, name="fuzz")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def arg(v):
    return P if v == "P" else v


def tensor(spec):
    shape, dt = spec
    return torch.randn(*shape).to(DTYPES[dt])


def run(call):
    fn, args = call["fn"], [arg(a) for a in call.get("args", [])]
    if fn in ("norm_fwd", "norm_bwd", "norm_bwd_workspace_bytes", "gemm", "gemm_workspace_bytes"):
        getattr(_C, fn)(*args)
    elif fn == "create":
        _C.CommOverlap()._create(*args)
    elif fn in ("_ag_gemm", "_gemm_rs", "_bulk_ag_start", "_bulk_rs_start"):
        getattr(COMM, fn)(*args)
        if fn.startswith("_bulk"):
            (COMM._bulk_ag_finish if "ag" in fn else COMM._bulk_rs_finish)(0)
    elif fn == "CommOverlap":
        shape, dt, kw = call["args"]
        tec.CommOverlap(shape, DTYPES.get(dt, dt), tp_size=1, **kw).close()
    elif fn == "get_buffer":
        COMM.get_buffer(**call["kw"])
    elif fn == "engine_gemm":
        a, b = tensor(call["a"]), tensor(call["b"])
        y = _engine.gemm(a, b, transb=call["transb"])
        ref = a.float() @ (b.float().t() if call["transb"] else b.float())
        assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2), "engine gemm differs from torch"
    elif fn == "ag_gemm":
        a, w = tensor(call["a"]), tensor(call["w"])
        y = COMM.ag_gemm(a, w)
        assert torch.allclose(y.float(), a.float() @ w.float().t(), rtol=2e-2, atol=2e-2), "ag_gemm differs"
    else:
        raise AssertionError(f"unknown fuzz call {fn}")


def main():
    for line in sys.stdin:
        call = json.loads(line)
        try:
            run(call)
            res = "ok"
        except AssertionError as e:  # a wrong answer: the test fails on it
            res = f"WRONG {e}"
        except Exception as e:  # noqa: BLE001 - the test judges the type
            res = f"{type(e).__name__} {str(e)[:200]}"
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
