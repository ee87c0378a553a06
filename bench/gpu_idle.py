"""Where the GPU waits on the host in one LM fwd+bwd (weights as train.py keeps them, as bench.py's `lm` part).

  python bench/gpu_idle.py [--preset 20l] [--n-routed-experts 16 ...]   (config overrides as bench.py)

One profiled call after three warm-up calls, read by bench/step_profile.py's analysis: one JSON line of the
call's wall time, compute busy, time with no kernel, and the stretches over 50 us with no kernel by the site that
launched the kernel ending each. Idle time is host-bound time: the GPU had finished everything launched so far.
The profiler's own host overhead inflates it: on one H100 the 20l LM showed 24.1 ms of gaps (an earlier version
of this script), while replaying the same fwd+bwd from a CUDA graph saved 1.6 ms (bench.py --parts lm,graph;
bench/2026-11-26-startup.md).
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench  # noqa: E402
import cli  # noqa: E402
import step_profile  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="20l")
    args, rest = p.parse_known_args()
    cfg = cli.config_of(["--preset", args.preset] + rest)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_idle.py profiles CUDA kernels: it needs a GPU")
    fwd_bwd = bench.lm_fwd_bwd(cfg, 1, torch.device("cuda"))
    for _ in range(3):
        fwd_bwd()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=True) as prof:
        t0 = time.perf_counter()
        with torch.profiler.record_function(step_profile.MARK):
            fwd_bwd()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    print(json.dumps(step_profile.summary(step_profile.trace_events(prof), wall * 1e3, step_profile.repo_files())))


if __name__ == "__main__":
    main()
