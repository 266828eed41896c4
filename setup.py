"""Build of transformer_engine_c.

Two artefacts:
  transformer_engine_c/_C.abi3.so      the CPython module: C core, CPU backend
                                       and bindings (gcc; always built), on
                                       CPython's limited API of 3.10, so one
                                       build loads in every CPython >= 3.10;
                                       wheels are tagged cp310-abi3.
  transformer_engine_c/libtec_cuda.so  the CUDA backend (nvcc; built where nvcc,
                                       the CUDA runtime and cuBLASLt headers are
                                       found; loaded by _C on first CUDA use).

Environment:
  TEC_CUDA=auto|0|1     build the CUDA backend if found (default), never, or
                        fail if it cannot be built.
  CUDA_HOME             CUDA install to use (else nvcc on PATH, /usr/local/cuda).
  TEC_CUDA_ARCHS="90"   compute capabilities to build for (semicolon separated).
Headers and libraries are also looked up in the nvidia-* Python packages
(nvidia/cu13, nvidia/cublas, nvidia/cuda_runtime) on sys.path. No PyTorch is
needed to build.
"""
import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CFLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-Wno-missing-field-initializers", "-fvisibility=hidden", "-pthread"]


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def c_sources():
    pats = ["csrc/core/*.c", "csrc/core/cpu/*.c", "csrc/python/*.c"]
    return _rel(p for pat in pats for p in glob.glob(os.path.join(ROOT, pat)))


def find_cuda():
    """Return a dict describing the CUDA toolchain, or a string saying why not."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not nvcc and os.path.exists("/usr/local/cuda/bin/nvcc"):
        nvcc = "/usr/local/cuda/bin/nvcc"
    if not nvcc or not os.path.exists(nvcc):
        return "nvcc not found"
    home = home or os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    roots = [home, os.path.join(home, "targets", "x86_64-linux")]
    for d in sys.path + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]:
        for sub in ("cu13", "cublas", "cuda_runtime", "nccl"):
            roots.append(os.path.join(d or ".", "nvidia", sub))

    def find(name, subdirs):
        for r in roots:
            for s in subdirs:
                if glob.glob(os.path.join(r, s, name)):
                    return os.path.join(r, s)
        return None

    inc_rt = find("cuda_runtime.h", ["include"])
    inc_lt = find("cublasLt.h", ["include"])
    lib_rt = find("libcudart.so*", ["lib64", "lib"])
    lib_lt = find("libcublasLt.so*", ["lib64", "lib"])
    missing = [n for n, v in [("cuda_runtime.h", inc_rt), ("cublasLt.h", inc_lt),
                              ("libcudart", lib_rt), ("libcublasLt", lib_lt)] if not v]
    if missing:
        return "not found: " + ", ".join(missing)

    def libflag(d, stem):
        if os.path.exists(os.path.join(d, f"lib{stem}.so")):
            return f"-l{stem}"
        return "-l:" + os.path.basename(sorted(glob.glob(os.path.join(d, f"lib{stem}.so.*")))[0])

    return {"nvcc": nvcc, "includes": sorted({inc_rt, inc_lt}), "libdirs": sorted({lib_rt, lib_lt}),
            "libs": [libflag(lib_rt, "cudart"), libflag(lib_lt, "cublasLt")]}


class BuildExt(build_ext):
    def run(self):
        super().run()
        self.remove_stale_modules()
        self.build_cuda()

    def remove_stale_modules(self):
        """Drop _C builds for one interpreter (_C.cpython-311-*.so, left by
        builds before the abi3 one) next to the fresh _C.abi3.so: Python
        prefers them and would import the stale module."""
        fresh = self.get_ext_fullpath("transformer_engine_c._C")
        for path in glob.glob(os.path.join(os.path.dirname(fresh), "_C.*.so")):
            if os.path.basename(path) != os.path.basename(fresh):
                print(f"transformer_engine_c: removing the stale {path}")
                os.remove(path)

    def build_cuda(self):
        mode = os.environ.get("TEC_CUDA", "auto")
        cuda_dir = os.path.join(ROOT, "csrc", "core", "cuda")
        srcs = sorted(glob.glob(os.path.join(cuda_dir, "*.cu")) + glob.glob(os.path.join(cuda_dir, "*.c")))
        if mode == "0" or not srcs:
            return
        cuda = find_cuda()
        if isinstance(cuda, str):
            if mode == "1":
                raise RuntimeError(f"TEC_CUDA=1 but the CUDA backend cannot be built: {cuda}")
            print(f"transformer_engine_c: building CPU-only ({cuda})")
            return
        out_dir = os.path.dirname(self.get_ext_fullpath("transformer_engine_c._C"))
        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, "libtec_cuda.so")
        archs = os.environ.get("TEC_CUDA_ARCHS", "90").replace(",", ";").split(";")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        # each source compiled on its own (in parallel, one per CPU core), then one link
        obj_dir = os.path.join(self.build_temp, "tec_cuda")
        os.makedirs(obj_dir, exist_ok=True)
        flags = ["-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden,-pthread", "-std=c++17", "--expt-relaxed-constexpr",
                 *gencode, *[f"-I{d}" for d in cuda["includes"]], "-I" + os.path.join(ROOT, "csrc", "core")]
        objs = [os.path.join(obj_dir, os.path.basename(src) + ".o") for src in srcs]
        jobs = [[cuda["nvcc"], "-c", *flags, src, "-o", obj] for src, obj in zip(srcs, objs)]
        print(f"transformer_engine_c: {jobs[0][0]} -c {' '.join(flags)} <source> ({len(jobs)} sources)")
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            for done in pool.map(subprocess.run, jobs):
                if done.returncode:
                    raise subprocess.CalledProcessError(done.returncode, done.args)
        cmd = [cuda["nvcc"], "-shared", *gencode, *objs, "-o", out, *[f"-L{d}" for d in cuda["libdirs"]],
               *cuda["libs"], *[f"-Xlinker=-rpath,{d}" for d in cuda["libdirs"]],
               "-Xlinker=--no-undefined"]  # the core's functions are reached through its hooks only
        print("transformer_engine_c: " + " ".join(cmd))
        subprocess.check_call(cmd)
        self._cuda_out = out

    def get_outputs(self):
        outs = super().get_outputs()
        if getattr(self, "_cuda_out", None):
            outs.append(self._cuda_out)
        return outs


setup(
    # Py_LIMITED_API itself is set in csrc/python/module.h (0x030A0000);
    # py_limited_api names the module _C.abi3.so.
    ext_modules=[Extension("transformer_engine_c._C", sources=c_sources(), py_limited_api=True,
                           extra_compile_args=CFLAGS, libraries=["dl", "rt"])],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
