"""A failure on one rank over NCCL ends every rank within seconds, and its GPU memory is free again (cli.fail,
watchdog.py; docs/failures.md §11). torchrun --standalone on 2 GPUs (skipped with fewer), the tiny preset; the
failing rank's decoder blocks fail at step 2 (tests/test_watchdog.py's wrapper): a device-side assert from an index
out of range (the CUDA context is broken from then on: the realistic case), a CUDA out-of-memory, a Python error.
Each run: start-up (20-40 s), one step, the failure."""
import time

import pytest
import torch

from tests.test_watchdog import assert_one_failure_line, failing_block, run_failing

GPUS = 2
TINY = ["--preset", "tiny", "--steps", "20", "--collective-timeout", "30"]
HETERO = ["--vision-tp", "1", "--vision-dp", "1", "--lm-tp", "1", "--lm-dp", "1"]   # vision on 0, language on 1
COLOCATED = ["--colocated", "--lm-dp", "2"]
PIPELINE = ["--colocated", "--vision-tp", "1", "--lm-pp", "2", "--micro-batch", "2"]   # stage s on rank s
RAISED = {   # the failure's type and message, as the line gives them
    "cuda-assert": r"\w+: .+",   # of the first call that finds the context broken (a CUDA error, a kernel's set-up)
    "cuda-oom": r"OutOfMemoryError: CUDA out of memory\.",
    "python": "ValueError: injected failure",
}

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < GPUS, reason=f"needs {GPUS} GPUs")


def _free():
    return [torch.cuda.mem_get_info(i)[0] for i in range(GPUS)]


@pytest.mark.parametrize("flags, kind, rank", [(HETERO, "cuda-assert", 1), (COLOCATED, "cuda-oom", 1),
                                               (PIPELINE, "python", 1), (PIPELINE, "cuda-assert", 0)],
                         ids=["hetero-assert", "colocated-oom", "pipeline-python", "pipeline-assert-rank0"])
def test_a_failure_on_one_gpu_ends_the_run_and_frees_the_gpus(tmp_path, flags, kind, rank):
    before = _free()   # this process's own context on each GPU is in both readings
    status, out, after = run_failing(tmp_path, GPUS, TINY + flags, failing_block(kind, rank), timeout=300)
    print(f"{' '.join(flags)}, {kind} on rank {rank}: {after:.2f} s from the failure to torchrun's end")
    assert status != 0 and after < 30, (status, after, out[-5000:])
    assert_one_failure_line(out, rank, "step 2[^:]*", RAISED[kind])   # an assert is raised at a later call
    deadline = time.monotonic() + 20   # the driver frees a dead process's memory
    while any(b - f > 2 ** 30 for b, f in zip(before, _free())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(b - f < 2 ** 30 for b, f in zip(before, _free())), (before, _free())
