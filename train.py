"""Train the VLM:  torchrun --nproc_per_node=N train.py --preset P [--FIELD VALUE ...]   (plain python = 1 process)

One step (parallel.md §6-7), every rank running the lines of the module(s) it holds:
  N_global = loss tokens of the whole step (one all-reduce)      -> per-token loss for both modules
  for each micro-batch:  vision: encode its samples, bridge.send, then the backward of the previous micro-batch
                         (1F1B: the encoder's forward m+1 overlaps the language side's work on m)
                         language: bridge.recv, place image rows, forward, backward(sum of token losses), send_grad
  vision: the last micro-batch's backward
  reduce grads per module over its own dp groups, divide by N_global, global norm, clip or skip (all ranks agree)
  AdamW step, expert-bias update, LR schedule (only after a successful step)

Seeds: --seed drives everything. Samples: seed + sample index (layout-independent). Vision init: seed + 10000 on
the global RNG; language init: seed + 20000 hashed with each parameter name (layout-independent, see model.py);
runtime RNG (random-crop CPE): seed + 30000 + vision dp rank, shared by the tp ranks of a lane.

Code: main() = setup() (a Run record of what the parts share) -> train(): train_step() per step, evaluate() every
--eval-every steps, logs.py for what the user sees. User errors raise SystemExit(message); the command line (cli)
prints them as one line.
"""
import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

import checkpoint
import config
import data
import failsafe
import hf_interop
import logs
import lora
import memory
import mock
import model
import moe
import optim
import parallel
from bridge import Bridge
from radio import VisionModel

ERROR_GRACE_S = 5.0     # a rank other than 0 waits this long before it reports a user error (see cli)
MOCK_EVAL_SAMPLES = 32  # mock data has no end: an evaluation scores this many of its samples unless told
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}  # dense bf16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Any config field can be overridden "
                                "with --FIELD VALUE (see config.py), e.g. --seq-len 128 --hidden-size 256.")
    p.add_argument("--preset", default="tiny", choices=sorted(config.PRESETS))
    p.add_argument("--steps", type=int, default=20, help="total optimizer steps of the run (resumed runs too)")
    p.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per language lane per micro-batch")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--min-lr", type=float, default=2e-6)
    p.add_argument("--lr-schedule", choices=["cosine", "wsd", "constant"], default="cosine")
    p.add_argument("--lr-warmup-iters", type=int, default=0)
    p.add_argument("--lr-decay-iters", type=int, default=None, help="default: --steps")
    p.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD decay tail; default 10%% of decay")
    p.add_argument("--lr-wsd-decay-style", choices=["linear", "minus_sqrt"], default="linear")
    p.add_argument("--train-samples", type=int, default=None, help="sample-based schedule (Megatron style)")
    p.add_argument("--lr-warmup-samples", type=int, default=0)
    p.add_argument("--lr-decay-samples", type=int, default=None)
    p.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", default="mock", help="mock | PATH (.jsonl, .json, .parquet, dir, glob) | weighted "
                   "blend '0.7:a.jsonl,0.3:b/*.parquet'")
    p.add_argument("--eval-data", default=None, help="held-out data (file or blend) for --eval-every, with any --data")
    p.add_argument("--eval-frac", type=float, default=0.0, help="else hold out the last FRAC of every --data file")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory (its chat template renders chats) or "
                   "tokenizer.json; default: offline byte-level tokenizer")
    p.add_argument("--train-on", choices=["assistant", "all"], default="assistant", help="chat tokens with loss")
    p.add_argument("--pack", action="store_true", help="pack documents into seq_len rows (document masks)")
    p.add_argument("--skip-bad-samples", action="store_true", help="skip and count bad JSONL lines, not fail")
    p.add_argument("--overlong", choices=["error", "skip", "truncate"], default="error",
                   help="a document longer than seq_len: fail (counted skip under --skip-bad-samples), skip, or "
                   "truncate it (never inside an image)")
    p.add_argument("--data-columns", default=None, help="parquet columns, e.g. messages=conversations,images=image")
    p.add_argument("--num-workers", type=int, default=None, help="DataLoader workers; default 2 on GPU, 0 on CPU")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3],
                   help="1: projector only, 2: vision tower frozen, 3: everything")
    p.add_argument("--train-layers", default=None, help="regex over vision.* / language.* names (overrides --stage)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-distributed-optimizer", action="store_true", help="plain AdamW: fp32 weights, gradients "
                   "and state replicated over data parallel (default: sharded, bf16 weights on CUDA; optim.py)")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank only (lora.py)")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA scale = alpha / rank")
    p.add_argument("--lora-targets", default=None, help="regex over full layer names (default: lora.TARGETS)")
    p.add_argument("--moe-dispatcher", choices=["alltoall", "deepep"], default="alltoall")
    p.add_argument("--moe-force-balance", action="store_true", help="benchmarks only: route every token to fixed "
                   "experts in turn, so all experts get the same rows (the routers of published throughputs)")
    for name in ("vision-tp", "vision-dp", "lm-tp", "lm-dp", "lm-ep", "lm-etp"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--colocated", action="store_true", help="both modules on every rank")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--metrics-file", default=None)
    p.add_argument("--moe-stats-every", type=int, default=10)
    p.add_argument("--tensorboard", default=None)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-samples", type=int, default=None, help="an evaluation scores the first N eval samples; "
                   f"default: the whole eval data ({MOCK_EVAL_SAMPLES} of mock data)")
    p.add_argument("--dry-run", action="store_true", help="print sizes and the memory plan per rank (memory.py), exit")
    p.add_argument("--world-size", type=int, default=None, help="with --dry-run: plan for N ranks (default WORLD_SIZE)")
    p.add_argument("--save", default=None, help="save directory: DIR/step_N/ + DIR/latest (see checkpoint.py)")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (always: last step, signal)")
    p.add_argument("--keep-last", type=int, default=0, help="keep only the newest K checkpoints (0: all)")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in a background thread")
    p.add_argument("--load", default=None, help="resume from DIR (its `latest`) or DIR/step_N, any layout; or start from an HF "
                   "nemotron_h_omni / nemotron_h directory (weights and model config from it)")
    p.add_argument("--finetune", action="store_true", help="with --load: weights only (fresh optimizer, counters)")
    p.add_argument("--no-load-optim", action="store_true")
    p.add_argument("--no-load-rng", action="store_true")
    p.add_argument("--eval-only", action="store_true", help="evaluate (the --load checkpoint), print JSON, exit")
    p.add_argument("--debug", action="store_true", help="show the traceback of a user error")
    p.error = lambda message: exit_usage(message)   # one line, one rank, like every user error (see cli)
    args, rest = p.parse_known_args(argv)
    return args, parse_overrides(rest, p.error, p._option_string_actions)


def exit_usage(message):
    raise SystemExit(f"{message}. See --help")


def parse_overrides(rest, error, flags=()):
    """--field value | --field=value (what argparse left over) -> {field: value string} config overrides. A key
    that is no config field is a typo: the error names the closest flag or field."""
    overrides, i = {}, 0
    while i < len(rest):
        if not rest[i].startswith("--"):
            error(f"unexpected argument {rest[i]!r}")
        key, eq, value = rest[i][2:].partition("=")
        if not eq:
            if i + 1 >= len(rest):
                error(f"--{key} needs a value")
            value, i = rest[i + 1], i + 1
        overrides[key.replace("-", "_")] = value
        i += 1
    fields = [f.name.replace("_", "-") for f in dataclasses.fields(config.Config)]
    for key in overrides:
        if key not in config.Config.__dataclass_fields__:
            names = fields + [f[2:] for f in flags if f.startswith("--")]
            close = difflib.get_close_matches(key.replace("_", "-"), names, 1)
            raise SystemExit(f"unknown flag --{key.replace('_', '-')}. " +
                             (f"Did you mean --{close[0]}?" if close else "See --help"))
    return overrides


def peak_tflops(device):
    """Dense bf16 peak of this CUDA device from PEAK_TFLOPS (None on CPU or an unlisted GPU)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def learning_rate(args, it, samples):
    """LR after `it` successful steps / `samples` consumed samples: linear warmup, then cosine / WSD / constant."""
    if args.train_samples:
        x, warm, end, tail = samples, args.lr_warmup_samples, args.lr_decay_samples or args.train_samples, \
            args.lr_wsd_decay_samples
    else:
        x, warm, end, tail = it, args.lr_warmup_iters, args.lr_decay_iters or args.steps, args.lr_wsd_decay_iters
    if x < warm:
        return args.lr * (x + 1) / warm
    if args.lr_schedule == "constant":
        return args.lr
    if args.lr_schedule == "cosine":
        progress = min(max((x - warm) / max(end - warm, 1), 0.0), 1.0)
        return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    tail = tail or max((end - warm) // 10, 1)
    f = min(max((x - (end - tail)) / tail, 0.0), 1.0)           # 0 while stable, 1 at the end of the tail
    drop = f if args.lr_wsd_decay_style == "linear" else math.sqrt(f)
    return args.min_lr + (args.lr - args.min_lr) * (1 - drop)




def hf_model(args, overrides, say):
    """--load HF_DIR: (the Config from its config.json plus --preset for the fields HF does not carry, the directory
    as a checkpoint source). The model's shape is the directory's: shape overrides are refused. Its tokenizer is
    the default --tokenizer when it holds one."""
    shape = sorted(k for k in overrides if k in checkpoint.MODEL_FIELDS and k != "image_token_id")
    if shape:
        raise SystemExit(f"--load {args.load} is an HF directory: the model's shape comes from its config.json; "
                         f"drop {', '.join('--' + k.replace('_', '-') for k in shape)}")
    token = overrides.pop("image_token_id", None)
    source = hf_interop.HFSource(args.load, args.preset, None if token is None else int(token), seed=args.seed,
                                 say=say)
    if args.tokenizer is None and os.path.exists(os.path.join(args.load, "tokenizer_config.json")):
        args.tokenizer = args.load
    say(f"--load {args.load}: HF {'VLM' if source.omni else 'language model'}, fields HF does not carry from "
        f"--preset {args.preset}, tokenizer {args.tokenizer or 'byte-level (the default)'}")
    return config.from_values(dataclasses.asdict(source.cfg), overrides), source



@dataclasses.dataclass
class Run:
    """What the parts of one run share: setup() fills it, train_step() / evaluate() / train() read it."""
    args: argparse.Namespace
    cfg: config.Config
    lay: parallel.Layout
    par: object                          # parallel.setup(): this rank's groups and coordinates
    device: torch.device
    log_rank: bool                       # language tp 0 / dp 0 prints (it knows the loss)
    own_group: bool                      # we created the process group (tests call main() inside one)
    vision: VisionModel = None
    lm: model.LanguageModel = None
    opt: torch.optim.Optimizer = None
    train_data: object = None
    train_loader: data.Loader = None
    eval_set: data.EvalSet = None        # the fixed samples every evaluation scores
    eval_loader: data.Loader = None
    bridge: Bridge = None
    counters: dict = None                # step, good_steps, consumed_samples, skipped (checkpoint.FRESH)
    flops: int = 0                       # model FLOPs this rank counted in the current step (MFU)
    real_tokens: int = 0                 # non-padding tokens of this language lane in the current step
    expert_counts: torch.Tensor = None   # per MoE layer and expert, the current step's routed tokens
    argv: list = None                    # the command line's flags (the closing summary's resume line)

    @property
    def modules(self):
        return {k: m for k, m in (("vision", self.vision), ("language", self.lm)) if m is not None}


def main(argv=None):
    """Train (or with --eval-only evaluate) -> (one dict per step, or [the eval result]; {"vision"/"language": module
    this rank holds})."""
    args, overrides = parse_args(argv)
    args.load = failsafe.requeue(args, say=print if int(os.environ.get("RANK", 0)) == 0 else lambda msg: None)
    cfg, hf_source = resolve_config(args, overrides)
    failsafe.check_args(args, cfg)
    grid_flags = dict(vision_tp=args.vision_tp, vision_dp=args.vision_dp, lm_tp=args.lm_tp, lm_dp=args.lm_dp,
                      lm_ep=args.lm_ep, lm_etp=args.lm_etp, colocated=True if args.colocated else None)
    world = args.world_size if args.dry_run and args.world_size else int(os.environ.get("WORLD_SIZE", 1))
    lay = parallel.plan_layout(cfg, world, args.micro_batch, args.global_batch, **grid_flags)
    if args.dry_run:
        return memory.dry_run(cfg, lay, args)
    run = setup(args, cfg, lay, hf_source)
    run.argv = list(sys.argv[1:] if argv is None else argv)
    if args.eval_only:  # the last line printed is the JSON result
        result = evaluate(run)
        if run.log_rank:
            print(json.dumps(result), flush=True)
        history = [result]
    else:
        history = train(run)
    if run.own_group:
        dist.destroy_process_group()
    return history, run.modules


def resolve_config(args, overrides):
    """(Config, HF checkpoint source or None): from --load HF_DIR, the --eval-only checkpoint, or --preset."""
    if args.load and hf_interop.is_hf_dir(args.load):  # an HF directory: its model, fresh optimizer and counters
        say = print if int(os.environ.get("RANK", 0)) == 0 else lambda msg: None
        return hf_model(args, overrides, say)
    if args.eval_only and args.load:  # evaluate the checkpoint's model, whatever --preset says
        return checkpoint_call(checkpoint.saved_config, args.load, overrides), None
    return config.resolve(args.preset, overrides), None


def checkpoint_call(fn, *args, **kwargs):
    """fn of checkpoint.py, its errors (a missing or mismatched checkpoint) as user errors."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"{e}. Check --load (a save directory or DIR/step_N of a run of this model)") from None


def setup(args, cfg, lay, hf_source):
    """Devices, process groups, models, optimizer, data and the --load checkpoint -> Run."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if torch.cuda.is_available() else \
        torch.device("cpu")
    memory.check_fits(cfg, lay, args, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", world_size=world, rank=rank,
                                **({} if "MASTER_ADDR" in os.environ else  # plain `python train.py`
                                   {"init_method": f"file://{tempfile.mkdtemp()}/store"}))
    par = parallel.setup(lay, cfg)
    parallel.print_ranks(par)
    run = Run(args, cfg, lay, par, device, par.lm is not None and par.lm.tp_rank == 0 and par.lm.dp_rank == 0,
              own_group)
    if par.in_vision:
        torch.manual_seed(args.seed + 10000)
        run.vision = VisionModel(cfg, par.vision.tp).to(device)  # drawn on the CPU: the same weights on any device
        torch.manual_seed(args.seed + 30000 + par.vision.dp_rank)
    if par.in_lm:
        with torch.device(device):
            run.lm = model.LanguageModel(cfg, {"tp": par.lm.tp, "ep": par.lm.ep, "etp": par.lm.etp},
                                         args.moe_dispatcher)
        coords = {k: (getattr(par.lm, f"{k}_rank"), getattr(par.lm, f"{k}_size")) for k in ("tp", "ep", "etp")}
        model.init_weights(run.lm, args.seed + 20000, coords, cfg)
        run.lm.checkpoint_layers = args.activation_checkpointing
        for m in run.lm.modules():
            if isinstance(m, moe.Router):
                m.force_balance = args.moe_force_balance
    model.set_trainable(run.modules, args.stage, args.train_layers)
    if args.lora_rank:  # adapters only: everything else frozen
        lora.apply(run.modules, args, par, args.seed + 40000)
    run.opt = optim.build(par, run.vision, run.lm, args, device)

    run.train_data, eval_data = datasets(args, cfg, run.log_rank)
    if args.skip_bad_samples and args.data != "mock":  # also load-time failures, agreed by all ranks each step
        run.train_data = failsafe.SkipBad(run.train_data)
    if args.eval_only and eval_data is None:
        eval_data = run.train_data
    own, pixels = data.rank_offsets(lay, par)  # this rank's samples of each micro-batch; pixels on vision ranks
    workers = args.num_workers if args.num_workers is not None else (2 if device.type == "cuda" else 0)
    run.train_loader = data.Loader(run.train_data, own, lay.samples_per_microbatch, pixels, workers)
    if eval_data is not None:
        if args.eval_samples is not None and args.eval_samples < 1:
            raise SystemExit(f"--eval-samples {args.eval_samples}: an evaluation needs at least one sample")
        n = args.eval_samples or (MOCK_EVAL_SAMPLES if isinstance(eval_data, mock.MockData) else len(eval_data))
        run.eval_set = data.EvalSet(eval_data, n, lay.samples_per_microbatch)
        run.eval_loader = data.Loader(run.eval_set, own, lay.samples_per_microbatch, pixels)
    run.bridge = Bridge(par, device)
    run.counters = dict(checkpoint.FRESH)
    if args.load:  # any saved layout; resumes weights, AdamW, counters, RNG and data position (see checkpoint.py)
        run.counters = parallel.on_every_rank(  # one rank's error (its rank json) ends every rank
            checkpoint_call, checkpoint.load, hf_source or args.load, par, run.modules, run.opt, cfg, run.train_loader,
            finetune=args.finetune or hf_source is not None, load_optim=not (args.no_load_optim or args.eval_only),
            load_rng=not args.no_load_rng)
    return run


def datasets(args, cfg, verbose):
    """(train data, eval data or None) of --data and --eval-data: JSONL files / blends, or the mock task."""
    if args.data != "mock":
        return data.build(args, cfg, verbose)
    train_data = mock.MockData(cfg, args.seed)
    if args.eval_data:
        return data.build(args, cfg, verbose, train=train_data)
    return train_data, mock.MockData(cfg, args.seed + 1)


def microbatch(run, ds, first, train):
    """One global micro-batch of samples [first, first + mbs*lm_dp): this rank's share of it.
    Returns the sum of token losses on language ranks, zero elsewhere."""
    cfg, lay, par, device = run.cfg, run.lay, run.par, run.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    loss_sum = torch.zeros((), device=device)
    if run.vision is not None:
        own = parallel.lane_samples(lay, "vision", par.vision.dp_rank)
        patches, grids, rows = data.collate_images([ds[first + i] for i in own], cfg)
        with autocast:
            out = run.vision(model.host_to_device(patches, device), grids)
        if train and par.vision.tp_rank == 0:  # MFU: the tower's FLOPs count when it trains, not when frozen
            tower_trains = any(p.requires_grad for n, p in run.vision.named_parameters() if "mlp1" not in n)
            run.flops += model.vision_flops(cfg, grids, tower_trains)
        run.bridge.send(out, rows)
        if train and run.bridge.in_flight == 2:  # 1F1B: the previous microbatch's backward after this forward
            run.bridge.backward_encoder()
    if run.lm is not None:
        x, rows = run.bridge.recv()
        samples = [ds[first + i] for i in parallel.lane_samples(lay, "lm", par.lm.dp_rank)]
        ids, labels, seq_idx, valid = data.collate_text(samples)
        ids_dev, labels, seq_idx, valid = (None if t is None else model.host_to_device(t, device)
                                           for t in (ids, labels, seq_idx, valid))
        with autocast:  # seq_idx: document ids of packed rows; valid: False on padding
            h = model.place_images(run.lm.embed(ids_dev), ids, x, rows, cfg.image_token_id)
            if not x.numel():  # text only: an exact 0 ties the loss to the (empty) rows, so a frozen language
                h = h + x.requires_grad_().sum()  # model still runs the backward (its collectives) every lane runs
            s, _ = run.lm.loss_sum(run.lm(h, seq_idx, valid), labels)
        if train:
            s.backward()
            run.bridge.send_grad()
            if par.lm.tp_rank == 0:
                run.flops += ids.numel() * model.lm_flops_per_token(cfg, cfg.seq_len)
                run.real_tokens += sum(len(x.input_ids) - x.n_pad for x in samples)
        loss_sum = s.detach().float()
    if not train:
        run.bridge.release()
    return loss_sum


def lane_tokens(run, ds, first_sample, n_micro):
    """Loss tokens of this language lane's samples in n_micro micro-batches from first_sample (0 off language)."""
    if run.lm is None:
        return 0
    own, spm = parallel.lane_samples(run.lay, "lm", run.par.lm.dp_rank), run.lay.samples_per_microbatch
    return sum(int((ds[first_sample + m * spm + i].labels != -100).sum()) for m in range(n_micro) for i in own)


def reduce_loss(run, loss_sum):
    if run.lm is None:
        return 0.0
    dist.all_reduce(loss_sum, group=run.par.lm.dp_cp)
    return loss_sum.item()


def train_step(run, step, stop):
    """One optimizer step (the module docstring) -> its history entry, or None when a signal (`stop`, every rank
    agreeing at micro-batch boundaries) abandoned it; updates run.counters."""
    args, lay, lm, c = run.args, run.lay, run.lm, run.counters
    t0 = time.perf_counter()
    rng = failsafe.rng_state()
    lr = learning_rate(args, c["good_steps"], c["good_steps"] * args.global_batch)  # skipped steps advance neither
    for g in run.opt.param_groups if run.opt is not None else ():
        g["lr"] = lr
    base, n_micro = step * args.global_batch, lay.num_microbatches
    batch = run.train_loader.step(base, n_micro)  # {sample index: Sample}: this rank's samples of the step
    if isinstance(run.train_data, failsafe.SkipBad):
        run.train_data.skip_agreed(batch, run.train_loader.pixels, say=print if run.log_rank else lambda msg: None)
    n_global = parallel.global_token_count(run.par, lane_tokens(run, batch, base, n_micro))
    if lm is not None:
        moe.set_aux_loss_scale(lm, n_global / (n_micro * lay.lm_dp))
    loss_sum = torch.zeros((), device=run.device)
    run.flops = run.real_tokens = 0
    for k in range(n_micro):  # signal checks: language ranks before a micro-batch, vision after (failsafe.py)
        if lm is not None and stop():
            break
        loss_sum += microbatch(run, batch, base + k * lay.samples_per_microbatch, train=True)
        if lm is None and stop():
            break
    if stop.agreed:
        failsafe.abandon_step(run.bridge, run.modules, run.train_loader, base, rng)
        return None
    while run.bridge.in_flight:  # the encoder's last backward (1F1B cool-down)
        run.bridge.backward_encoder()
    vparams = list(run.vision.parameters()) if run.vision is not None else []
    lparams = list(lm.parameters()) if lm is not None else []
    norm, ok = parallel.finalize_gradients(run.par, vparams, lparams, n_global, args.clip_grad, run.opt)
    run.expert_counts = None
    if ok:
        if run.opt is not None:
            run.opt.step()
        if lm is not None:
            run.expert_counts = moe.update_expert_bias(lm, run.cfg.moe_bias_update_rate, run.par.lm.tp_dp)
        c["good_steps"] += 1
    else:
        c["skipped"] += 1
        if lm is not None:
            moe.discard_expert_counts(lm)
    c["consumed_samples"] += args.global_batch
    c["step"] = step + 1
    if run.opt is not None:
        run.opt.zero_grad(set_to_none=True)
    loss = reduce_loss(run, loss_sum) / max(n_global, 1)
    if run.device.type == "cuda":
        torch.cuda.synchronize()
    return {"step": step + 1, "loss": loss if lm is not None else None, "grad_norm": norm, "lr": lr, "ok": ok,
            "step_time_s": time.perf_counter() - t0}


def evaluate(run):
    """Score every sample of run.eval_set once -> {eval_loss (per token), eval_ppl, eval_tokens, eval_samples}.
    The samples and their tokens are the same in every layout, so are the numbers (up to summation order)."""
    spm = run.lay.samples_per_microbatch
    for m in run.modules.values():
        m.eval()
    total, tokens = torch.zeros((), device=run.device), 0
    with torch.no_grad():
        for first in range(0, len(run.eval_set), spm):  # one micro-batch at a time: eval sets can be large
            batch = run.eval_loader.step(first, 1)
            total += microbatch(run, batch, first, train=False)
            tokens += lane_tokens(run, batch, first, 1)
    for m in run.modules.values():
        m.train()
    n = parallel.global_token_count(run.par, tokens)
    loss = reduce_loss(run, total) / max(n, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": n,
            "eval_samples": run.eval_set.n}


def step_record(run, h, log):
    """The step's log record from its history entry (every rank takes part: two collectives)."""
    args, world = run.args, dist.get_world_size()
    per_rank = [None] * world  # every rank's peak memory, so a hetero run shows both grids, and its FLOPs
    dist.all_gather_object(per_rank, (round(logs.peak_memory_gib(run.device), 2), run.flops))
    h["model_flops"] = sum(f for _, f in per_rank)
    h["tokens"] = tokens = parallel.global_token_count(run.par, run.real_tokens)
    dt, elapsed, peak = h["step_time_s"], log.elapsed(), peak_tflops(run.device)
    tflops = h["model_flops"] / dt / world / 1e12
    rec = {"step": h["step"], "steps": args.steps, "loss": h["loss"], "grad_norm": h["grad_norm"], "lr": h["lr"],
           "skipped": run.counters["skipped"], "consumed_samples": run.counters["consumed_samples"],
           "tokens": tokens, "tokens_per_s": tokens / dt, "tokens_per_s_per_gpu": tokens / dt / world,
           "step_time_s": dt, "elapsed_s": elapsed,
           "eta_s": elapsed / (h["step"] - log.first) * (args.steps - h["step"]),
           "tflops_per_gpu": tflops if run.device.type == "cuda" else None, "mfu": tflops / peak if peak else None,
           "peak_mem_gib_per_rank": [m for m, _ in per_rank]}
    if run.expert_counts is not None and args.moe_stats_every and (h["step"] - 1) % args.moe_stats_every == 0:
        rec["moe"] = logs.moe_stats(run.expert_counts)
    return rec


def train(run):
    """The steps from run.counters["step"] to --steps, evaluations, checkpoints -> history (one dict per step)."""
    args, cfg = run.args, run.cfg
    saver = checkpoint.Saver(args.save, run.par, cfg, run.modules, run.opt, args, run.train_loader) \
        if args.save else None  # checks --save is writable on every rank
    log = logs.Log(args, run.log_rank, args.steps, run.counters["step"])
    if run.log_rank:
        summaries = [logs.data_summary("train", run.train_data)]
        if run.eval_set is not None:
            summaries.append(logs.data_summary("eval", run.eval_set.ds) + f" (scores {run.eval_set.n} samples)")
        log.start(cfg, args.save, summaries, logs.param_counts(cfg, args))
    if run.device.type == "cuda":   # step lines report the training peak; set-up's (fp32 init before the cast) apart
        log.say(f"set-up peak memory {logs.peak_memory_gib(run.device):.2f} GiB")
        torch.cuda.reset_peak_memory_stats(run.device)
    stop = failsafe.Stop(run.device)  # SIGINT / SIGTERM: every rank stops at the same micro-batch boundary
    history = []  # per step, on every rank: what tests and callers of main() inspect
    bad_steps = 0  # consecutive skipped (non-finite) steps
    for m in run.modules.values():
        m.train()
    failsafe.nothing_to_train(run.counters, args, say=log.say)
    for step in range(run.counters["step"], args.steps):
        h = train_step(run, step, stop)
        if h is None:
            break
        history.append(h)
        bad_steps = 0 if h["ok"] else bad_steps + 1
        failsafe.check_finite_run(bad_steps, cfg.max_skipped_steps, h["grad_norm"], args.save)
        if step % args.log_every == 0 or step == args.steps - 1:
            log.step(step_record(run, history[-1], log))
        log.bar.update(1)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            log.eval(step + 1, evaluate(run))
        if saver is not None:  # --save-every and the last step; also commits an async save
            saver.after_step(step + 1, dict(run.counters), last=step + 1 == args.steps)
    if stop.agreed and saver is not None and history:  # the last completed step (nothing new: nothing to save)
        saver.save(run.counters["step"], dict(run.counters))
    if saver is not None:
        saver.close()  # waits for an async save in flight
    if stop.agreed:
        log.say(failsafe.stop_message(stop.agreed, run.counters["step"], args.save, saved=bool(history)))
    log.close(run.counters["step"], args.save, run.argv)
    return history



def cli(argv=None):
    """The command line: main(), a user error (SystemExit with a message, a bad data line) printed as one line
    `error: <cause>. <fix>` by rank 0 (by another rank only when rank 0 lives on), exit status 2; --debug shows
    its traceback."""
    try:
        main(argv)
    except (SystemExit, data.BadSample) as e:
        # a DataLoader worker's BadSample carries the worker's traceback: its last line is the message
        bad_line = re.sub(r"^[\w.]*BadSample: ", "", str(e).strip().splitlines()[-1])
        msg = e.code if isinstance(e, SystemExit) else f"{bad_line}. Fix the line or pass --skip-bad-samples"
        if not isinstance(msg, str):              # --help, a plain exit status
            raise
        if "--debug" in (sys.argv[1:] if argv is None else argv):
            traceback.print_exc()
        if int(os.environ.get("RANK", 0)) != 0:  # rank 0 most likely failed too: its exit makes torchrun end
            time.sleep(ERROR_GRACE_S)             # this process meanwhile; if not, the error was this rank's only
        print(f"error: {msg.removeprefix('error: ')}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    failsafe.guard_streams()
    cli()
    sys.exit(failsafe.exit_status())
