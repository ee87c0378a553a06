"""Where a training step's time goes on each rank: train.py's steps with one of them under the CUDA profiler.

  torchrun --nproc_per_node=4 bench/step_profile.py [--profile-step 4] [train.py flags]

Step `--profile-step` (counted from 0; after compilation, tuning and the optimizer state's first step) runs under
torch.profiler. Each rank reports that step's wall time, its CUDA kernel time by kind (bench.KERNEL_KINDS, NCCL
apart), the time some compute kernel ran (the union of their intervals), the NCCL time no compute kernel overlapped,
and the time no kernel ran at all (the host, or a wait on another rank): one JSON line per rank.
"""
import json
import os
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import train  # noqa: E402


def union(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summary(prof, wall_s):
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end]
    kinds, compute, nccl = {}, [], []
    for e in kernels:
        span = (e.time_range.start, e.time_range.end)
        kind = "NCCL" if re.search("nccl", e.name, re.I) else next(
            (k for k, rx in bench.KERNEL_KINDS if re.search(rx, e.name)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + (span[1] - span[0]) / 1e3
        (nccl if kind == "NCCL" else compute).append(span)
    busy, either = union(compute) / 1e3, union(compute + nccl) / 1e3
    return {"wall_ms": round(wall_s * 1e3, 1), "compute_busy_ms": round(busy, 1),
            "nccl_exposed_ms": round(either - busy, 1), "no_kernel_ms": round(wall_s * 1e3 - either, 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}


def main():
    argv, at = list(sys.argv[1:]), 4
    if "--profile-step" in argv:
        i = argv.index("--profile-step")
        at = int(argv[i + 1])
        del argv[i:i + 2]
    real, out = train.train_step, {}

    def step(run, number, stop, first=False):
        if number != at:
            return real(run, number, stop, first)
        bench.sync()
        activity = torch.profiler.ProfilerActivity
        with torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU]) as prof:
            t0 = time.perf_counter()
            result = real(run, number, stop, first)
            bench.sync()
            wall = time.perf_counter() - t0
        out.update(summary(prof, wall))
        return result

    train.train_step = step
    train.main(argv + ["--steps", str(at + 1)])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "device": device, **out}), flush=True)


if __name__ == "__main__":
    main()
