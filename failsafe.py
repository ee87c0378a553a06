"""A run loses nothing and says what went wrong: signals, closed pipes, samples that fail at load time, non-finite
steps, ranks that lost a peer (requeue: resume.py; argument checks: config.check).

Signals: SIGINT / SIGTERM / SIGHUP only set a flag once training or an evaluation runs (the first one counts; later
ones cannot cut the save short); before that (set-up), cli.run installs `interrupt`, which ends the process with
one line. Every rank calls Stop() at the same micro-batch boundaries (a one-int all-reduce on a gloo group, so no
GPU sync; where it sits relative to the bridge is schedule.py's rule); once any rank was signalled, all abandon the
step in progress (the schedule matches the bridge traffic in flight, abandon_step puts gradients, expert counts, RNG
and data position back to the step's start) or the evaluation in progress (nothing to undo: it is not scored), save
the last completed step synchronously and exit with 128 + signal. A main thread blocked where it cannot reach
that boundary (a collective on a rank that stopped beating) runs no handler: the watchdog's thread then ends the
process with 128 + the signal (watchdog.py); after main(), or once this rank fails, a signal ends it at once (cli.run).

User errors raise SystemExit with one line (the repo's convention, see config.py).
"""
import dataclasses
import os
import re
import signal
import sys

import torch
import torch.distributed as dist

import checkpoint
import data
import watchdog

SIGNALS = watchdog.SIGNALS   # a scheduler, Ctrl-C, a closed terminal / torchrun
interrupted = 0   # the signal a run of main() stopped on (0: none); the process exits with 128 + it
taken = 0         # the first of SIGNALS this process took since its Stop was made (0: none; read by cli.run)


# ---------------------------------------------------------------- streams

class _Guarded:
    """stdout / stderr that survive their reader going away: Ctrl-C on `train.py | tee log` ends tee too, and the
    next print would raise BrokenPipeError in the middle of the signal save. The descriptor is then pointed at
    /dev/null, so later writes and the interpreter's final flush succeed (the metrics file keeps the record)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, s):
        try:
            return self._stream.write(s)
        except OSError:
            self._drop()
            return len(s)

    def flush(self):
        try:
            self._stream.flush()
        except OSError:
            self._drop()
            self._stream.flush()

    def _drop(self):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard_streams():
    sys.stdout, sys.stderr = _Guarded(sys.stdout), _Guarded(sys.stderr)


# ---------------------------------------------------------------- signals

class Interrupted(KeyboardInterrupt):
    """A signal before training (or --eval-only's evaluation) starts: nothing to save, the process ends (cli)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


def interrupt(signum, frame):
    raise Interrupted(signum)


class Stop:
    """SIGNALS -> a flag; calling the object is the collective that agrees on it (see the docstring)."""

    def __init__(self, device, timeout=None):
        global taken
        taken = self.agreed = 0
        self.group = None   # CPU: the default group is gloo
        if device.type == "cuda":
            self.group = dist.new_group(backend="gloo", timeout=timeout)
            watchdog.name(self.group, "world (gloo: the signal check)")
        for sig in SIGNALS:
            signal.signal(sig, _take)

    def __call__(self):
        """True on every rank once any rank got a signal (then .agreed is the largest signal number seen)."""
        global interrupted
        flag = torch.tensor([taken])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.agreed = int(flag.item())
        interrupted = self.agreed
        return bool(self.agreed)


def _take(signum, frame):
    global taken
    taken = taken or signum


def abandon_step(modules, opt, loader=None, base=0, rng=None):
    """Drop the step in progress: its gradients and the expert counts it made. Stopped by a signal at a micro-batch
    boundary (after schedule.Schedule.train matched the bridge traffic in flight), with (loader, base, rng) its RNG
    and data position go back to its start as well, so the signal checkpoint is the last completed step and resuming
    repeats this one exactly. A skipped step (non-finite gradients, train.train_step) keeps them: its samples are
    consumed and it counts as a step."""
    opt.zero_grad()
    if "language" in modules:
        modules["language"].end_step()
    if loader is not None:
        checkpoint.set_rng_state(rng)   # the step's start (checkpoint.rng_state)
        loader.next = base   # Loader.state_dict() reports the step's first sample as the next one


def stop_message(signum, step, save, saved, evaluating=False):
    """The line a stopped run ends with; `evaluating`: the signal stopped the evaluation after `step`."""
    name = signal.Signals(signum).name
    during = f" during the evaluation after step {step} (not scored)" if evaluating else ""
    if save is None:
        return f"interrupted by {name}{during or f' after step {step}'}: no --save, nothing saved"
    if not saved:
        return f"interrupted by {name} before a step completed: " + (f"{save} keeps step {step}" if step else
                                                                      "nothing saved")
    return f"interrupted by {name}{during}: saved step {step} to {save}"


def exit_status():
    return 128 + interrupted if interrupted else 0


def peer_gone(error, rank):
    """The line for a collective that failed because another rank's process ended first (gloo: its connection
    closed), else None. That rank's own output says why; cli.run lets rank 0 alone print it."""
    found = re.search(r"Connection (closed|reset) by peer|Broken pipe", str(error))
    return found and f"rank {rank}: another rank ended while this one waited on it ({found.group(0)}). Its output " \
        "says why"


# ---------------------------------------------------------------- samples that fail at load time

@dataclasses.dataclass
class Blank(data.Sample):
    """A sample --skip-bad-samples blanked: padding that the model runs as tokens (no all-masked rows) but that is
    no one's work, so the step line counts none of it (train.lane_counts: fill, tok/s, MFU). bad: "file:line:
    reason" on the rank it failed on. A field, so the loader's pinning (Sample.pin_memory's replace) keeps it."""
    bad: str = None


class SkipBad:
    """--skip-bad-samples for failures indexing could not see (a file changed or damaged since): the sample comes
    back a Blank (padding, nothing to train, no image) naming why; skip_agreed() then blanks it on every rank,
    because only the ranks that decode pixels may have failed."""

    def __init__(self, ds):
        self.ds, self.skipped = ds, 0

    def __len__(self):
        return len(self.ds)

    def __getattr__(self, name):   # fingerprint, cfg, ... of the wrapped data set
        if name == "ds":
            raise AttributeError(name)
        return getattr(self.ds, name)

    def sample(self, i, pixels=True):
        try:
            return self.ds.sample(i, pixels)
        except data.BadSample as e:
            return self.blank(pixels, str(e))

    def blank(self, pixels, reason=None):
        cfg, pad = self.ds.cfg, self.ds.enc.sp["<pad>"]
        return Blank(torch.full((cfg.seq_len,), pad), torch.full((cfg.seq_len,), -100), [] if pixels else None,
                     bad=reason)

    def skip_agreed(self, batch, pixels, say):
        """Blank every sample of the step that failed on any rank (a small all_gather), count and report them."""
        bad = [None] * dist.get_world_size()
        dist.all_gather_object(bad, {i: s.bad for i, s in batch.items() if isinstance(s, Blank) and s.bad})
        bad = {i: reason for b in bad for i, reason in b.items()}
        for i in sorted(bad):
            if i in batch:
                batch[i] = self.blank(pixels)
            self.skipped += 1
            say(f"skipped sample {i} ({bad[i]}); {self.skipped} skipped at load time so far")


# ---------------------------------------------------------------- resumed runs, non-finite steps

def nothing_to_train(counters, steps, loaded, say):
    """loaded: the checkpoint a resumed run came from (None for a fresh run)."""
    if loaded and counters["step"] >= steps:
        say(f"nothing to train: {loaded} is at step {counters['step']} and --steps is {steps} (the total of the "
            "run, resumed runs too); raise --steps to train further")


def check_finite_run(bad_steps, limit, norm, save):
    """Abort after `limit` consecutive skipped (non-finite) steps: every rank, the same step (norm is agreed)."""
    if limit and bad_steps >= limit:
        latest = checkpoint.read_latest(save) if save else None
        if latest:
            kept = (f"`latest` stays {latest} in {save}. Resume from it with a lower --lr or longer warmup, or "
                    "raise --max-skipped-steps")
        else:
            kept = "no checkpoint was saved. Start again with a lower --lr or longer warmup"
        raise SystemExit(f"{bad_steps} consecutive steps had non-finite gradients (grad norm {norm}); stopping, "
                         f"{kept}")
