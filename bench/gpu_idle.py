"""Where the GPU waits on the host in one LM fwd+bwd (weights as train.py keeps them, as bench.py's `lm` part).

  python bench/gpu_idle.py [--preset 20l] [--n-routed-experts 16 ...]   (config overrides as bench.py)

One profiled call (CPU and CUDA activity) after three warm-up calls. Prints the span from the first kernel's start
to the last kernel's end, the time inside it when no kernel ran (gaps over 5 us), that idle time by the innermost
host op running during each gap, and the longest gaps with the kernel that ended them. Idle time is host-bound
time: the GPU had finished everything launched so far. The profiler's own host overhead inflates it: on one H100
the 20l LM showed 24.1 ms of gaps here, while replaying the same fwd+bwd from a CUDA graph saved 1.6 ms (bench.py
--parts lm,graph; bench/2026-11-26-startup.md).
"""
import argparse
import collections
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import cli  # noqa: E402


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
    with torch.profiler.profile(activities=acts) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(trace)
    events = json.load(open(trace))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    host_ops = [e for e in events if e.get("cat") == "cpu_op"]
    start, end = kernels[0]["ts"], max(k["ts"] + k["dur"] for k in kernels)
    busy_until, gaps = kernels[0]["ts"] + kernels[0]["dur"], []
    for k in kernels[1:]:
        if k["ts"] > busy_until + 5:
            gaps.append((busy_until, k["ts"], k["name"]))
        busy_until = max(busy_until, k["ts"] + k["dur"])
    idle = sum(b - a for a, b, _ in gaps)
    print(f"span {(end - start) / 1e3:.1f} ms, no kernel running {idle / 1e3:.1f} ms in {len(gaps)} gaps > 5 us")
    by_op = collections.Counter()
    for a, b, _ in gaps:   # the innermost (shortest) host op overlapping the gap: what the host was doing
        ops = [e for e in host_ops if e["ts"] < b and e["ts"] + e.get("dur", 0) > a and e.get("dur", 0) < 5000]
        by_op[min(ops, key=lambda e: e.get("dur", 0))["name"][:60] if ops else "?"] += b - a
    for name, us in by_op.most_common(25):
        print(f"{us / 1e3:7.2f} ms  {name}")
    for a, b, after in sorted(gaps, key=lambda g: g[0] - g[1])[:12]:
        print(f"gap {b - a:8.0f} us at {(a - start) / 1e3:7.1f} ms before {after[:80]}")


if __name__ == "__main__":
    main()
