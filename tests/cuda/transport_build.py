"""What tests/cuda/transport_test.cu is built from, and the nvcc command that
builds it: the one list for tests/test_cuda_transport.py and
scripts/gpu_validate.sh. The transport's CUDA files are found by name
(csrc/core/cuda/*transport*.cu), so a file split out of them is built too.
    python3 tests/cuda/transport_build.py EXE            build EXE (nvcc's exit status)
    python3 tests/cuda/transport_build.py --print EXE    print the command only
"""
import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sources():
    """The test program and what it links, relative to the repository root:
    the transport's files (by name), their shared CUDA helpers and the
    engine's error path."""
    transport = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc/core/cuda/*transport*.cu")))
    return ["tests/cuda/transport_test.cu", *transport, "csrc/core/cuda/cuda_common.cu", "csrc/core/error.c"]


def find_nvcc():
    """nvcc on PATH, else CUDA_HOME's or /usr/local/cuda's; None without one."""
    for nvcc in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if nvcc and os.path.exists(nvcc):
            return nvcc
    return None


def command(nvcc, exe):
    return [nvcc, "-std=c++17", "-O2", "-gencode=arch=compute_90,code=sm_90", "-I", "csrc/core", *sources(),
            "-o", exe, "-lcudart"]


def build(exe, timeout=300):
    """Build the test program into exe (run from the repository root); the
    finished nvcc process, its output in stdout."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("no nvcc (PATH, CUDA_HOME, /usr/local/cuda) to build the transport test with")
    return subprocess.run(command(nvcc, os.path.abspath(exe)), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def main(argv):
    if len(argv) == 2 and argv[0] == "--print":
        print(" ".join(command(find_nvcc() or "nvcc", argv[1])))
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    proc = build(argv[0])
    sys.stdout.write(proc.stdout)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
