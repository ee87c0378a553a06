"""bench/step_profile.py's analysis on hand-made Chrome trace events (a CUDA trace's shape) and a real CPU trace."""
import importlib.util
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("step_profile", os.path.join(ROOT, "bench", "step_profile.py"))
sp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sp)


def X(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def py(name, ts, dur, tid=1):
    return X("python_function", name, ts, dur, tid)


def launch(ts, corr, tid=1, name="cudaLaunchKernel", dur=5):
    return X("cuda_runtime", name, ts, dur, tid, correlation=corr)


def kernel(name, ts, dur, corr=None, **args):
    return X("kernel", name, ts, dur, tid=7, **({"correlation": corr} if corr else {}), **args)


# One step of 10 ms (us below). Thread 1 runs the Python; thread 2 is autograd's, running the backward of the aten::mm
# (sequence number 7) that moe.py's dispatch launched. GPU: a GEMM 2000-3000, an all-to-all (SendRecv kernels, named
# by its op) 4300-5800, a reduce-scatter (named by its args) 5000-6000 on another stream, the backward's GEMM
# 7000-8000, an HtoD copy 8010-8030 and a DtoH copy 8040-8060; no kernel 0-2000, 3000-4300, 6000-7000, 8060-10000.
EVENTS = [
    X("user_annotation", sp.MARK, 0, 9000),
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
    py("train.py(237): train_step", 0, 9000),
    py("moe.py(100): dispatch", 1000, 2000), py("torch/nn/functional.py(10): linear", 1100, 900),
    X("cpu_op", "aten::mm", 1200, 300, **{"External id": 5, "Sequence number": 7, "Fwd thread id": 0}),
    launch(1300, 100), kernel("sm90_xmma_gemm_bf16", 2000, 1000, 100),
    py("moe.py(150): combine", 4000, 600),
    X("cpu_op", "nccl:all_to_all", 4000, 500), X("cpu_op", "record_param_comms", 4100, 300),
    launch(4200, 101), kernel("ncclDevKernel_SendRecv", 4300, 1500, 101),
    kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 5000, 1000, **{"Collective name": "_reduce_scatter_base"}),
    X("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 6000, 1000, tid=2,
      **{"Sequence number": 7, "Fwd thread id": 1}),
    launch(6500, 102, tid=2), kernel("ampere_sgemm_128x64", 7000, 1000, 102),
    X("cpu_op", "aten::to", 7990, 5), launch(8000, 106, name="cudaMemcpyAsync"),
    X("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 8010, 20, tid=7, correlation=106),
    py("logs.py(50): log", 8020, 60), X("cpu_op", "aten::copy_", 8030, 40),
    launch(8035, 105, name="cudaMemcpyAsync", dur=30),
    X("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 8040, 20, tid=7, correlation=105),
    py("train.py(228): reduce_loss", 8400, 600), X("cpu_op", "aten::item", 8450, 500),
    launch(8500, 104, name="cudaStreamSynchronize", dur=400),
    launch(9500, 107, name="cudaDeviceSynchronize", dur=400),   # step_profile's closing sync: after the MARK op
    {"ph": "s", "cat": "ac2g", "id": 100, "pid": 1, "tid": 1, "ts": 1300, "name": "ac2g"},
]
REPO = {"train.py", "moe.py", "logs.py"}


def test_summary_attributes_nccl_gaps_and_syncs():
    out = sp.summary(json.loads(json.dumps(EVENTS)), 10.0, REPO)
    json.dumps(out)
    # compute 1000 + 1000 + 20 + 20 us; NCCL 4300-6000, of which none overlapped by compute
    assert (out["wall_ms"], out["compute_busy_ms"], out["nccl_exposed_ms"], out["no_kernel_ms"]) == (
        10.0, 2.0, 1.7, 6.3)
    assert out["by_kind_ms"] == {"NCCL": 2.5, "GEMM": 2.0, "other": 0.0}
    # kinds overlap each other (two streams): their exposed times add up past nccl_exposed_ms
    assert out["nccl_by_collective_ms"] == {"all_to_all": {"kernel_ms": 1.5, "exposed_ms": 1.5},
                                            "reduce_scatter": {"kernel_ms": 1.0, "exposed_ms": 1.0}}
    # 2000 + 1300 + 1000 + 1940 us; the 10 us stretches between the copies are left out
    assert out["gaps_over_50us"] == {"ms": 6.2, "count": 4}
    assert out["gap_ms_by_site"] == [
        {"site": "moe.py(100): dispatch < train.py(237): train_step | aten::mm", "ms": 2.0, "count": 1},
        {"site": "(no kernel to the step's end)", "ms": 1.94, "count": 1},
        {"site": "moe.py(150): combine < train.py(237): train_step | record_param_comms", "ms": 1.3, "count": 1},
        {"site": "backward of moe.py(100): dispatch < train.py(237): train_step | "
                 "autograd::engine::evaluate_function: MmBackward0", "ms": 1.0, "count": 1}]
    # the HtoD copy does not block; the closing cudaDeviceSynchronize is not the step's
    assert out["syncs"] == [
        {"site": "train.py(228): reduce_loss < train.py(237): train_step | aten::item", "ms": 0.4, "count": 1},
        {"site": "logs.py(50): log < train.py(237): train_step | aten::copy_", "ms": 0.03, "count": 1}]


@pytest.mark.parametrize("name, args, ops, want", [
    ("ncclDevKernel_AllGather_RING_LL", {}, [], "all_gather"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float", {}, [], "all_reduce"),
    ("ncclDevKernel_SendRecv", {}, [], "send_recv"),
    ("ncclDevKernel_SendRecv", {}, [("c10d::alltoall_base_", {})], "all_to_all"),
    ("ncclDevKernel_Generic_1", {}, [("record_param_comms", {"Collective name": "allgather_into_tensor_coalesced"})],
     "all_gather"),
    ("ncclDevKernel_Generic_1", {}, [("nccl:reduce_scatter_tensor_coalesced", {})], "reduce_scatter"),
    ("ncclDevKernel_Reduce_Sum_f32_RING_LL", {}, [], "Reduce"),
])
def test_collective_names(name, args, ops, want):
    """The kernel's own args, then the ops open at its launch (found by correlation id), then its name."""
    events = [X("user_annotation", sp.MARK, 0, 100), launch(50, 9), kernel(name, 60, 10, 9, **args)]
    events += [X("cpu_op", op, 10 + i, 80 - 2 * i, **a) for i, (op, a) in enumerate(ops)]
    t = sp.Trace(events, set())
    assert t.collective(t.gpu[0]) == want


def test_launch_on_a_thread_without_ops():
    """Where the runtime call's thread has no ops recorded, the kernel's External id names the op it ran under."""
    events = [X("user_annotation", sp.MARK, 0, 100), py("moe.py(100): dispatch", 5, 90),
              X("cpu_op", "aten::mm", 10, 30, **{"External id": 3}), launch(20, 9, tid=99),
              kernel("sm90_xmma_gemm_bf16", 60, 10, 9, **{"External id": 3})]
    t = sp.Trace(events, {"moe.py"})
    assert t.cause(t.gpu[0]) == "moe.py(100): dispatch | aten::mm"


def matmul_twice(x):
    return (x @ x) @ x


@pytest.mark.slow
def test_real_cpu_trace():
    """torch's own Chrome trace (CPU only here): the MARK op, the ops and this file's Python frames are found; with
    no kernel, the whole window is one stretch to the step's end."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        with torch.profiler.record_function(sp.MARK):
            matmul_twice(torch.ones(8, 8))
    events = sp.trace_events(prof)
    out = sp.summary(events, 5.0, sp.repo_files())
    assert out["no_kernel_ms"] == 5.0 and out["gap_ms_by_site"][0]["site"] == "(no kernel to the step's end)"
    t = sp.Trace(events, sp.repo_files())
    mm = next(e for e in events if e.get("name") == "aten::mm")
    site = t.site(mm["tid"], mm["ts"] + 0.01)
    # a call made under the profiler is named by its def's line, one open when it started by its line then
    assert site.startswith(f"tests/test_step_profile.py({matmul_twice.__code__.co_firstlineno}): matmul_twice < "
                           "tests/test_step_profile.py(") and site.endswith("): test_real_cpu_trace | aten::mm")
