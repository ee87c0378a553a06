"""train.py's command line: its flags (every Config field, plus the invocation's own), the answers to flags users
bring from elsewhere (ALIASES), and run(): a user error or a signal before training is one line from one rank."""
import argparse
import difflib
import math
import os
import re
import signal
import sys
import time
import traceback

import torch

import config
import data
import failsafe
import watchdog

DESCRIPTION = "Train the VLM:  torchrun --nproc_per_node=N train.py --preset P [--FIELD VALUE ...]"
ERROR_GRACE_S = 5.0     # a rank other than 0 waits this long before it reports a user error (see run)


def parse_args(argv=None):
    """-> (the invocation's own flags, {Config field: value} of the flags given; config.add_arguments)."""
    p = argparse.ArgumentParser(description=DESCRIPTION, allow_abbrev=False, epilog="Every Config field "
                                "(config.py) is a flag, e.g. --seq-len 128 --hidden-size 256.")
    p.add_argument("--load", default=None, help="resume DIR's run (its newest step) or DIR/step_N, any layout; or "
                   "start from an HF nemotron_h_omni / nemotron_h directory (resume.py)")
    p.add_argument("--finetune", action="store_true", help="with --load of a checkpoint: a new run from its weights "
                   "(fresh optimizer, counters)")
    p.add_argument("--no-load-optim", action="store_true")
    p.add_argument("--no-load-rng", action="store_true")
    p.add_argument("--eval-only", action="store_true", help="evaluate (the --load checkpoint), print JSON, exit")
    p.add_argument("--dry-run", action="store_true", help="print sizes and the memory plan per rank (memory.py), exit")
    p.add_argument("--world-size", type=int, default=None, help="with --dry-run: plan for N ranks (default WORLD_SIZE)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="with --dry-run: GiB of one device the layout must "
                   "fit (a run uses its device's)")
    p.add_argument("--debug", action="store_true", help="show the traceback of a user error")
    config.add_arguments(p)
    p.error = exit_usage   # one line, one rank, like every user error (see cli)
    argv = sys.argv[1:] if argv is None else list(argv)
    dashes = [re.sub(r"^--[^=]*", lambda m: m[0].replace("_", "-"), a) for a in argv]   # --seq_len=8_192: --seq-len
    inv, rest = p.parse_known_args(dashes)
    if rest:
        unknown_flag(rest[0], p)
    given = config.given(inv)
    for k in given:
        delattr(inv, k)
    if inv.world_size is not None and not inv.dry_run:
        raise SystemExit(f"--world-size {inv.world_size} plans a dry run: add --dry-run (a run's world is its "
                         "launcher's: torchrun --nproc_per_node N)")
    if not (math.isfinite(inv.gpu_memory) and inv.gpu_memory > 0):
        raise SystemExit(f"--gpu-memory {inv.gpu_memory}: must be a finite number of GiB > 0")
    return inv, given


def config_of(argv):
    """The Config of a command line that loads nothing (tests, bench.py)."""
    given = parse_args(argv)[1]
    return config.resolve(given.get("preset", config.Config.preset), given)


def exit_usage(message):
    raise SystemExit(f"{message}. See --help")


IN_STEPS = "(samples / --global-batch: the LR schedule counts steps)"
# Flags users bring from HF Trainer, torchtitan (its TOML keys as --section.key), Megatron-LM and earlier versions,
# by what they mean here (underscores read as dashes).
ALIASES = {
    "learning-rate": "--lr", "max-steps": "--steps", "train-iters": "--steps", "training.steps": "--steps",
    "output-dir": "--save", "save-dir": "--save", "checkpoint.folder": "--save", "job.dump-folder": "--save",
    "resume-from-checkpoint": "--load", "model-name-or-path": "--load (an HF directory)", "optimizer.lr": "--lr",
    "per-device-train-batch-size": "--micro-batch", "micro-batch-size": "--micro-batch",
    "global-batch-size": "--global-batch", "training.global-batch-size": "--global-batch",
    "training.local-batch-size": "--micro-batch",
    "gradient-accumulation-steps": "--global-batch (samples a step = micro-batch x data parallel x accumulation)",
    "warmup-steps": "--lr-warmup-iters", "lr-warmup-steps": "--lr-warmup-iters", "lr-scheduler.warmup-steps":
    "--lr-warmup-iters", "lr-scheduler-type": "--lr-schedule", "lr-decay-style": "--lr-schedule",
    "max-grad-norm": "--clip-grad", "training.max-norm": "--clip-grad", "seq-length": "--seq-len",
    "training.seq-len": "--seq-len", "max-seq-length": "--seq-len", "gradient-checkpointing":
    "--activation-checkpointing", "recompute-activations": "--activation-checkpointing",
    "activation-checkpoint.mode": "--activation-checkpointing", "logging-steps": "--log-every",
    "log-interval": "--log-every", "save-steps": "--save-every", "save-interval": "--save-every",
    "eval-steps": "--eval-every", "eval-interval": "--eval-every", "save-total-limit": "--keep-last",
    "dataset": "--data", "data-path": "--data", "train-data-path": "--data", "tokenizer-model": "--tokenizer",
    "tokenizer-name-or-path": "--tokenizer", "tensor-model-parallel-size": "--lm-tp",
    "parallelism.tensor-parallel-degree": "--lm-tp", "expert-model-parallel-size": "--lm-ep",
    "parallelism.expert-parallel-degree": "--lm-ep", "parallelism.data-parallel-shard-degree": "--lm-dp",
    "use-distributed-optimizer": "--distributed-optimizer (the default)", "report-to": "--tensorboard DIR or "
    "--wandb PROJECT", "lora-r": "--lora-rank", "bf16": "no flag: CUDA runs train in bf16 already",
    "num-train-epochs": "--steps (epochs x the data's samples / --global-batch: a run counts steps)",
    # the sample-counted LR schedule of earlier versions (config.SAMPLE_FIELDS)
    "train-samples": "--lr-decay-iters (samples / --global-batch: the LR schedule counts steps and decays over "
    "--steps by default)", "lr-warmup-samples": f"--lr-warmup-iters {IN_STEPS}",
    "lr-decay-samples": f"--lr-decay-iters {IN_STEPS}", "lr-wsd-decay-samples": f"--lr-wsd-decay-iters {IN_STEPS}",
}


def unknown_flag(arg, parser):
    """A flag that is none of ours: one that means something here (ALIASES), or a typo of the closest one."""
    if not arg.startswith("--"):
        raise SystemExit(f"unexpected argument {arg!r}. See --help")
    key = arg[2:].partition("=")[0]
    if key in ALIASES:
        raise SystemExit(f"unknown flag --{key}. Use {ALIASES[key]}")
    names = [f[2:] for f in parser._option_string_actions if f.startswith("--")]
    close = difflib.get_close_matches(key, names, 1)
    raise SystemExit(f"unknown flag --{key}. " + (f"Did you mean --{close[0]}?" if close else "See --help"))


def run(main, argv=None):
    """main(argv) (train.main) as a command: a user error (or another rank's end: failsafe.peer_gone) is one line
    `error: <cause>. <fix>` from rank 0 (another rank only when rank 0 lives on), exit status 2; any other error
    ends every rank (fail); a signal before training starts (failsafe.Stop takes them then) is one line."""
    rank = int(os.environ.get("RANK", 0))
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    # NCCL's watchdog thread would abort a process whose CUDA context broke (SIGABRT, no line, before the main thread
    # sees the error): leave the error to the main thread, and so to fail()
    os.environ.setdefault("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0")
    for sig in failsafe.SIGNALS:
        signal.signal(sig, failsafe.interrupt)
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        torch.set_num_threads(1)   # as torchrun does: more threads collapse (5-16x a step) on shared cores
    try:
        main(argv)
    except BaseException as e:
        _over()
        if isinstance(e, failsafe.Interrupted):
            if rank == 0:
                print(f"interrupted by {e.name} before training started: nothing to save", file=sys.stderr,
                      flush=True)
            sys.exit(128 + e.signum)
        msg = user_error(e, rank)
        if msg is None:
            if not isinstance(e, Exception):   # --help, a plain exit status, Ctrl-C outside cli.run's handler
                raise
            fail(e, rank, debug)
        if debug:
            traceback.print_exc()
        if rank != 0:   # rank 0 most likely failed too (or first): its exit makes torchrun end this process (by a
            if failsafe.taken:   # signal, which now ends it); torchrun's signal came first: it is ending the run
                sys.exit(128 + failsafe.taken)
            time.sleep(ERROR_GRACE_S)   # if not, the error was this rank's only
        print(f"error: {msg.removeprefix('error: ')}", file=sys.stderr, flush=True)
        sys.exit(2)
    _over()


def end(status):
    """Ends the process once main() is over and its files are closed (os._exit, after flushing): the interpreter's
    own exit runs the C++ destructors of the threads process groups leave, which aborted a pipeline stage after
    `done` (docs/failures.md §11)."""
    sys.stdout.flush()
    sys.stderr.flush()
    watchdog.leave(status, quiet=False)


def _over():
    """main() is over: a signal now ends the process at once (the interpreter's exit can hang)."""
    for sig in failsafe.SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def user_error(e, rank):
    """The line of an error that is the user's, or that another rank's (failsafe.peer_gone), else None."""
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, str) else None
    if isinstance(e, data.BadSample):   # a DataLoader worker's carries the worker's traceback: its last line says it
        bad_line = re.sub(r"^[\w.]*BadSample: ", "", str(e).strip().splitlines()[-1])
        return (f"{bad_line}. Fix the line or pass --skip-bad-samples (a training step's; an evaluation's samples "
                "must load)")
    return failsafe.peer_gone(e, rank) if isinstance(e, RuntimeError) else None


def fail(error, rank, debug):
    """An error that is no user's (a CUDA error, out of memory, a bug) ends every rank within seconds, one line from
    the first rank to fail (docs/failures.md §11); the process ends at once: its interpreter's exit can hang."""
    if debug:
        traceback.print_exc()
    said = str(error).strip().splitlines()
    line = (f"error: rank {rank} failed in {watchdog.where()}: {type(error).__name__}{': ' + said[0] if said else ''}"
            f" ({watchdog.raised_at(error.__traceback__)})")
    if watchdog.fail(line):
        print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    watchdog.leave(watchdog.FAILED_STATUS, quiet=False)
