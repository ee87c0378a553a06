"""watchdog.py on CPU gloo: a stopped rank (SIGSTOP) ends a 2-rank torchrun run within --collective-timeout plus a
margin, with one line from one rank naming the wait and the rank that does not answer; two ranks waiting in
different collectives (a deadlock) end with a line naming both; a rank that waits behind a slow one that still
makes progress (a long save) is not stopped (negative control)."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import watchdog
from tests.spawn import run_distributed, slow_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_stopped_rank_ends_the_run_with_one_line(tmp_path):
    timeout = 5
    marker = str(tmp_path / "m")
    argv = ["--preset", "tiny", "--global-batch", "4", "--vision-dp", "1", "--lm-dp", "1", "--steps", "100000",
            "--collective-timeout", str(timeout)]
    script = slow_train(str(tmp_path / "train_pid.py"), marker, argv, at=0)   # each rank's pid in a file
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             script], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []   # (time read, line)
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), x) for x in proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not any(x.startswith("step 3/") for _, x in list(lines)):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(x for _, x in lines[-30:])
        time.sleep(0.05)
    language = int(open(marker + "pid1").read())
    t0 = time.monotonic()
    os.kill(language, signal.SIGSTOP)   # the language rank: the vision rank waits for its gradient
    try:
        while not any(x.startswith("error:") for _, x in list(lines)) and time.monotonic() < t0 + timeout + 30:
            time.sleep(0.05)
        errors = [(t, x) for t, x in list(lines) if x.startswith("error:")]
        assert errors, "".join(x for _, x in lines[-30:])
        assert errors[0][0] - t0 < timeout + 10, errors[0][0] - t0   # 3 beats of 0.5 s after the timeout, and slack
        vision = int(open(marker + "pid0").read())
        while os.path.exists(f"/proc/{vision}") and time.monotonic() < t0 + timeout + 15:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{vision}") or open(f"/proc/{vision}/stat").read().split()[2] == "Z"
    finally:
        os.kill(language, signal.SIGKILL)   # torchrun would give it 30 s more
        proc.wait(timeout=60)
        reader.join(timeout=10)
    out = "".join(x for _, x in lines)
    assert proc.returncode != 0, out
    errors = [x for _, x in lines if x.startswith("error:")]
    assert len(errors) == 1, out
    assert f"did not complete in {timeout} s on rank 0 (step " in errors[0], errors[0]
    assert "(rank 1 is not answering?)" in errors[0] and "--collective-timeout" in errors[0], errors[0]
    assert f"exitcode  : {watchdog.EXIT_STATUS}" in out, out   # torchrun's report of the vision rank


def _deadlock(rank, world):
    other = dist.new_group([0, 1], backend="gloo")
    watchdog.name(other, "test group")
    watchdog.start(1.0, beat=0.2)
    try:   # as train.main: an error the other rank's exit raises here meanwhile ends this rank as the watchdog would
        watchdog.mark("the deadlock")
        t = torch.zeros(1)
        if rank == 0:
            dist.all_reduce(t)            # waits for rank 1's all_reduce on the world group
        else:
            dist.barrier(group=other)     # waits for rank 0's barrier on the other group
    finally:
        watchdog.stop()
    return "not reached"


@pytest.mark.slow
def test_ranks_waiting_on_each_other_end_with_a_line_naming_both(capfd):
    with pytest.raises(RuntimeError, match=f"exit codes \\[{watchdog.EXIT_STATUS}, {watchdog.EXIT_STATUS}\\]"):
        run_distributed(_deadlock, 2, timeout=30)
    errors = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, errors
    line = errors[0]
    assert "did not complete in 1 s on rank" in line and "every rank answers but waits" in line, line
    assert "all_reduce on world at test_watchdog.py" in line or "rank 0 in all_reduce on world" in line, line
    assert "barrier on test group [0, 1] at test_watchdog.py" in line, line
    assert "deadlock" in line and "not answering" not in line, line


def _slow_writer(rank, world):
    watchdog.start(1.0, beat=0.2)
    watchdog.mark("a save")
    if rank == 0:   # 3 s of writing, progress marked every 0.25 s, while rank 1 waits 3 x its timeout
        for _ in range(12):
            time.sleep(0.25)
            watchdog.progress()
    dist.barrier()
    watchdog.stop()
    return "done"


@pytest.mark.slow
def test_waiting_behind_a_rank_that_makes_progress_is_no_hang():
    assert run_distributed(_slow_writer, 2, timeout=30) == ["done", "done"]
