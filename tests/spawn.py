"""Run a function in N gloo processes from a test: `results = run_distributed(fn, world_size, *args)`.

`fn(rank, world_size, *args)` runs in each child after init_process_group("gloo"); its return values (picklable)
come back as a list indexed by rank. A child's exception is re-raised in the pytest process with the child's
traceback; if one child fails, the others (probably stuck in a collective) get a few seconds, then are killed.

Children are forked (no re-import of torch, so a spawn costs well under a second) and rendezvous through a
FileStore in a temporary directory: no TCP port to pick, so no port races between parallel test runs.
`fn` may be a closure or a lambda, since nothing is pickled on the way in.
"""
import multiprocessing
import os
import pickle
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def _child(fn, rank, world_size, store_path, results, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # N processes share the machine's few cores
    code = 0
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        out = pickle.dumps(fn(rank, world_size, *args))  # fails here, loudly, if not picklable
        dist.barrier()  # nobody tears down connections while a peer still uses them
        dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        code = 1
    results.close()
    results.join_thread()
    os._exit(code)  # skip pytest's atexit handlers and the inherited parent state


def run_distributed(fn, world_size, *args, timeout=60.0):
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; return [result of rank 0, 1, ...]."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, os.path.join(tmp, "store"), results, args),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        done, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(done) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                rank, ok, value = results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and not errors:
                    errors[-1] = "a child died without reporting"   # the exit codes once all have ended, below
            else:
                (done if ok else errors)[rank] = value
            if errors:  # the others may now wait forever in a collective: give them a short grace period
                deadline = min(deadline, time.monotonic() + 5.0)
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        if -1 in errors:
            errors[-1] += f" (exit codes {[p.exitcode for p in procs]})"
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(
            f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    if len(done) < world_size:
        missing = sorted(set(range(world_size)) - set(done))
        raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s (deadlock?)")
    return [pickle.loads(done[r]) for r in range(world_size)]


# train.py as `python train.py` runs it, each rank writing its pid to MARKER + "pid" + RANK first, with the language
# side's collate slowed down and MARKER + RANK written when its micro-batch number `at` starts (mid-step): a test
# then sends its signal.
SLOW_TRAIN = r"""
import os, runpy, sys, time
open({marker!r} + "pid" + os.environ.get("RANK", "0"), "w").write(str(os.getpid()))
sys.path.insert(0, {root!r})
import data
collate, calls = data.collate_text, []
def slow(samples):
    calls.append(1)
    if len(calls) == {at}:
        open({marker!r} + os.environ.get("RANK", "0"), "w").close()
    time.sleep(0.3)
    return collate(samples)
data.collate_text = slow
sys.argv = ["train.py"] + {argv!r}
runpy.run_path(os.path.join({root!r}, "train.py"), run_name="__main__")
"""


def slow_train(path, marker, argv, at):
    """Write SLOW_TRAIN for `argv` to `path` -> path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(path, "w") as f:
        f.write(SLOW_TRAIN.format(root=root, marker=marker, argv=list(argv), at=at))
    return path
