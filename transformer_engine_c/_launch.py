"""Self-launching for the package's commands: re-run `python -m <module>`
under torch.distributed.run with N local ranks, and set up a rank."""
import os
import socket
import subprocess
import sys

import torch

SAFE_ENV = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))


def under_torchrun():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def without_nproc(argv):
    """argv less our --nproc option (the ranks learn their count from torchrun,
    and torchrun's parser would take "--nproc" for an abbreviation of its own
    --nproc-per-node and refuse it as ambiguous)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def relaunch(module, nproc, argv=None):
    """Run `python -m module argv...` on nproc local ranks; return its exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for k, v in SAFE_ENV:  # NVLink multicast stays off
        env.setdefault(k, v)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={port}", "-m", module,
           *without_nproc(sys.argv[1:] if argv is None else argv)]
    return subprocess.call(cmd, env=env)


def shared_gpu_ranks():
    """N of TEC_SHARE_GPU=N (0 when unset): up to N local CUDA ranks share
    the GPUs present (cuda_index)."""
    v = os.environ.get("TEC_SHARE_GPU", "").strip()
    if not v:
        return 0
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"TEC_SHARE_GPU must be a positive number of ranks, got {v!r}")
    return int(v)


def cuda_index(local_rank):
    """The CUDA device of local rank `local_rank`: its own GPU, or with
    TEC_SHARE_GPU=N GPU local_rank % (GPUs present), so that tests of N ranks
    run on fewer GPUs. NCCL refuses two ranks of one communicator on one GPU
    of one host; in this mode each rank presents itself to NCCL as its own
    host (NCCL_HOSTID), and NCCL connects the ranks through its socket
    transport on the loopback interface: real multi-rank collectives, their
    results and ordering, at a fraction of the speed (for testing, never for
    timing). Call before NCCL's first use in the process: it sets the
    environment NCCL reads then."""
    count = torch.cuda.device_count()
    shared = shared_gpu_ranks()
    if not shared:
        if local_rank >= count:
            raise RuntimeError(f"local rank {local_rank} has no GPU of its own ({count} present); "
                               "TEC_SHARE_GPU=N lets N ranks share them (testing only)")
        return local_rank
    if local_rank >= shared:
        raise RuntimeError(f"local rank {local_rank} but TEC_SHARE_GPU={shared}")
    if count < 1:
        raise RuntimeError("TEC_SHARE_GPU is set but no CUDA GPU is present")
    os.environ.setdefault("NCCL_HOSTID", f"{socket.gethostname()}-tec-rank{local_rank}")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    return local_rank % count


def init_rank(device_type):
    """Initialise torch.distributed for this rank (nccl on cuda, gloo on cpu);
    return (rank, world size, device)."""
    import torch.distributed as dist

    for k, v in SAFE_ENV:
        os.environ.setdefault(k, v)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":
        torch.cuda.set_device(cuda_index(int(os.environ["LOCAL_RANK"])))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return rank, size, device
