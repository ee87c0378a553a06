"""watchdog.py on CPU gloo: a stopped rank (SIGSTOP) ends a 2-rank torchrun run within --collective-timeout plus a
margin, with one line from one rank naming the wait and the rank that does not answer; two ranks waiting in
different collectives (a deadlock) end with a line naming both; a rank that waits behind a slow one that still
makes progress (a long save) is not stopped (negative control).

A failure (an error that is no user's, cli.fail) on one rank ends every rank within seconds with one line, in
hetero, colocated and pipeline runs, under torchrun and without it (rank 0 hosting the store); a signal ends a rank
that waits on one that stopped beating; a rank whose store's host died ends once overdue; rank 0 ending first in a
run without torchrun leaves the others at 0, and a SIGTERM there still saves (negative controls). The wrapper and
helpers serve tests/test_gpu_failures.py too."""
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cli
import failsafe
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


@pytest.mark.slow
def test_sigterm_ends_a_rank_waiting_on_a_stopped_one(tmp_path):
    """Over NCCL a rank waits for ever on a dead one; on gloo a stopped one (SIGSTOP) makes it wait so: the vision
    rank waits on the language rank in a collective, where its main thread runs no Python handler. torchrun's
    SIGTERM ends it within 3 beats (1 s each at --collective-timeout 10), with 143 and one line."""
    marker = str(tmp_path / "m")
    argv = ["--preset", "tiny", "--global-batch", "4", "--vision-dp", "1", "--lm-dp", "1", "--steps", "100000",
            "--collective-timeout", "10"]
    script = slow_train(str(tmp_path / "train_pid.py"), marker, argv, at=0)   # each rank's pid in a file
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             script], cwd=ROOT, env=launch_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not any(x.startswith("step 3/") for x in list(lines)):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
        time.sleep(0.05)
    vision, language = (int(open(f"{marker}pid{r}").read()) for r in range(2))
    os.kill(language, signal.SIGSTOP)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        while left_running(marker, 1) and time.monotonic() < t0 + 15:
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        os.kill(language, signal.SIGKILL)   # torchrun would give it 30 s more
        proc.wait(timeout=60)
        reader.join(timeout=10)
    out = "".join(lines)
    assert took < 6, (took, out[-3000:])
    assert "interrupted by SIGTERM while rank 1 does not answer: ended without saving" in out, out[-3000:]
    assert not [x for x in lines if x.startswith("error:")], out[-3000:]
    print(f"SIGTERM to the end of the waiting rank: {took:.2f} s")


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


# ---------------------------------------------------------------- a failure on one rank; signals in every state

# train.py as a launcher runs it, each rank writing its pid to MARKER + "pid" + RANK first, after `patch` (code)
WRAPPED = r"""
import os, runpy, sys, time
marker, rank = {marker!r}, os.environ["RANK"]
open(marker + "pid" + rank, "w").write(str(os.getpid()))
sys.path.insert(0, {root!r})
{patch}
sys.argv = ["train.py"] + {argv!r}
runpy.run_path(os.path.join({root!r}, "train.py"), run_name="__main__")
"""
FAILURES = {   # what a failing decoder block does (h: its input)
    "python": 'raise ValueError("injected failure")',
    # an index out of range on the GPU: a device-side assert, which breaks the CUDA context (raised at a later call)
    "cuda-assert": "h.new_zeros(4)[torch.full((1,), 1 << 20, device=h.device)]",
    "cuda-oom": "torch.empty(1 << 50, dtype=torch.uint8, device=h.device)",
    # what the caching allocator raises, on any device (the CPU's allocator raises a RuntimeError of its own)
    "oom": 'raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\\nmore of it")',
}


def failing_block(kind="python", rank=1, at="step 2,"):
    """A patch: rank `rank`'s decoder blocks fail (FAILURES[kind]) where the watchdog's mark starts with `at`;
    MARKER + "failed" holds when."""
    return f"""import torch, model, watchdog
forward = model.Block.forward
def failing(self, h, *a, **k):
    if rank == {str(rank)!r} and watchdog.where().startswith({at!r}):
        open(marker + "failed", "w").write(repr(time.time()))
        {FAILURES[kind]}
    return forward(self, h, *a, **k)
model.Block.forward = failing"""


def wrapped_train(tmp_path, argv, patch):
    """WRAPPED for `argv` and `patch` -> (its path, MARKER)."""
    marker = str(tmp_path / "m")
    with open(tmp_path / "wrapped.py", "w") as f:
        f.write(WRAPPED.format(root=ROOT, marker=marker, argv=list(argv), patch=patch))
    return str(tmp_path / "wrapped.py"), marker


def launch_env(**more):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, **more}


def left_running(marker, world):
    """The pids of ranks whose process is still there (not even a zombie)."""
    pids = [int(open(f"{marker}pid{r}").read()) for r in range(world)]
    return [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]


def run_failing(tmp_path, world, argv, patch, timeout=180, **env):
    """torchrun of train.py with `patch` on `world` ranks, to its end -> (its exit status, its output, seconds from
    the failure (MARKER + "failed") to its end); asserts that no rank's process is left."""
    script, marker = wrapped_train(tmp_path, argv, patch)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(world), script], cwd=ROOT, env=launch_env(**env), capture_output=True, text=True,
                         timeout=timeout)
    after = time.time() - float(open(marker + "failed").read())
    assert not left_running(marker, world), out.stdout[-3000:] + out.stderr[-3000:]
    return out.returncode, out.stdout + out.stderr, after


def assert_one_failure_line(out, rank, where, exception="ValueError: injected failure"):
    """-> the one `error:` line of `out`, which names the failed rank, its mark and its error (regular expressions)."""
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, out[-5000:]
    pattern = rf"error: rank {rank} failed in {where}: {exception}.* \(\w+\.py:\d+ [\w.<>]+\)"
    assert re.fullmatch(pattern, errors[0]), errors[0]
    return errors[0]


TINY = ["--preset", "tiny", "--global-batch", "4", "--steps", "20"]
LAYOUTS = {   # ranks, flags, micro-batches a step: rank 1 runs decoder blocks in each (language, both, stage 0)
    "hetero": (2, ["--vision-dp", "1", "--lm-dp", "1"], 4),
    "colocated": (2, ["--colocated", "--lm-dp", "2", "--num-workers", "1"], 2),   # workers too (watchdog.leave)
    "pipeline": (3, ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"], 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_error_on_one_rank_ends_every_rank_within_seconds(tmp_path, layout):
    """Rank 1's decoder raises at step 2 while the others wait on it in collectives: one line names the rank, its
    mark and the error, no traceback, every process gone within seconds (measured: well under 1 s on 2 cores)."""
    world, flags, micro = LAYOUTS[layout]
    status, out, after = run_failing(tmp_path, world, TINY + flags, failing_block(), OMP_NUM_THREADS="1")
    assert status != 0 and after < 15, (status, after, out[-3000:])
    line = assert_one_failure_line(out, 1, f"step 2, micro-batch 1/{micro}")
    assert line.endswith("LanguageModel._layers)") and f'File "{ROOT}' not in out, out[-3000:]
    print(f"{layout}: {after:.2f} s from the failure to torchrun's end")


@pytest.mark.slow
def test_an_out_of_memory_error_names_the_plan_and_what_would_fit(tmp_path):
    """Issue 54: the plan is an estimate, so a layout over it runs; where memory does run out, the failure's line
    names the plan's peak and the layout, and the ways to fit."""
    world, flags, micro = LAYOUTS["hetero"]
    status, out, _ = run_failing(tmp_path, world, TINY + flags, failing_block("oom"), OMP_NUM_THREADS="1")
    line = assert_one_failure_line(out, 1, f"step 2, micro-batch 1/{micro}", r"OutOfMemoryError: CUDA out of "
                                   r"memory\. Tried to allocate 2\.00 GiB\. \[the plan: [0-9.e-]+ GiB a rank of "
                                   r"[0-9.]+ \(hetero: vision tp1 on 1 \| language tp1 on 1\): more ranks, "
                                   r"--activation-checkpointing, or the layout `--dry-run --world-size N` picks "
                                   r"without grid flags\]")
    assert status != 0 and "more of it" not in line, (status, out[-3000:])


@pytest.mark.slow
def test_an_out_of_memory_error_in_set_up_is_its_own_line(tmp_path):
    """Out of memory while the models are built (before the run exists to name its plan): the allocator's words,
    not an error of the error handling."""
    patch = """import torch, init
build = init.build
def failing(*a, **k):
    if rank == "1":
        open(marker + "failed", "w").write(repr(time.time()))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB.")
    return build(*a, **k)
init.build = failing"""
    world, flags, _ = LAYOUTS["hetero"]
    status, out, _ = run_failing(tmp_path, world, TINY + flags, patch, OMP_NUM_THREADS="1")
    assert_one_failure_line(out, 1, "[^:]+", r"OutOfMemoryError: CUDA out of memory\. Tried to allocate 4\.00 GiB\.")
    assert status != 0 and "UnboundLocalError" not in out, out[-3000:]


def _python_ranks(script, world):
    """`python script` on `world` ranks without torchrun (env://: rank 0 hosts the store) -> their processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = launch_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, script], cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]


@pytest.mark.slow
def test_without_torchrun_a_failure_of_the_rank_hosting_the_store_ends_every_rank(tmp_path):
    """Rank 0 hosts the store (env://): it keeps it until rank 1 has read its line, then both end."""
    script, marker = wrapped_train(tmp_path, TINY + LAYOUTS["colocated"][1], failing_block(rank=0))
    procs = _python_ranks(script, 2)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    after = time.time() - float(open(marker + "failed").read())
    assert [p.returncode for p in procs] == [watchdog.FAILED_STATUS] * 2 and after < 15, outs
    assert_one_failure_line("".join(outs), 0, "step 2, micro-batch 1/2")
    assert not left_running(marker, 2)
    print(f"rank 0 hosting the store: {after:.2f} s from its failure to the end of both ranks")


@pytest.mark.slow
def test_without_torchrun_rank_0_ending_first_leaves_the_others_at_0(tmp_path):
    """Rank 0 hosts the store and ends first (rank 1 closes its log 2.5 s later): rank 1's watchdog loses the store
    while its main thread is not done, and still ends at 0 (negative control)."""
    late = """import logs
close = logs.Log.close
def late(self, *a):
    if rank == "1":
        time.sleep(2.5)
    return close(self, *a)
logs.Log.close = late"""
    script, _ = wrapped_train(tmp_path, TINY[:-1] + ["2"] + LAYOUTS["hetero"][1], late)
    procs = _python_ranks(script, 2)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert not [x for x in "".join(outs).splitlines() if x.startswith("error:")], outs


@pytest.mark.slow
def test_without_torchrun_a_sigterm_mid_step_still_saves_and_exits_143(tmp_path):
    """A scheduler signals every rank of a run without torchrun mid-step: the graceful stop (negative control)."""
    save, marker = str(tmp_path / "ckpt"), str(tmp_path / "mid")
    script = slow_train(str(tmp_path / "slow.py"), marker, TINY[:-1] + ["3", "--save", save] + LAYOUTS["hetero"][1],
                        at=7)   # the language rank's 7th micro-batch: step 2's 3rd
    procs = _python_ranks(script, 2)
    deadline = time.monotonic() + 120
    while not os.path.exists(marker + "1") and time.monotonic() < deadline and procs[1].poll() is None:
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, outs
    assert f"interrupted by SIGTERM: saved step 1 to {save}" in "".join(outs), outs


def _failing_main(argv):
    """train.main's frame around a step: the ranks named in argv fail in it, the others wait on them."""
    watchdog.start(60.0, beat=0.2)
    try:
        watchdog.mark("step 2, micro-batch 1/4")
        if str(dist.get_rank()) in argv:
            raise ValueError("injected failure\nits second line")
        dist.barrier()
    finally:
        watchdog.stop()


def _stopped_peer_main(argv):
    """Rank 1 stops beating and never joins the barrier (as a process stopped or dead over NCCL); rank 0, waiting
    in it, sends itself SIGTERM."""
    watchdog.start(60.0, beat=0.2)
    failsafe.Stop(torch.device("cpu"))   # the graceful handler: it only notes the signal
    try:
        watchdog.mark("step 2, micro-batch 1/4")
        if dist.get_rank() == 1:
            watchdog.stop()
            time.sleep(30)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        dist.barrier()
    finally:
        watchdog.stop()


def _store_host_dies_main(argv):
    """Rank 0 hosts the store and dies without a word (a segfault, the OOM killer); rank 1 waits in no collective
    that would notice (as over NCCL)."""
    watchdog.start(1.0, beat=0.2)
    watchdog.mark("step 2, micro-batch 1/4")
    if dist.get_rank() == 0:
        time.sleep(0.5)   # both threads beat once
        os._exit(9)
    time.sleep(30)


def _cli_rank(rank, world, store, main, argv):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    store = dist.TCPStore("127.0.0.1", int(store), world, rank == 0) if store.isdigit() else \
        dist.FileStore(store, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    cli.run(main, argv)


def _cli_ranks(tmp_path, main, argv, world=2, wait_for=None, tcp=False):
    """cli.run(main, argv) in `world` forked gloo processes until the ranks `wait_for` (default: all) end, the rest
    then killed -> (their exit statuses, each one's seconds to its end). tcp: rank 0 hosts the store (a TCPStore),
    else a file holds it."""
    store = str(tmp_path / "store")
    if tcp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            store = str(s.getsockname()[1])
    ctx, t0 = multiprocessing.get_context("fork"), time.monotonic()
    procs = [ctx.Process(target=_cli_rank, args=(r, world, store, main, argv)) for r in range(world)]
    for p in procs:
        p.start()
    ended, wait_for = {}, set(range(world) if wait_for is None else wait_for)
    while not wait_for <= set(ended) and time.monotonic() < t0 + 20:
        ended.update({r: time.monotonic() - t0 for r, p in enumerate(procs) if r not in ended and not p.is_alive()})
        time.sleep(0.02)
    for p in procs:
        p.kill()
        p.join()
    return [p.exitcode for p in procs], [ended.get(r) for r in range(world)]


@pytest.mark.parametrize("failing", [["1"], ["0", "1"]], ids=["rank 1", "both"])
def test_a_failed_rank_ends_the_others_quietly_with_one_line(tmp_path, capfd, failing):
    """cli.run: the line names the failing rank (one of two failing together), its mark, the error's first line and
    where it was raised; every rank exits with FAILED_STATUS, no traceback."""
    statuses, _ = _cli_ranks(tmp_path, _failing_main, failing)
    assert statuses == [watchdog.FAILED_STATUS] * 2
    err = capfd.readouterr().err
    line = assert_one_failure_line(err, "[01]" if len(failing) == 2 else 1, "step 2, micro-batch 1/4")
    assert re.search(r": injected failure \(test_watchdog\.py:\d+ _failing_main\)$", line), line
    assert "Traceback" not in err and "its second line" not in err, err


def test_a_signal_ends_a_rank_waiting_on_one_that_stopped_beating(tmp_path, capfd):
    """Its main thread waits in the barrier, where no Python handler runs: the watchdog's thread sees the signal,
    and rank 1 silent for 3 beats (0.6 s), and ends the process with 128 + the signal."""
    statuses, ended = _cli_ranks(tmp_path, _stopped_peer_main, [], wait_for=[0])
    assert statuses[0] == 128 + signal.SIGTERM and ended[0] < 0.5 + 3, (statuses, ended)
    assert "interrupted by SIGTERM while rank 1 does not answer: ended without saving" in capfd.readouterr().err


def test_a_rank_whose_store_host_died_ends_once_overdue(tmp_path, capfd):
    """Rank 1's watchdog loses the store while its main thread waits: it ends once overdue (1 s), with a line."""
    statuses, ended = _cli_ranks(tmp_path, _store_host_dies_main, [], tcp=True)
    assert statuses == [9, watchdog.EXIT_STATUS] and ended[1] < 5, (statuses, ended)
    errors = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: the wait at test_watchdog\.py:\d+ _store_host_dies_main did not complete in 1 s on rank 1 \(step 2, "
        r"micro-batch 1/4\), and the run's store stopped answering: the launcher or rank 0 ended\. See their output",
        errors[0]), errors


@pytest.mark.slow
def test_a_rank_slow_to_load_its_images_is_not_a_deadlock(tmp_path):
    """The vision rank decodes a 4000 x 4000 PNG for every sample (0.8 s each here: 3.3 s a step's four) while the
    language rank waits in a collective for it, at --collective-timeout 2: loading is progress (each sample, each
    micro-batch, each record indexed), so the run ends well. Before, a step's loading was one mark: `a deadlock`."""
    from PIL import Image
    cells = np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    Image.fromarray(cells).resize((4000, 4000), Image.BILINEAR).save(tmp_path / "big.png")
    chat = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "big.png"},
                                                       {"type": "text", "text": f"what is {i}?"}]},
                          {"role": "assistant", "content": f"number {i}"}]} for i in range(8)]
    (tmp_path / "big.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chat))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "train.py", "--preset", "tiny", "--steps", "3", "--global-batch", "4", "--data",
                          str(tmp_path / "big.jsonl"), "--vision-dp", "1", "--lm-dp", "1", "--collective-timeout", "2"],
                         cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "done: 3 steps" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
