"""Train the VLM:  torchrun --nproc_per_node=N train.py --preset P [--FIELD VALUE ...]   (plain python = 1 process)

One step (docs/parallel.md §7-8), every rank running the lines of the module(s) it holds:
  N_global = loss tokens of the whole step (one all-reduce)      -> per-token loss for both modules
  schedule.train: the micro-batches in 1F1B order over the bridge and the pipeline stages (schedule.py), each one
                  vision: vlm.encode its samples -> rows, sent to the language lanes that own the samples
                  language: vlm.language_loss on the rows received (a stage: its part, docs/pipeline.md) ->
                  LossParts; backward of their sum (+ MTP)
  opt.finish: reduce grads per module over its own dp groups, divide by N_global, global norm, clip or skip (all
  ranks agree); then AdamW step, expert-bias update, LR schedule (only after a successful step)

Seeds: --seed drives everything. Samples: seed + sample index (layout-independent). Initial weights: each drawn
by its name (comm.draw), from seed + 10000 (vision), + 20000 (language), + 40000 (LoRA adapters), so neither the
layout nor any other parameter changes them; runtime RNG (random-crop CPE): seed + 30000 + vision dp rank, shared by
the tp ranks of a lane.

Code: main() = setup() (a Run record of what the parts share) -> failsafe.Stop (signals from then on) -> train():
train_step() per step, evaluate() every --eval-every steps, logs.py for what the user sees (or evaluate_only()).
User errors raise SystemExit(message); cli.run prints them as one line.
"""
import dataclasses
import json
import math
import os
import shlex
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import checkpoint
import chooser
import cli
import comm
import config
import cost
import data
import failsafe
import init
import lanes
import layout
import locks
import logs
import memory
import mock
import model
import optim
import parallel
import resume
import vlm
import watchdog
from bridge import Bridge
from pipeline import Pipe
from radio import VisionModel
from schedule import Schedule

MOCK_EVAL_SAMPLES = 32  # mock data has no end: an evaluation scores this many of its samples unless told


@dataclasses.dataclass
class Run:
    """What the parts of one run share: setup() fills it, train_step() / evaluate() / train() read it."""
    cfg: config.Config                   # the run (config.py); its record is what a checkpoint saves
    start: resume.Start                  # where its weights and files come from
    lay: layout.Layout
    par: object                          # parallel.setup(): this rank's groups and coordinates
    device: torch.device
    log_rank: bool                       # language lane lead of dp 0 prints (the last stage: it knows the loss)
    own_group: bool                      # we created the process group (tests call main() inside one)
    vision: VisionModel = None
    lm: model.LanguageModel = None
    opt: optim.AdamW = None
    tokenizer: object = None             # data.load_tokenizer's (a checkpoint saves a copy)
    train_data: object = None
    train_loader: data.Loader = None
    eval_set: data.EvalSet = None        # the fixed samples every evaluation scores
    eval_loader: data.Loader = None
    schedule: Schedule = None            # the order of the micro-batches' work around the bridge and the pipe
    counters: dict = None                # step, good_steps, consumed_samples, skipped (checkpoint.FRESH)
    planned: str = ""                    # the memory plan's peak a rank, for an out-of-memory error's line

    @property
    def modules(self):
        return {k: m for k, m in (("vision", self.vision), ("language", self.lm)) if m is not None}


def main(argv=None):
    """Train (or with --eval-only evaluate) -> (one dict per step, or [the eval result]; {"vision"/"language": module
    this rank holds})."""
    inv, given = cli.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    say = print if rank == 0 else lambda msg: None
    world = inv.world_size if inv.dry_run and inv.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if inv.world_size is not None and not 1 <= world <= chooser.MAX_WORLD:   # a launcher's world is what it is
        raise SystemExit(f"--world-size {world}: must be 1 to {chooser.MAX_WORLD}, the largest world the layout "
                         "chooser plans")
    # one run at a time saves into a directory: rank 0 holds it from before the requeue reads it to the run's end
    holds, line = rank == 0 and not (inv.dry_run or inv.eval_only), shlex.join(
        ["train.py", *(sys.argv[1:] if argv is None else argv)])
    held = [locks.hold(given["save"], line)] if holds and given.get("save") else []
    try:
        cfg, start = resume.resolve(inv, given, world, say)
        if holds and cfg.save and not held:   # --load CKPT saves on into its directory
            held.append(locks.hold(cfg.save, line))
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if torch.cuda.is_available() else \
            torch.device("cpu")
        if inv.dry_run:   # the data is indexed (its tower load is planned), nothing else is built
            capacity = inv.gpu_memory * memory.GIB
            train_data = datasets(cfg, data.load_tokenizer(start.tokenizer, cfg), True)[0]
            load, stats = memory.tower_load(train_data, cfg), cost.data_stats(cfg, train_data)
            lay = chooser.plan(cfg, world, capacity, cuda=True, say=say, strict=False, load=load, stats=stats)
            return memory.dry_run(cfg, lay, capacity, cost.step_seconds(cfg, lay, stats=stats), load,
                                  cost.basis(cfg, stats))
        if any(getattr(cfg, k) is not None for k in config.LAYOUT_FIELDS):
            layout.plan(cfg, world)   # grid flags that name no valid layout: refused before the ranks meet
        run = None
        try:   # the watchdog (started in setup) ends a stuck run; it stops with main, however main ends
            run = setup(cfg, inv, start, device, say)
            # signals from here on: every rank stops at the same micro-batch boundary (failsafe.py)
            stop = failsafe.Stop(device, watchdog.backstop(cfg.collective_timeout))
            history = evaluate_only(run, stop) if inv.eval_only else train(run, stop)
        except torch.OutOfMemoryError as e:   # its line (cli.fail) names the plan and what would fit
            if run is not None:   # (set-up's own peak is planned apart: its line says the allocator's words)
                e.args = (f"{str(e).splitlines()[0]} [{run.planned}: more ranks, --activation-checkpointing, or "
                          "the layout `--dry-run --world-size N` picks without grid flags]",)
            raise
        finally:
            watchdog.stop()
    finally:
        locks.unpin()
        for h in held:
            h.release()
    if run.own_group:
        dist.destroy_process_group()
    return history, run.modules


def setup(cfg, inv, start, device, say):
    """Process groups, the data (indexed first: the layout plans its largest sample), the layout, models, optimizer,
    loaders and the weights to start from -> Run."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", world_size=world, rank=rank,
                                timeout=watchdog.backstop(cfg.collective_timeout),
                                **({} if "MASTER_ADDR" in os.environ else  # plain `python train.py`
                                   {"init_method": f"file://{tempfile.mkdtemp()}/store"}))
    watchdog.start(cfg.collective_timeout)   # set-up may take watchdog.FIRST times it
    try:   # a refused layout leaves no process group behind (tests call main() in their process)
        comm.on_every_rank(resume.agree, start)
        tokenizer = data.load_tokenizer(start.tokenizer, cfg)
        train_data, eval_data = datasets(cfg, tokenizer, rank == 0)
        capacity, load = memory.capacity(device), memory.tower_load(train_data, cfg)
        stats = cost.data_stats(cfg, train_data)   # the step predicted from the data (docs/layouts.md §1)
        lay = chooser.plan(cfg, world, capacity, cuda=device.type == "cuda", say=say, load=load, stats=stats)
    except SystemExit:
        if own_group:
            dist.destroy_process_group()
        raise
    par = parallel.setup(lay, cfg)
    parallel.print_ranks(par)
    lead = par.lm is not None and par.lm.lane_lead and par.lm.dp_rank == 0   # prints the loss
    run = Run(cfg, start, lay, par, device, lead, own_group)
    peak = max(r["peak"] for r in memory.plan(cfg, lay, device.type == "cuda", load).values())
    run.planned = (f"the plan: {memory.figure(peak / memory.GIB, 1)} GiB a rank of "
                   f"{memory.figure(capacity / memory.GIB, 1)} ({lay.brief()})")
    source = start.load   # a step directory, or hf_interop.HFSource: whatever it holds is loaded, not drawn
    if source is not None and not hasattr(source, "read"):
        source = comm.on_every_rank(resume.call, checkpoint.Reader, source)
    modules = init.build(cfg, par, device, set(source.tensors) if source is not None else frozenset())
    run.vision, run.lm = modules.get("vision"), modules.get("language")
    if par.in_vision:
        torch.manual_seed(cfg.seed + 30000 + par.vision.dp_rank)
    run.opt = optim.build(par, run.vision, run.lm, cfg, device)

    run.tokenizer, run.train_data = tokenizer, train_data
    if inv.eval_only and eval_data is None:   # unwrapped: only a training step agrees on load-time failures
        eval_data = train_data
    if cfg.skip_bad_samples and cfg.data != "mock":  # also load-time failures, agreed by all ranks each step
        run.train_data = failsafe.SkipBad(run.train_data)
    own, pixels = lanes.rank_offsets(lay, par)  # this rank's positions in each micro-batch; pixels on vision ranks
    workers = cfg.num_workers if cfg.num_workers is not None else (2 if device.type == "cuda" else 0)
    pin = pixels and device.type == "cuda"   # images pinned ahead, in the loader's thread
    spm, weigh = lay.samples_per_microbatch, (memory.tower_trains(cfg), (cost.LM_EFFICIENCY, cost.VISION_EFFICIENCY))
    run.train_loader = data.Loader(run.train_data, own, spm, pixels, workers, pin,
                                   lanes.Lanes(cfg, run.train_data, lay, cfg.global_batch, *weigh))
    if eval_data is not None:
        n = cfg.eval_samples or (MOCK_EVAL_SAMPLES if isinstance(eval_data, mock.MockData) else len(eval_data))
        run.eval_set = data.EvalSet(eval_data, n, spm)
        run.eval_loader = data.Loader(run.eval_set, own, spm, pixels, pin=pin,
                                      order=lanes.Lanes(cfg, run.eval_set, lay, spm, *weigh))
        if inv.eval_only and run.log_rank:
            what = (f"--data {cfg.data} (no --eval-data given)" if eval_data is train_data else
                    f"--eval-data {cfg.eval_data}" if cfg.eval_data else
                    "the mock task's evaluation set (seed + 1)" if cfg.data == "mock" else
                    f"the held-out --eval-frac {cfg.eval_frac} of --data {cfg.data}")
            print(f"--eval-only: scoring {run.eval_set.n} samples of {what}", flush=True)
    run.schedule = Schedule(Bridge(par, device), Pipe(par, cfg, device) if par.in_lm else None)
    run.counters = dict(checkpoint.FRESH)
    if start.load is not None:  # any saved layout; resumes weights, AdamW, counters, RNG and data position
        run.counters = comm.on_every_rank(  # one rank's error (its rank json) ends every rank
            resume.call, checkpoint.load, source, par, run.modules, run.opt, cfg, run.train_loader,
            finetune=start.weights_only, load_optim=not (inv.no_load_optim or inv.eval_only),
            load_rng=not inv.no_load_rng)
    if start.kind == "resume" and rank == 0 and not inv.eval_only:
        optim.schedule_change(cfg, checkpoint.saved_config(start.load), run.counters,
                                 f"--load {inv.load}" if inv.load else f"--save {cfg.save}")   # (a requeue)
    if rank != 0 or inv.eval_only or not resume.borrowed(cfg, start):   # else till its saves have their own copy
        locks.unpin()   # read: a run still saving there may prune it (and this run's own saves may)
    return run


def datasets(cfg, tokenizer, verbose):
    """(train data, eval data or None) of --data and --eval-data: data files / blends, or the mock task."""
    if cfg.data != "mock":
        return data.build(cfg, tokenizer, verbose)
    train_data = mock.MockData(cfg, cfg.seed)
    if cfg.eval_data:
        return data.build(cfg, tokenizer, verbose, train=train_data)
    return train_data, mock.MockData(cfg, cfg.seed + 1)


def lane_share(run, ds, slots, side):
    """This rank's data lane's samples ("vision" or "lm" `side`) of a micro-batch whose positions hold samples
    `slots` (data.Loader.slots)."""
    m = run.par.vision if side == "vision" else run.par.lm
    return [ds[slots[i]] for i in parallel.lane_samples(run.lay, side, m.dp_rank)]


def work(run, samples, mtp_weights=()):
    """(encode, language) of this rank for schedule.Schedule (None for a module it does not hold); samples(k, side):
    the lane's samples of micro-batch k. mtp_weights: per MTP depth, its token losses' weight in the backward."""
    cfg, par = run.cfg, run.par

    def encode(k):
        return vlm.encode(run.vision, samples(k, "vision"), cfg)

    def language(k, rows, per_sample, received):
        parts = vlm.language_loss(run.lm, rows, per_sample, samples(k, "lm"), cfg, (par.lm.cp_rank, par.lm.cp_size),
                                  bool(mtp_weights), received)
        if not run.lm.last:   # a pipeline stage's outputs, to send on
            return None, parts
        return parts, parts.sum + sum(w * m for w, m in zip(mtp_weights, parts.mtp))
    return encode if run.vision is not None else None, language if run.lm is not None else None


def global_token_count(par, local_counts):
    """Token counts over all language lanes and micro-batches of the step, known on every rank: N_global (loss
    tokens) and the like. `local_counts` is this language lane's list (anything of its length on vision-only
    ranks): only a lane's lead (ModuleGroups.lane_lead) contributes, and one SUM over WORLD makes the totals known
    on both grids (colocated too)."""
    lead = par.lm is not None and par.lm.lane_lead
    t = torch.tensor([int(n) if lead else 0 for n in local_counts], dtype=torch.int64, device=comm.device())
    dist.all_reduce(t)
    return t.tolist()


def lane_counts(samples, depths=0):
    """[loss tokens, real tokens (not padding, nor a sample --skip-bad-samples blanked: failsafe.Blank), then each
    MTP depth's targets] of a language lane's samples."""
    return [sum(int(s.labels.ne(-100).sum()) for s in samples),
            sum(len(s.input_ids) - s.n_pad for s in samples if not isinstance(s, failsafe.Blank)),
            *[sum(int(model.mtp_labels(s.labels, s.seq_idx, k).ne(-100).sum()) for s in samples)
              for k in range(1, 1 + depths)]]


def reduce_loss(run, sums, n):
    """The sum of a language lane's loss sums (tensors) over all lanes and cp ranks, over n tokens (None but on the
    language model's last pipeline stage)."""
    if run.lm is None or not run.lm.last:
        return None
    total = sum(sums, torch.zeros((), device=run.device))
    dist.all_reduce(total, group=run.par.lm.dp_cp)
    return total.item() / max(n, 1)


def train_step(run, step, stop, first=False):
    """One optimizer step (the module docstring) -> (its history entry, {"flops": this rank's share of the tower's
    FLOPs, "expert_counts": per MoE layer and expert, the routed tokens, or None}), or None when a signal (`stop`,
    every rank agreeing at micro-batch boundaries) abandoned it; updates run.counters. `first`: the process's first
    step (it compiles: the watchdog allows it more)."""
    cfg, lay, par, lm, c = run.cfg, run.lay, run.par, run.lm, run.counters
    t0 = time.perf_counter()
    watchdog.mark(f"step {step + 1}", first)
    rng = checkpoint.rng_state()
    lr = optim.step_lr(cfg, c)
    for g in run.opt.param_groups:
        g["lr"] = lr
    base, n_micro, spm = step * cfg.global_batch, lay.num_microbatches, lay.samples_per_microbatch
    batch = run.train_loader.step(base, n_micro)  # {sample index: Sample}: this rank's samples of the step
    if isinstance(run.train_data, failsafe.SkipBad):
        run.train_data.skip_agreed(batch, run.train_loader.pixels, say=print if run.log_rank else lambda msg: None)

    def samples(k, side):
        return lane_share(run, batch, run.train_loader.slots(base + k * spm), side)
    ours = {side: [s for k in range(n_micro) for s in samples(k, side)] if held else []
            for side, held in (("vision", run.vision is not None), ("lm", lm is not None))}
    depths = model.mtp_depths(cfg)
    n_global, n_real, *n_mtp = global_token_count(par, lane_counts(ours["lm"], depths))
    # MTP: each depth's token losses weighted so that after the division by N_global they add scale / D x its mean
    weights = [n_global * cfg.mtp_loss_scale / (depths * max(n, 1)) for n in n_mtp]
    if lm is not None:
        lm.begin_step(n_global / (n_micro * lay.lm_dp))
    parts = run.schedule.train(n_micro, *work(run, samples, weights), stop, lambda k: watchdog.mark(
        f"step {step + 1}, micro-batch {k + 1}/{n_micro}", first), mtp=bool(weights))
    if parts is None:
        failsafe.abandon_step(run.modules, run.opt, run.train_loader, base, rng)
        return None
    watchdog.mark(f"step {step + 1}, after its micro-batches", first)
    norm, ok = run.opt.finish(n_global, cfg.clip_grad)   # reduce, norm, divide, clip; or all ranks skip
    expert_counts = None
    if ok:
        run.opt.step()
        run.opt.zero_grad()
        if lm is not None:
            # LoRA changes its adapters only: the base stays as loaded, expert biases too (the PEFT export is exact)
            rate = 0.0 if cfg.lora_rank else cfg.moe_bias_update_rate
            expert_counts = lm.end_step(rate, par.lm.tp_dp_cp)
        c["good_steps"] += 1
    else:
        c["skipped"] += 1
        failsafe.abandon_step(run.modules, run.opt)   # its gradients zeroed, its expert counts dropped
    c["consumed_samples"] += cfg.global_batch
    c["step"] = step + 1
    loss = reduce_loss(run, [p.sum.detach().float() for p in parts], n_global)
    mtp = [reduce_loss(run, [p.mtp[d].detach().float() for p in parts], n)   # logged apart, per depth
           for d, n in enumerate(n_mtp)]
    # MFU: each vision lane's images counted once, by its lead; a frozen tower's forward only
    flops = vlm.flops(cfg, ours["vision"], "vision", memory.tower_trains(cfg)) \
        if par.vision is not None and par.vision.lane_lead else 0
    if run.device.type == "cuda":
        torch.cuda.synchronize()
    return {"step": step + 1, "loss": loss, "grad_norm": norm, "lr": lr, "ok": ok,
            "tokens": n_real, "step_time_s": time.perf_counter() - t0,
            **({"mtp_loss": mtp} if mtp and loss is not None else {})}, {"flops": flops, "expert_counts": expert_counts}


def evaluate(run, stop, first=False):
    """Score every sample of run.eval_set once -> {eval_loss (per token), eval_ppl, eval_tokens, eval_samples}, or
    None when a signal stopped it (`stop`: schedule.py says where it is checked). The samples and their tokens are
    the same in every layout, so are the numbers (up to summation order). `first`: the process's first evaluation
    (it compiles: the watchdog allows it more)."""
    spm = run.lay.samples_per_microbatch
    n_micro, loaded = -(-len(run.eval_set) // spm), {}

    def samples(k, side):   # one micro-batch loaded at a time: eval sets can be large
        if k not in loaded:
            loaded.clear()
            loaded[k] = run.eval_loader.step(k * spm, 1)
        return lane_share(run, loaded[k], run.eval_loader.slots(k * spm), side)
    for m in run.modules.values():
        m.eval()
    with torch.no_grad():
        parts = run.schedule.evaluate(n_micro, *work(run, samples), stop, lambda k: watchdog.mark(
            f"evaluation, micro-batch {k + 1}/{n_micro}", first))
    for m in run.modules.values():
        m.train()
    if parts is None:
        return None
    n, = global_token_count(run.par, [sum(p.tokens for p in parts)])
    loss = reduce_loss(run, [p.sum.float() for p in parts], n)
    return {"eval_loss": loss, "eval_ppl": None if loss is None else math.exp(min(loss, 50.0)), "eval_tokens": n,
            "eval_samples": run.eval_set.n}


def evaluate_only(run, stop):
    """--eval-only -> [the result], printed as JSON (the last line), or [] when a signal stopped it."""
    result = evaluate(run, stop, first=True)
    if run.log_rank and result:
        print(json.dumps(result), flush=True)
    elif run.log_rank:
        print(f"interrupted by {signal.Signals(stop.agreed).name} during the evaluation: nothing scored, nothing "
              "saved", file=sys.stderr, flush=True)
    return [result] if result else []


def step_record(run, h, local, log):
    """The step's log record from its history entry and train_step's local values (every rank takes part)."""
    cfg, world, tokens, m = run.cfg, dist.get_world_size(), h["tokens"], run.par.lm
    moe_due = cfg.moe_stats_every and (h["step"] - 1) % cfg.moe_stats_every == 0
    counts = local["expert_counts"]   # each pipeline stage's (its tp 0, cp 0, dp 0 rank's)
    mine = counts.cpu() if moe_due and counts is not None and m.tp_rank == m.cp_rank == m.dp_rank == 0 else None
    per_rank = [None] * world  # every rank's peak memory, so a hetero run shows both grids, its FLOPs, MoE counts
    dist.all_gather_object(per_rank, (round(logs.peak_memory_gib(run.device), 2), local["flops"], mine))
    vision = sum(f for _, f, _ in per_rank)
    # the real work: the images encoded and the real tokens (padding and blanked samples run too, but are no one's
    # progress; a step of blanks only has none: its tower share is 0)
    h["model_flops"] = vision + tokens * model.lm_flops_per_token(cfg, cfg.seq_len)
    dt, elapsed, peak = h["step_time_s"], log.elapsed(), logs.peak_tflops(run.device)
    tflops = h["model_flops"] / dt / world / 1e12
    uneven = lanes.imbalance(run.lay, run.train_loader.order.step((h["step"] - 1) * cfg.global_batch)[1])
    rec = {"step": h["step"], "steps": cfg.steps, "loss": h["loss"], "grad_norm": h["grad_norm"], "lr": h["lr"],
           "skipped": run.counters["skipped"], "consumed_samples": run.counters["consumed_samples"],
           "tokens": tokens, "tokens_per_s": tokens / dt, "tokens_per_s_per_gpu": tokens / dt / world,
           "fill": tokens / (cfg.global_batch * cfg.seq_len), "tower_share": vision / max(h["model_flops"], 1),
           "lane_imbalance_vision": uneven[0], "lane_imbalance_lm": uneven[1], "step_time_s": dt, "elapsed_s": elapsed,
           "eta_s": elapsed / (h["step"] - log.first) * (cfg.steps - h["step"]),
           "tflops_per_gpu": tflops if run.device.type == "cuda" else None, "mfu": tflops / peak if peak else None,
           "peak_mem_gib_per_rank": [g for g, _, _ in per_rank], **{k: h[k] for k in ("mtp_loss",) if k in h}}
    stages = [c for _, _, c in per_rank if c is not None]   # in rank order: the stages' layers in order
    if stages:
        rec["moe"] = logs.moe_stats(torch.cat(stages))
    return rec


def train(run, stop):
    """The steps from run.counters["step"] to --steps, evaluations, checkpoints -> history (one dict per step).
    `stop`: failsafe.Stop (a signal ends the run at a micro-batch boundary, saving the last completed step)."""
    cfg, start = run.cfg, run.start

    def run_files(step_dir):   # rank 0, before the step is committed
        source = resume.run_source(cfg, start)
        if source != start.source:   # the run's own copy: the step it was loaded from may go (resume.borrowed)
            locks.unpin()
        resume.write_run_files(step_dir, run.tokenizer, source)
    saver = checkpoint.Saver(cfg, run.par, run.modules, run.opt, run.train_loader, start.lineage, run_files, lambda:
                             resume.run_file_names(run.tokenizer, resume.run_source(cfg, start))) \
        if cfg.save else None   # checks --save is writable, its paths fit
    log = logs.Log(cfg, run.log_rank, run.counters["step"])
    if run.log_rank:
        summaries = [logs.data_summary("train", run.train_data)]
        if run.eval_set is not None:
            summaries.append(logs.data_summary("eval", run.eval_set.ds) + f" (scores {run.eval_set.n} samples)")
        log.start(cfg, summaries, logs.param_counts(cfg))
    if run.device.type == "cuda":   # step lines report the training peak; set-up's (init.py, optim.build) apart
        log.say(f"set-up peak memory {logs.peak_memory_gib(run.device):.2f} GiB")
        torch.cuda.reset_peak_memory_stats(run.device)
    history = []  # per step, on every rank: what tests and callers of main() inspect
    bad_steps = 0  # consecutive skipped (non-finite) steps
    for m in run.modules.values():
        m.train()
    failsafe.nothing_to_train(run.counters, cfg.steps, start.load if start.kind == "resume" else None, log.say)
    first, evaluated = run.counters["step"], False   # the first step and evaluation of the process compile
    out = None   # the last step's; None after a signal stopped a step
    for step in range(first, cfg.steps):
        out = train_step(run, step, stop, first=step == first)
        if out is None:
            break
        h, local = out
        history.append(h)
        bad_steps = 0 if h["ok"] else bad_steps + 1
        failsafe.check_finite_run(bad_steps, cfg.max_skipped_steps, h["grad_norm"], cfg.save)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            log.step(step_record(run, h, local, log))
        log.bar.update(1)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            result = evaluate(run, stop, first=not evaluated)
            if result is None:
                break
            log.eval(step + 1, result)
            evaluated = True
        if saver is not None:  # --save-every and the last step; also commits an async save
            watchdog.mark(f"step {step + 1}, checkpoint")
            saver.after_step(step + 1, dict(run.counters), last=step + 1 == cfg.steps)
    watchdog.mark("the end of the run")
    if stop.agreed and saver is not None and history:  # the last completed step (nothing new: nothing to save)
        saver.save(run.counters["step"], dict(run.counters))
    if saver is not None:
        saver.close()  # waits for an async save in flight
    if stop.agreed:
        log.say(failsafe.stop_message(stop.agreed, run.counters["step"], cfg.save, saved=bool(history),
                                      evaluating=out is not None))
    log.close(run.counters["step"], cfg.save)
    return history


if __name__ == "__main__":
    failsafe.guard_streams()
    try:
        cli.run(main)
        status = failsafe.exit_status()
    except SystemExit as e:   # cli.run's ends: a user error (2), a signal before training (128 + it), --help (0)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    cli.end(status)
