"""CI: load the `_C.abi3.so` of a built wheel in this interpreter WITHOUT
torch (the extension needs none) and run a little of each part: a CPU GEMM,
the range search, prepare/restore_from_saved with stand-in types, and a
one-rank shared-memory communicator. Shows that the one cp310-abi3 build loads
and works in any CPython >= 3.10.

    python3.X .ci/abi3_smoke.py dist/transformer_engine_c-*-cp310-abi3-*.whl
"""
import ctypes
import gc
import importlib.util
import os
import sys
import tempfile
import zipfile


def load(wheel, tmp):
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("transformer_engine_c/_C.")]
        assert names == ["transformer_engine_c/_C.abi3.so"], f"expected one _C.abi3.so in the wheel, got {names}"
        path = z.extract(names[0], tmp)
    spec = importlib.util.spec_from_file_location("transformer_engine_c._C", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_gemm(C):
    # Row-major C[2,2] = A[2,3] @ B^T, B stored [2,3] (transb=1), float32 (dtype code 0), CPU (-1).
    A = (ctypes.c_float * 6)(1, 2, 3, 4, 5, 6)
    B = (ctypes.c_float * 6)(1, 0, 1, 0, 1, 0)
    out = (ctypes.c_float * 4)()
    addr = ctypes.addressof
    C.gemm(-1, 0, 0, 0, 1, 2, 2, 3, addr(A), 3, addr(B), 3, addr(out), 2, None, None, 0, None, 0, 0)
    assert list(out) == [4.0, 2.0, 10.0, 5.0], list(out)
    try:
        C.gemm(-1, 0, 0, 0, 1, 2, 2, 3)
    except TypeError as e:
        assert "20 positional arguments" in str(e), e
    else:
        raise AssertionError("a short gemm() call did not raise")


def check_saving(C):
    class Tensor:  # stand-ins for torch.Tensor / nn.Parameter / DistributedWeight
        pass

    class Parameter(Tensor):
        pass

    class Weight(Parameter):
        is_distributed_weight = True

    C._init(Tensor, Parameter)
    t, p, w = Tensor(), Parameter(), Weight()
    saved, objs = C.prepare_for_saving(t, None, p, w)
    assert saved == (t, None, p, w) and len(objs) == 4 and "1 kept by reference" in repr(objs)
    other = Tensor()
    restored = C.restore_from_saved(objs, [other, None, other, other])
    assert restored[0] is other and restored[2] is other and restored[3] is w, restored
    try:
        C.prepare_for_saving(3)
    except TypeError as e:
        assert "argument 0 is int" in str(e), e
    else:
        raise AssertionError("prepare_for_saving(3) did not raise")


def check_comm(C):
    c = C.CommOverlap()
    c._create(C.TRANSPORT_SHM, -1, 0, 1, 4096, "smoke", 5.0)
    c._open_peers([c._local_handle()])
    c._release_handle()
    ptr, token = c._pin()
    (start, nbytes), = c.buffer_ranges()
    assert start == ptr and nbytes >= 4096 and c._overlaps(ptr, ptr + 1) and not c._overlaps(ptr - 8, ptr)
    c.close()
    assert c.buffer_ranges()  # pinned: still mapped after close()
    del token  # the pin goes with its token
    assert c.buffer_ranges() == [] and c.closed
    try:
        c._pin()
    except C.EngineError as e:
        assert "'smoke' is closed" in str(e), e
    else:
        raise AssertionError("_pin() on a closed communicator did not raise")
    del c
    gc.collect()


def main():
    wheel = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        C = load(wheel, tmp)
        assert "torch" not in sys.modules, "loading _C imported torch"
        assert C.find_overlap(5, 6, (0, 4, 5, 10)) == 1 and C.find_overlap(4, 5, (0, 4, 5, 10)) == -1
        check_gemm(C)
        check_saving(C)
        check_comm(C)
        assert "torch" not in sys.modules
        print(f"abi3 smoke: {os.path.basename(C.__file__)} from {os.path.basename(wheel)} works in Python "
              f"{sys.version.split()[0]} without torch")


if __name__ == "__main__":
    main()
