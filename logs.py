"""What a run tells its user, from one rank: the start (config, data, parameters), one line per step (console and
--metrics-file; the scalars also to --tensorboard / --wandb), eval lines and the closing summary. Console lines go
through tqdm.write, so they never break the progress bar a person watching a terminal sees. Metric keys name their
units (_s, _gib, per_s). Shape suffixes: counts_LE is [L, E], L MoE layers, E routed experts.
"""
import importlib.util
import json
import math
import os
import shlex
import sys
import time

import torch
from tqdm import tqdm

import comm
import config
import memory

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}  # dense bf16


def fmt_time(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def peak_tflops(device):
    """Dense bf16 peak of this CUDA device from PEAK_TFLOPS (None on CPU or an unlisted GPU)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def moe_stats(counts_LE):
    """Per MoE layer: expert load entropy (nats; log E when balanced), max load fraction, tokens, counts."""
    frac = counts_LE / counts_LE.sum(-1, keepdim=True).clamp_min(1)
    entropy = -(frac * frac.clamp_min(1e-12).log()).sum(-1)
    return {"routing_entropy_mean": entropy.mean().item(), "max_expert_load_frac": frac.max().item(),
            "tokens_per_layer": counts_LE.sum(-1).tolist(), "expert_counts": counts_LE.long().tolist()}


def param_counts(cfg):
    """{part: (trainable, frozen)} for the vision tower, projector and language model of the whole model, whatever
    this rank holds (memory.sizing_model: --stage / --train-layers, --lora-rank's adapters)."""
    modules = memory.sizing_model(cfg)
    out = {"vision tower": [0, 0], "projector": [0, 0], "language": [0, 0]}
    for prefix, m in modules.items():
        for name, p in m.named_parameters():
            part = "language" if prefix == "language" else "projector" if name.startswith("mlp1.") else "vision tower"
            out[part][0 if p.requires_grad else 1] += p.numel()
    return out


def data_summary(name, ds):
    """One line on what a data set holds: the mock task's shape, or a JSONL blend's documents, tokens, shares and
    skipped lines."""
    if not hasattr(ds, "sources"):
        cfg = ds.cfg
        return (f"{name} data: mock ({cfg.mock_text}), {cfg.mock_num_samples or 'unlimited'} samples of "
                f"{cfg.seq_len} tokens, {ds.image_tokens} image tokens per image, "
                f"{cfg.mock_text_only_frac:.0%} text only")
    shares = sum(w for w, _, _ in ds.sources)
    parts = [f"{p} ({w / shares:.0%}): {len(idx['offsets'])} documents, {int(idx['lengths'].sum())} tokens"
             + (f", {len(idx['bad'])} skipped" if len(idx.get("bad", ())) else "") for w, p, idx in ds.sources]
    return f"{name} data: " + "; ".join(parts)


# TensorBoard / W&B scalar <- step record key (docs/logging.md §3 lists them): the same names in both sinks, and ones
# that only ever get added to, since dashboards and run comparisons key on them
STEP_SCALARS = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "train/mfu": "mfu",
                "train/skipped_steps": "skipped", "train/step_time_s": "step_time_s",
                "train/tokens_per_s": "tokens_per_s", "train/tokens_per_s_per_gpu": "tokens_per_s_per_gpu",
                "train/fill": "fill", "train/tower_share": "tower_share",
                "train/lane_imbalance_vision": "lane_imbalance_vision", "train/lane_imbalance_lm": "lane_imbalance_lm"}
# the where-the-time-goes figures of a step line, the closing summary's means of them
WORK = ("tokens_per_s_per_gpu", "mfu", "fill", "tower_share", "lane_imbalance_vision", "lane_imbalance_lm")
EVAL_SCALARS = {"eval/loss": "eval_loss", "eval/ppl": "eval_ppl"}


def step_scalars(rec):
    """A step record's scalars: MFU only where known (CUDA), peak memory the largest rank's, moe/ the balance numbers
    of moe_stats (its per-layer lists stay in the metrics file)."""
    out = {name: rec[key] for name, key in STEP_SCALARS.items() if rec[key] is not None}
    out["train/peak_mem_gib"] = max(rec["peak_mem_gib_per_rank"])
    out.update({f"train/mtp_loss_{k}": v for k, v in enumerate(rec.get("mtp_loss", ()), 1)})
    out.update({f"moe/{k}": v for k, v in rec.get("moe", {}).items() if not isinstance(v, list)})
    return out


class TensorBoard:
    """Scalars into event files in --tensorboard DIR (torch.utils.tensorboard, which needs the tensorboard package)."""
    name = "tensorboard"  # the Config field, the flag, the package and its pyproject extra
    hint = "Check that the directory is writable"

    def __init__(self, cfg):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(cfg.tensorboard)

    def log(self, scalars, step):
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self):
        self.writer.close()


class WandB:
    """Scalars into a W&B run of project --wandb with the run's config; its files under --save (by the checkpoints) or
    else WANDB_DIR / the working directory, where WANDB_MODE=offline keeps them for a later `wandb sync`."""
    name = "wandb"
    hint = "Log in with `wandb login`, or set WANDB_MODE=offline to log without a network"

    def __init__(self, cfg):
        self.wandb = importlib.import_module("wandb")
        if cfg.save:
            os.makedirs(cfg.save, exist_ok=True)
        self.wandb.init(project=cfg.wandb, config=vars(cfg), dir=cfg.save)

    def log(self, scalars, step):
        self.wandb.log(scalars, step=step)

    def close(self):
        self.wandb.finish()


def _open_outputs(wanted, cfg, on):
    """(the sinks `wanted`, the --metrics-file opened or None): on the logging rank (on), the packages looked for on
    every rank. Each that cannot start: one line."""
    missing = next((s.name for s in wanted if importlib.util.find_spec(s.name) is None), None)
    if missing:
        raise SystemExit(f"--{missing} needs the {missing} package: pip install -e '.[{missing}]'")
    if not on:
        return [], None
    try:
        metrics = open(cfg.metrics_file, "a") if cfg.metrics_file else None
    except OSError as e:   # a directory, a missing or read-only directory
        raise SystemExit(f"--metrics-file {cfg.metrics_file}: cannot write ({e.strerror or e}). Name a file in an "
                         "existing, writable directory") from None
    sinks = []
    for sink in wanted:
        try:
            sinks.append(sink(cfg))
        except Exception as e:  # W&B not logged in or without a network, an unwritable directory
            if metrics:
                metrics.close()
            raise SystemExit(f"--{sink.name} could not start ({' '.join(str(e).split()).rstrip('.')}). "
                             f"{sink.hint}") from None
    return sinks, metrics


class Log:
    """Console, metrics file, TensorBoard and W&B of the logging rank; every method is a no-op on the others."""

    def __init__(self, cfg, on, first_step):
        # A sink or metrics file that cannot start is a user error that every rank raises alike (were it the logging
        # rank's alone, the others would wait in the next collective): each rank looks for the packages before
        # anything is imported, the logging rank opens the sinks and the file, and comm.on_every_rank shares what
        # failed (only when one is asked for)
        wanted = [sink for sink in (TensorBoard, WandB) if getattr(cfg, sink.name)]
        self.sinks, self.metrics = comm.on_every_rank(_open_outputs, wanted, cfg, on) \
            if wanted or cfg.metrics_file else ([], None)
        self.on, self.t0, self.first, self.steps = on, time.perf_counter(), first_step, cfg.steps
        self.bar = tqdm(total=cfg.steps, initial=first_step, unit="step",
                        disable=not (on and sys.stdout.isatty()))  # a progress bar only for a person watching
        self.last = {}
        self.work = []   # the WORK figures of each logged step after the process's first (it compiles)

    def say(self, msg):
        if self.on:
            tqdm.write(msg) if not self.bar.disable else print(msg, flush=True)

    def start(self, cfg, data_lines, counts):
        """The resolved config (indented, in the save directory when there is one), the data and the trainable /
        frozen parameters."""
        if not self.on:
            return
        if cfg.save:
            os.makedirs(cfg.save, exist_ok=True)
            with open(os.path.join(cfg.save, "run_config.json"), "w") as f:
                f.write(json.dumps(vars(cfg), indent=2) + "\n")
            self.say(f"config: {config.summary(cfg)} (all of it: {os.path.join(cfg.save, 'run_config.json')})")
        else:
            self.say(f"config: {config.summary(cfg)} (the rest as the preset; all of it: run_config.json with --save)")
        for line in data_lines:
            self.say(line)
        self.say("parameters (trainable / frozen): " + ", ".join(f"{k} {t:,} / {f:,}" for k, (t, f) in counts.items()))

    def elapsed(self):
        return time.perf_counter() - self.t0

    def step(self, rec):
        """One step's record (see train.step_record): a console line, a metrics line, the sinks' scalars."""
        self.last.update(loss=rec["loss"], step=rec["step"])
        if not self.on:
            return
        mtp = "".join(f" | mtp{k} {v:.4f}" for k, v in enumerate(rec.get("mtp_loss", ()), 1))
        self.say(f"step {rec['step']}/{rec['steps']} | loss {rec['loss']:.4f}{mtp} | lr {rec['lr']:.3e} | "
                 f"grad norm {rec['grad_norm']:.3f} | skipped {rec['skipped']} | {work_line(rec)} | "
                 f"peak mem {max(rec['peak_mem_gib_per_rank']):.2f} GiB | "
                 f"{rec['step_time_s'] * 1e3:.0f} ms | elapsed {fmt_time(rec['elapsed_s'])} | "
                 f"ETA {fmt_time(rec['eta_s'])}")
        if rec["step"] > self.first + 1:
            self.work.append([rec[k] for k in WORK])
        self._record(rec, step_scalars(rec), rec["step"])

    def _record(self, rec, scalars, step):
        """A record to the metrics file, its scalars ({name: number}) to every sink (neither off the logging rank). One
        that fails to take it (a full disk, a lost network) is dropped with a warning: a log never ends a run."""
        if self.metrics:
            try:
                self.metrics.write(json_line(rec))
                self.metrics.flush()
            except OSError as e:
                self._drop(f"--metrics-file {self.metrics.name}", e, self.metrics.close)
                self.metrics = None
        for sink in list(self.sinks):
            try:
                sink.log(scalars, step)
            except Exception as e:   # whatever the package raises
                self._drop(f"--{sink.name}", e, sink.close)
                self.sinks.remove(sink)

    def _drop(self, what, error, close):
        self.say(f"warning: {what}: cannot write ({' '.join(str(error).split())}); training goes on without it from "
                 f"step {self.last.get('step', '?')}")
        try:
            close()
        except Exception:   # the same failure again (its buffer): it is dropped either way
            pass

    def eval(self, step, result):
        if not self.on:   # the loss is known on the last pipeline stage only
            return
        self.last["eval_loss"] = result["eval_loss"]
        self.say(f"eval step {step}: loss {result['eval_loss']:.4f} | ppl {result['eval_ppl']:.2f} | "
                 f"{result['eval_tokens']} tokens of {result['eval_samples']} samples")
        self._record({"step": step, **result}, {name: result[key] for name, key in EVAL_SCALARS.items()}, step)

    def close(self, step, save_dir):
        """The closing summary: steps, time, last losses, the checkpoint and the lines to resume and export."""
        self.bar.close()
        if self.metrics:
            self.metrics.close()
        for sink in self.sinks:
            sink.close()
        if not self.on:
            return
        fmt = lambda k: "N/A" if self.last.get(k) is None else f"{self.last[k]:.4f}"  # noqa: E731
        if self.work:
            known = [[v for v in col if v is not None] for col in zip(*self.work)]
            means = {k: sum(v) / len(v) if v else None for k, v in zip(WORK, known)}
            self.say(f"mean of {len(self.work)} logged steps after the first: {work_line(means)}")
        self.say(f"done: {step - self.first} steps (to step {step}) in {fmt_time(self.elapsed())} | last loss "
                 f"{fmt('loss')} | last eval loss {fmt('eval_loss')}")
        if save_dir:   # the checkpoint holds everything else the run needs (resume.py)
            nproc = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            nodes = int(os.environ.get("WORLD_SIZE", 1)) // nproc
            launcher = "python" if nproc == 1 and nodes == 1 else \
                f"torchrun{f' --nnodes {nodes} ...' if nodes > 1 else ''} --nproc_per_node={nproc}"
            load = shlex.quote(save_dir)
            more = " (add --steps N to train on)" if step >= self.steps else ""   # unfinished: the line goes on
            self.say(f"checkpoint: {save_dir}\nresume{more}: {launcher} train.py --load {load}\n"
                     f"export: python hf_interop.py export-hf --load {load} --out HF_DIR")


def work_line(rec):
    """Where the time went, short: real tokens/s/GPU, MFU, row fill, the tower's share of the FLOPs, lane imbalance
    (vision / language; - where a side had no work)."""
    na = lambda v, f, none="N/A": none if v is None else format(v, f)  # noqa: E731
    return (f"tok/s/GPU {rec['tokens_per_s_per_gpu']:.0f} | MFU {na(rec['mfu'], '.1%')} | fill {rec['fill']:.0%} | "
            f"tower {rec['tower_share']:.0%} | lanes {na(rec['lane_imbalance_vision'], '.2f', '-')}/"
            f"{na(rec['lane_imbalance_lm'], '.2f', '-')}")


def json_line(rec):
    """A metrics record as one line of valid JSON: non-finite numbers become null."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(rec), allow_nan=False) + "\n"
