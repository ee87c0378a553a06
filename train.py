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
"""
import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import checkpoint
import config
import data
import hf_interop
import lora
import memory
import model
import moe
import optim
import parallel
from bridge import Bridge
from radio import VisionModel

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
    p.add_argument("--data", default="mock", help="mock | PATH.jsonl | weighted blend '0.7:a.jsonl,0.3:b.jsonl'")
    p.add_argument("--eval-data", default=None, help="held-out JSONL (or blend) for --eval-every")
    p.add_argument("--eval-frac", type=float, default=0.0, help="else hold out the last FRAC of every --data file")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory (its chat template renders chats) or "
                   "tokenizer.json; default: offline byte-level tokenizer")
    p.add_argument("--train-on", choices=["assistant", "all"], default="assistant", help="chat tokens with loss")
    p.add_argument("--pack", action="store_true", help="pack documents into seq_len rows (document masks)")
    p.add_argument("--skip-bad-samples", action="store_true", help="skip and count bad JSONL lines, not fail")
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
    for name in ("vision-tp", "vision-dp", "lm-tp", "lm-dp", "lm-ep", "lm-etp"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--colocated", action="store_true", help="both modules on every rank")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--metrics-file", default=None)
    p.add_argument("--moe-stats-every", type=int, default=10)
    p.add_argument("--tensorboard", default=None)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-iters", type=int, default=2, help="global micro-batches per evaluation")
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
    args, rest = p.parse_known_args(argv)
    return args, parse_overrides(rest, p.error)


def parse_overrides(rest, error):
    """--field value | --field=value (what argparse left over) -> {field: value string} config overrides."""
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
    """--load HF_DIR: (the directory as a checkpoint source, the Config from its config.json plus --preset for the
    fields HF does not carry). The model's shape is the directory's: shape overrides are refused. Its tokenizer is
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
    return source, config.from_values(dataclasses.asdict(source.cfg), overrides)


def main(argv=None):
    args, overrides = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if args.dry_run and args.world_size:
        world = args.world_size
    hf_source = None
    if args.load and hf_interop.is_hf_dir(args.load):  # an HF directory: its model, fresh optimizer and counters
        hf_source, cfg = hf_model(args, overrides, say=print if rank == 0 else lambda msg: None)
    elif args.eval_only and args.load:  # evaluate the checkpoint's model, whatever --preset says
        cfg = checkpoint.saved_config(args.load, overrides)
    else:
        cfg = config.resolve(args.preset, overrides)
    grid_flags = dict(vision_tp=args.vision_tp, vision_dp=args.vision_dp, lm_tp=args.lm_tp, lm_dp=args.lm_dp,
                      lm_ep=args.lm_ep, lm_etp=args.lm_etp, colocated=True if args.colocated else None)
    lay = parallel.plan_layout(cfg, world, args.micro_batch, args.global_batch, **grid_flags)
    if args.dry_run:
        return memory.dry_run(cfg, lay, args)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if torch.cuda.is_available() else \
        torch.device("cpu")
    memory.check_fits(cfg, lay, args, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own_group = not dist.is_initialized()  # tests call main() inside an existing gloo group
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", world_size=world, rank=rank,
                                **({} if "MASTER_ADDR" in os.environ else  # plain `python train.py`
                                   {"init_method": f"file://{tempfile.mkdtemp()}/store"}))
    par = parallel.setup(lay, cfg)
    parallel.print_ranks(par)
    log_rank = par.lm is not None and par.lm.tp_rank == 0 and par.lm.dp_rank == 0
    if log_rank:
        print("config:", json.dumps(vars(cfg)), flush=True)

    vision = lm = None
    if par.in_vision:
        torch.manual_seed(args.seed + 10000)
        vision = VisionModel(cfg, par.vision.tp).to(device)  # drawn on the CPU: the same weights on any device
        torch.manual_seed(args.seed + 30000 + par.vision.dp_rank)
    if par.in_lm:
        groups = {"tp": par.lm.tp, "ep": par.lm.ep, "etp": par.lm.etp}
        with torch.device(device):
            lm = model.LanguageModel(cfg, groups, args.moe_dispatcher)
        coords = {k: (getattr(par.lm, f"{k}_rank"), getattr(par.lm, f"{k}_size")) for k in ("tp", "ep", "etp")}
        model.init_weights(lm, args.seed + 20000, coords, cfg)
        lm.checkpoint_layers = args.activation_checkpointing
    modules = {k: m for k, m in (("vision", vision), ("language", lm)) if m is not None}
    model.set_trainable(modules, args.stage, args.train_layers)
    if args.lora_rank:   # adapters only: everything else frozen
        lora.apply(modules, args, par, args.seed + 40000)
    vparams = list(vision.parameters()) if vision is not None else []
    lparams = list(lm.parameters()) if lm is not None else []
    opt = optim.build(par, vision, lm, args, device)
    train_data, eval_data = data.build(args, cfg, verbose=log_rank)
    own, pixels = data.rank_offsets(lay, par)  # this rank's samples of each micro-batch; pixels on vision ranks
    workers = args.num_workers if args.num_workers is not None else (2 if device.type == "cuda" else 0)
    train_loader = data.Loader(train_data, own, lay.samples_per_microbatch, pixels, workers)
    eval_loader = data.Loader(eval_data, own, lay.samples_per_microbatch, pixels) if eval_data is not None else None
    bridge = Bridge(par, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    # Model FLOPs of the step's training micro-batches, counted by each module's tp rank 0 of every lane from the
    # images and tokens it actually processed (summed over ranks when logged: MFU).
    tower_trains = vision is not None and any(p.requires_grad for n, p in vision.named_parameters() if "mlp1" not in n)
    lm_flops_per_token = model.lm_flops_per_token(cfg, cfg.seq_len)
    counted = {"flops": 0}

    def microbatch(ds, first, train):
        """One global micro-batch of samples [first, first + mbs*lm_dp): this rank's share of it.
        Returns the sum of token losses on language ranks, zero elsewhere."""
        loss_sum = torch.zeros((), device=device)
        if vision is not None:
            own = parallel.lane_samples(lay, "vision", par.vision.dp_rank)
            patches, grids, rows = data.collate_images([ds[first + i] for i in own], cfg)
            with autocast:
                out = vision(model.host_to_device(patches, device), grids)
            if train and par.vision.tp_rank == 0:
                counted["flops"] += model.vision_flops(cfg, grids, tower_trains)
            bridge.send(out, rows)
            if train and bridge.in_flight == 2:  # 1F1B: the previous microbatch's backward after this forward
                bridge.backward_encoder()
        if lm is not None:
            x, rows = bridge.recv()
            ids, labels, seq_idx, valid = data.collate_text([ds[first + i] for i in parallel.lane_samples(lay, "lm",
                                                                                                par.lm.dp_rank)])
            ids_dev, labels, seq_idx, valid = (None if t is None else model.host_to_device(t, device)
                                               for t in (ids, labels, seq_idx, valid))
            with autocast:  # seq_idx: document ids of packed rows; valid: False on padding
                h = model.place_images(lm.embed(ids_dev), ids, x, rows, cfg.image_token_id)
                s, _ = lm.loss_sum(lm(h, seq_idx, valid), labels)
            if train:
                s.backward()
                bridge.send_grad()
                if par.lm.tp_rank == 0:
                    counted["flops"] += ids.numel() * lm_flops_per_token
            loss_sum = s.detach().float()
        if not train:
            bridge.release()
        return loss_sum

    def lane_tokens(ds, first_sample, n_micro):
        if lm is None:
            return 0
        own = parallel.lane_samples(lay, "lm", par.lm.dp_rank)
        return sum(int((ds[first_sample + m * lay.samples_per_microbatch + i].labels != -100).sum())
                   for m in range(n_micro) for i in own)

    def reduce_loss(loss_sum):
        if lm is None:
            return 0.0
        dist.all_reduce(loss_sum, group=par.lm.dp_cp)
        return loss_sum.item()

    def evaluate():
        for m in modules.values():
            m.eval()
        total = torch.zeros((), device=device)
        batch = eval_loader.step(0, args.eval_iters)  # {sample index: Sample}, this rank's only
        with torch.no_grad():
            for k in range(args.eval_iters):
                total += microbatch(batch, k * lay.samples_per_microbatch, train=False)
        n = parallel.global_token_count(par, lane_tokens(batch, 0, args.eval_iters))
        for m in modules.values():
            m.train()
        return reduce_loss(total) / max(n, 1), n

    counters = dict(checkpoint.FRESH)  # step, good_steps, consumed_samples, skipped
    if args.load:  # any saved layout; resumes weights, AdamW, counters, RNG and data position (see checkpoint.py)
        counters = checkpoint.load(hf_source or args.load, par, modules, opt, cfg, train_loader,
                                   finetune=args.finetune or hf_source is not None,
                                   load_optim=not (args.no_load_optim or args.eval_only), load_rng=not args.no_load_rng)
    if args.eval_only:  # on the eval data, else on --data; the last line printed is the JSON result
        if eval_loader is None:
            eval_loader = data.Loader(train_data, own, lay.samples_per_microbatch, pixels)
        result = dict(zip(("eval_loss", "eval_tokens"), evaluate()))
        if log_rank:
            print(json.dumps(result), flush=True)
        if own_group:
            dist.destroy_process_group()
        return [result], modules
    saver = checkpoint.Saver(args.save, par, cfg, modules, opt, args, train_loader) if args.save else None
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.update(signal=signum))
    metrics = open(args.metrics_file, "a") if args.metrics_file and log_rank else None
    tb = None
    if args.tensorboard and log_rank:
        from torch.utils.tensorboard import SummaryWriter  # optional dependency
        tb = SummaryWriter(args.tensorboard)
    tokens_per_step = args.global_batch * cfg.seq_len
    peak = peak_tflops(device)
    good_steps, consumed, skipped = counters["good_steps"], counters["consumed_samples"], counters["skipped"]
    history = []  # per step, on every rank: what tests and callers of main() inspect
    for m in modules.values():
        m.train()
    bar = tqdm(total=args.steps, initial=counters["step"], unit="step",
               disable=not (log_rank and sys.stdout.isatty()))  # a progress bar only for a person watching
    for step in range(counters["step"], args.steps):
        t0 = time.perf_counter()
        lr = learning_rate(args, good_steps, good_steps * args.global_batch)  # skipped steps advance neither
        if opt is not None:
            for g in opt.param_groups:
                g["lr"] = lr
        base = step * args.global_batch
        n_micro = lay.num_microbatches
        batch = train_loader.step(base, n_micro)  # {sample index: Sample}: this rank's samples of the step
        n_global = parallel.global_token_count(par, lane_tokens(batch, base, n_micro))
        if lm is not None:
            moe.set_aux_loss_scale(lm, n_global / (n_micro * lay.lm_dp))
        loss_sum = torch.zeros((), device=device)
        counted["flops"] = 0
        for k in range(n_micro):
            loss_sum += microbatch(batch, base + k * lay.samples_per_microbatch, train=True)
        while bridge.in_flight:  # the encoder's last backward (1F1B cool-down)
            bridge.backward_encoder()
        norm, ok = parallel.finalize_gradients(par, vparams, lparams, n_global, args.clip_grad, opt)
        counts = None
        if ok:
            if opt is not None:
                opt.step()
            if lm is not None:
                counts = moe.update_expert_bias(lm, cfg.moe_bias_update_rate, par.lm.tp_dp)
            good_steps += 1
        else:
            skipped += 1
            if lm is not None:
                moe.discard_expert_counts(lm)
        consumed += args.global_batch
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        loss = reduce_loss(loss_sum) / max(n_global, 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        history.append({"step": step + 1, "loss": loss if lm is not None else None, "grad_norm": norm, "lr": lr,
                        "ok": ok, "step_time_s": dt})
        stop_now = torch.tensor([0 if stop["signal"] is None else 1], device=device)
        dist.all_reduce(stop_now, op=dist.ReduceOp.MAX)  # every rank stops after the same step
        stopping = bool(stop_now.item())
        log_now = step % args.log_every == 0 or step == args.steps - 1
        per_rank = [(None, 0)] * world
        if log_now:  # every rank's peak memory, so a hetero run shows both grids, and its counted FLOPs
            dist.all_gather_object(per_rank, (round(peak_memory_gib(device), 2), counted["flops"]))
            history[-1]["model_flops"] = sum(f for _, f in per_rank)
        mem_per_rank = [m for m, _ in per_rank]
        if log_rank and log_now:
            tflops = history[-1]["model_flops"] / dt / world / 1e12
            rec = {"step": step + 1, "loss": loss, "grad_norm": norm, "lr": lr, "skipped": skipped,
                   "consumed_samples": consumed, "tokens": tokens_per_step, "tokens_per_s": tokens_per_step / dt,
                   "tokens_per_s_per_gpu_lm": tokens_per_step / dt / lay.lm_size,
                   "tokens_per_s_per_gpu_all": tokens_per_step / dt / world, "step_time_s": dt,
                   "tflops_per_gpu": tflops if device.type == "cuda" else None,
                   "mfu": tflops / peak if peak else None, "peak_mem_gib": peak_memory_gib(device),
                   "peak_mem_gib_per_rank": mem_per_rank}
            if counts is not None and args.moe_stats_every and step % args.moe_stats_every == 0:
                rec["moe"] = moe_stats(counts)
            if bar.disable:
                print(format_line(rec), flush=True)
            else:
                tqdm.write(format_line(rec))
            if metrics:
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
            if tb:
                for key, name in (("loss", "lm loss"), ("lr", "learning-rate"), ("grad_norm", "grad-norm"),
                                  ("step_time_s", "iteration-time"), ("tokens_per_s", "throughput")):
                    tb.add_scalar(name, rec[key], step + 1)
                for key, value in rec.get("moe", {}).items():
                    if not isinstance(value, list):
                        tb.add_scalar(f"moe/{key}", value, step + 1)
        bar.update(1)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            eval_loss, eval_tokens = evaluate()
            if log_rank:
                print(f"eval step {step + 1}: loss {eval_loss:.4f} over {eval_tokens} tokens", flush=True)
        if saver is not None:  # --save-every, the last step and a stop signal save; also commits an async save
            saver.after_step(step + 1, dict(step=step + 1, good_steps=good_steps, consumed_samples=consumed,
                                            skipped=skipped), last=stopping or step + 1 == args.steps)
        if stopping:
            if log_rank:
                print(f"stopping after step {step + 1} on signal", flush=True)
            break
    bar.close()
    if saver is not None:
        saver.close()  # waits for an async save in flight
    if metrics:
        metrics.close()
    if own_group:
        dist.destroy_process_group()
    return history, modules


def moe_stats(counts_LE):
    """Per MoE layer: expert load entropy (nats; log E when balanced), max load fraction, tokens, counts."""
    frac = counts_LE / counts_LE.sum(-1, keepdim=True).clamp_min(1)
    entropy = -(frac * frac.clamp_min(1e-12).log()).sum(-1)
    return {"routing_entropy_mean": entropy.mean().item(), "max_expert_load_frac": frac.max().item(),
            "tokens_per_layer": counts_LE.sum(-1).tolist(), "expert_counts": counts_LE.long().tolist()}


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def format_line(r):
    na = lambda v, f: "N/A" if v is None else format(v, f)
    return (f"step {r['step']} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad norm {r['grad_norm']:.3f} | "
            f"skipped {r['skipped']} | tok/s/gpu {r['tokens_per_s_per_gpu_lm']:.0f} (lm) "
            f"{r['tokens_per_s_per_gpu_all']:.0f} (all) | TFLOP/s/gpu {na(r['tflops_per_gpu'], '.1f')} | "
            f"MFU {na(r['mfu'], '.1%')} | {r['step_time_s'] * 1e3:.0f} ms | peak mem GiB per rank "
            f"{r['peak_mem_gib_per_rank']}")


if __name__ == "__main__":
    main()
