"""Where a training step's time goes on each rank: train.py's steps with one of them under the CUDA profiler.

  torchrun --nproc_per_node=4 bench/step_profile.py [--profile-step 4] [train.py flags]

Step `--profile-step` (counted from 0; after compilation, tuning and the optimizer state's first step) runs under
torch.profiler with CPU activity and Python stacks; its Chrome trace is read back. Each rank reports that step's wall
time, its CUDA kernel time by kind (bench.KERNEL_KINDS, NCCL apart), the time some compute kernel ran (the union of
their intervals), the NCCL time no compute kernel overlapped, the time no kernel ran at all (the host, or a wait on
another rank), and where these go:
- NCCL kernel time by collective (named by the launching op, else by the kernel), and how much of it ran exposed;
- the stretches over 50 us with no kernel, by the site that launched the kernel ending each one, and the host's
  waits on the GPU (synchronizes, copies to host memory), by site. A site is this repo's innermost frames on the
  launching thread's Python stack (for a backward op, its forward op's), and the innermost op.
One JSON line per rank. Tracing the Python calls slows the host: the no-kernel time reads higher than unprofiled.
"""
import bisect
import glob
import json
import os
import re
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import train  # noqa: E402

MARK = "step_profile"   # the record_function around the profiled step: the window looked at starts with it
GPU = ("kernel", "gpu_memcpy", "gpu_memset")   # what keeps the GPU busy
LAUNCH = ("cuda_runtime", "cuda_driver")       # host calls with a correlation id to the GPU work they start
OPS = ("cpu_op", "user_annotation")
BLOCKING = r"^cu(da)?(Stream|Device|Event|Ctx)Synchronize|^cudaMemcpy"
COLLECTIVES = (("all_to_all", r"all_?to_?all"), ("reduce_scatter", r"reduce_?scatter"), ("all_gather", r"all_?gather"),
               ("all_reduce", r"all_?reduce"), ("broadcast", r"broadcast"), ("send_recv", r"send|recv"))
FRAME = re.compile(r"^(.*)\(\d+\): ")   # python_function names: "moe.py(120): dispatch", file(line): function
GAP_US, TOP, DEPTH = 50, 12, 2


def union(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def nesting(events):
    """{tid: (its events by start, each one's enclosing event's index or -1, the open ones)}."""
    out = {}
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        evs, parent, open_ = out.setdefault(e["tid"], ([], [], []))
        while open_ and evs[open_[-1]]["ts"] + evs[open_[-1]]["dur"] <= e["ts"]:
            open_.pop()
        parent.append(open_[-1] if open_ else -1)
        open_.append(len(evs))
        evs.append(e)
    return out


def enclosing(nest, tid, ts):
    """The spans of thread tid open at time ts, innermost first."""
    evs, parent, _ = nest.get(tid, ((), (), ()))
    i, out = bisect.bisect_right(evs, ts, key=lambda e: e["ts"]) - 1, []
    while i >= 0:   # the last span to start, then its ancestors: those that have not ended
        if evs[i]["ts"] + evs[i]["dur"] >= ts:
            out.append(evs[i])
        i = parent[i]
    return out


class Trace:
    """A Chrome trace's complete ("X") events, indexed to walk from GPU work to the host call, op and Python stack
    that launched it."""

    def __init__(self, events, repo):
        xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
        for e in xs:
            e.setdefault("args", {})
        ops = [e for e in xs if e.get("cat") in OPS]
        self.repo, self.mark = repo, next(e for e in ops if e["name"] == MARK)
        self.gpu = [e for e in xs if e.get("cat") in GPU]
        self.launches = [e for e in xs if e.get("cat") in LAUNCH]
        self.launch_of = {e["args"]["correlation"]: e for e in self.launches if "correlation" in e["args"]}
        self.gpu_of = {e["args"]["correlation"]: e for e in self.gpu if "correlation" in e["args"]}
        self.op_of = {e["args"]["External id"]: e for e in ops if "External id" in e["args"]}
        self.ops, self.py = nesting(ops), nesting([e for e in xs if e.get("cat") == "python_function"])
        # backward ops name their forward op by sequence number: sorted latest first, the earliest (outermost) stays
        self.forward = {e["args"]["Sequence number"]: e for e in sorted(ops, key=lambda e: -e["ts"])
                        if "Sequence number" in e["args"] and not e["args"].get("Fwd thread id")}

    def anchor(self, gpu):
        """(tid, ts) on the host where this GPU work was launched: its runtime call, else (on a thread with no ops
        recorded, or none found) the op it ran under; or None."""
        call, op = self.launch_of.get(gpu["args"].get("correlation")), self.op_of.get(gpu["args"].get("External id"))
        host = call if call and (call["tid"] in self.ops or not op) else op
        return (host["tid"], host["ts"]) if host else None

    def frames(self, tid, ts):
        """This repo's innermost DEPTH frames (python_function events) on thread tid's Python stack at ts."""
        return [e for e in enclosing(self.py, tid, ts)
                if (m := FRAME.match(e["name"])) and m.group(1) in self.repo][:DEPTH]

    def site(self, tid, ts):
        """'frames | innermost op'; the op alone where no frame is known. In a backward op the frames are those of
        its forward op, unless Python of ours runs inside it: autograd's thread has no Python stack, and the one
        thread of a CPU run only the .backward() call's."""
        ops, label = enclosing(self.ops, tid, ts), ""
        frames = self.frames(tid, ts)
        bwd = next((o for o in ops if o["args"].get("Fwd thread id")), None)
        fwd = bwd and self.forward.get(bwd["args"].get("Sequence number"))
        if fwd and not (frames and frames[0]["ts"] >= bwd["ts"]):
            frames, label = self.frames(fwd["tid"], fwd["ts"]), "backward of "
        op = ops[0]["name"] if ops else "no op"
        return f"{label}{' < '.join(e['name'] for e in frames)} | {op}" if frames else op

    def cause(self, gpu):
        """The site that launched this GPU work, else its name."""
        at = self.anchor(gpu)
        return self.site(*at) if at else gpu["name"][:80]

    def blocks(self, call):
        """Whether this host call waits for the GPU: a synchronize, or a copy into host memory."""
        copy = self.gpu_of.get(call["args"].get("correlation"), {"name": ""})["name"]
        return bool(re.search(BLOCKING, call["name"])) and ("Memcpy" not in call["name"] or "DtoH" in copy)

    def collective(self, kernel):
        """The collective of an NCCL kernel, by the first name that tells: its own "Collective name" (kineto copies
        record_param_comms' args onto it), the ops open at its launch, innermost first, then the kernel's name
        (all-to-alls run as SendRecv kernels, so the op's name comes first)."""
        at = self.anchor(kernel)
        ops = enclosing(self.ops, *at) if at else []
        names = [kernel["args"].get("Collective name", "")] + [
            n for o in ops for n in (o["args"].get("Collective name", ""), o["name"])]
        m = re.search(r"Kernel_([A-Za-z]+)", kernel["name"])
        return next((c for n in names + [kernel["name"]] for c, rx in COLLECTIVES if re.search(rx, n.lower())),
                    m.group(1) if m else "other")


def gaps(spans, t0, t1):
    """(start, end, the GPU event ending it or None) for each stretch of [t0, t1] where no span runs."""
    out, end = [], t0
    for e in sorted((e for e in spans if e["ts"] < t1), key=lambda e: e["ts"]):
        if e["ts"] > end:
            out.append((end, e["ts"], e))
        end = max(end, e["ts"] + e["dur"])
    return out + ([(end, t1, None)] if t1 > end else [])


def top(pairs):
    """[(site, us)] -> the TOP sites by summed time: [{"site", "ms", "count"}]."""
    tally = {}
    for site, us in pairs:
        row = tally.setdefault(site, [0.0, 0])
        row[0], row[1] = row[0] + us, row[1] + 1
    return [{"site": s, "ms": round(us / 1e3, 2), "count": n} for s, (us, n) in
            sorted(tally.items(), key=lambda kv: -kv[1][0])[:TOP]]


def summary(events, wall_ms, repo):
    """The JSON figures (module docstring) of a profiled step's Chrome trace events; repo: the names the profiler
    gives this repo's Python files. The step's window starts with the MARK op and lasts wall_ms."""
    t = Trace(events, repo)
    kinds, compute, nccl = {}, [], {}
    for e in t.gpu:
        span = (e["ts"], e["ts"] + e["dur"])
        kind = "NCCL" if re.search("nccl", e["name"], re.I) else next(
            (k for k, rx in bench.KERNEL_KINDS if re.search(rx, e["name"])), "other")
        kinds[kind] = kinds.get(kind, 0.0) + e["dur"] / 1e3
        (nccl.setdefault(t.collective(e), []) if kind == "NCCL" else compute).append(span)
    busy, either = union(compute) / 1e3, union(compute + sum(nccl.values(), [])) / 1e3
    by_collective = {c: {"kernel_ms": round(sum(e - s for s, e in spans) / 1e3, 1),
                         "exposed_ms": round(union(compute + spans) / 1e3 - busy, 1)} for c, spans in nccl.items()}
    t0, t1 = t.mark["ts"], t.mark["ts"] + wall_ms * 1e3
    idle = [(t.cause(ev) if ev else "(no kernel to the step's end)", e - s)
            for s, e, ev in gaps(t.gpu, t0, t1) if e - s > GAP_US]
    # the step's own waits: the closing sync (after the MARK op) waits for the GPU to finish the step, not the host
    waits = [(t.site(e["tid"], e["ts"]), e["dur"]) for e in t.launches
             if t0 <= e["ts"] <= t0 + t.mark["dur"] and t.blocks(e)]
    return {"wall_ms": round(wall_ms, 1), "compute_busy_ms": round(busy, 1),
            "nccl_exposed_ms": round(either - busy, 1), "no_kernel_ms": round(wall_ms - either, 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "nccl_by_collective_ms": dict(sorted(by_collective.items(), key=lambda kv: -kv[1]["kernel_ms"])),
            "gaps_over_50us": {"ms": round(sum(us for _, us in idle) / 1e3, 1), "count": len(idle)},
            "gap_ms_by_site": top(idle), "syncs": top(waits)}


def repo_files():
    """This repo's Python files as the profiler names them: relative to the repo, a sys.path entry."""
    return set(glob.glob("**/*.py", root_dir=ROOT, recursive=True))


def trace_events(prof):
    """The profile's Chrome trace events: kernels, runtime calls, ops and Python calls, and the ids that link them."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


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
        activities = [activity.CPU] + ([activity.CUDA] if torch.cuda.is_available() else [])
        with torch.profiler.profile(activities=activities, with_stack=True) as prof:
            t0 = time.perf_counter()
            with torch.profiler.record_function(MARK):
                result = real(run, number, stop, first)
            bench.sync()
            wall = time.perf_counter() - t0
        out.update(summary(trace_events(prof), wall * 1e3, repo_files()))
        return result

    train.train_step = step
    train.main(argv + ["--steps", str(at + 1)])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "device": device, **out}), flush=True)


if __name__ == "__main__":
    main()
