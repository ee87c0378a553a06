"""Measure the training code paths: python bench.py --preset 20l --n-routed-experts 16 [--vs-hf] [--parts ...]

Parts (each: burn-in, then synchronised timing of --iters iterations, bf16 autocast):
  lm      language model fwd+bwd (batch --batch, seq --seq-len): tokens/s, TFLOP/s, MFU, peak memory; weights as
          train.py keeps them (optim.build): bf16 on CUDA, gradients accumulated into fp32 main_grad
  graph   the lm part replayed from one CUDA graph (captured after warm-up; every shape static at ep 1): lm - graph
          is what the host's Python and launch overhead costs the step
  step    lm fwd+bwd of the loss sum + what train.py runs after it (optim.AdamW on one rank: norm, division by
          the tokens and clipping, fused AdamW on the fp32 main weights, their copy into the bf16 weights)
  vision  vision tower + projector fwd+bwd on one mock_image_size image (stage 3: the whole tower trains)
  moe     one MoE layer fwd+bwd, against two dense bf16 GEMMs (fwd+bwd) with the routed experts' FLOPs
  mamba   one Mamba2 layer fwd+bwd
  train   train.py's own steps (mock data; flags in --train-args, one process or torchrun) with the router as it
          trains, then with --moe-force-balance (every expert the same rows, as published throughputs route):
          ms per step, tokens/s per GPU, MFU. Step 1 (compilation) is left out.
  bridge  (torchrun, a hetero layout given by --train-args) train.py's own steps with the mock images, then the same
          steps with every sample text-only (the encoder sends 0-row payloads): the encoder's and the bridge's
          overhead on the language step, with images / text-only - 1.
  --vs-hf the same language config through transformers' NemotronHForCausalLM (bf16, SDPA, grouped_mm experts,
          mamba kernels), in the same process: both figures and the ratio.
FLOPs come from model.lm_flops_per_token / radio.flops. The last line is one JSON object;
--out FILE also writes a dated markdown report.
"""
import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import time

import torch
import torch.distributed as dist

import cli
import config
import logs
import model
import optim
import parallel
import radio
from radio import VisionModel
import train


def timed(fn, iters, warmup):
    """Mean seconds per call after `warmup` calls (synchronised), and peak memory of the timed calls."""
    for _ in range(warmup):
        fn()
    sync()
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    dt = (time.perf_counter() - t0) / iters
    mem = torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None
    return dt, mem


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def figures(name, dt, mem, flops, tokens, peak):
    tflops = flops / dt / 1e12
    out = {"part": name, "ms": dt * 1e3, "tflops": tflops, "mfu": tflops / peak if peak else None,
           "peak_mem_gib": mem, "tokens_per_s": tokens / dt}
    print_row(out)
    return out


def print_row(out):
    print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()), flush=True)


KERNEL_KINDS = (("GEMM", r"nvjet|gemm|cutlass|xmma|cublas"), ("attention", r"sdpa|flash|fmha"),
                ("Mamba kernels", r"chunk|state_passing|ssd|conv1d|_layer_norm_(fwd|bwd)|bmm|selective"),
                ("norms", r"layer_norm|rms_norm|GammaBeta"),
                ("casts and copies", r"direct_copy|copy_kernel"), ("fused.py (compiled)", r"triton_"))


def profile(fn, label):
    """One call of fn under the CUDA profiler: CUDA time per kernel kind (regexes above), then the top kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages() if e.self_device_time_total]
    total = sum(ms for _, ms, _ in rows)
    kinds = {}
    for name, ms, _ in rows:
        kind = next((k for k, rx in KERNEL_KINDS if re.search(rx, name)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    print(f"profile {label}: {total:.1f} ms of CUDA time: " +
          ", ".join(f"{k} {ms:.1f} ms ({ms / total:.0%})" for k, ms in sorted(kinds.items(), key=lambda x: -x[1])))
    for name, ms, n in sorted(rows, key=lambda r: -r[1])[:25]:
        print(f"  {ms:8.2f} ms {n:5d}x  {name[:110]}")


def as_trained(module, dev):
    """The optimizer train.py would build for `module` on one rank (optim.build): on CUDA bf16 weights whose
    gradients accumulate into fp32 main_grad buffers, fp32 main weights in the optimizer. Its finish() takes a
    process group (the norm's all-reduce): one of this process alone, unless there is one."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return optim.build(parallel.one_device(), None, module, config.Config(lr=1e-5, weight_decay=0.1), dev)


def lm_fwd_bwd(cfg, batch, dev, with_step=False):
    """A language model as train.py keeps it (as_trained) and its fwd+bwd (+ optimizer step) on random ids."""
    lm = model.LanguageModel(cfg).to(dev)
    model.init_weights(lm, 0, {}, cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=dev)
    opt = as_trained(lm, dev)

    def fwd_bwd():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            s, _ = lm.loss_sum(lm(lm.embed(ids)), ids)
        s.backward()   # train.py's: the sum; finish divides by the tokens
        if with_step:   # what train.py runs after backward: reduce, norm, divide by the tokens and clip, AdamW
            opt.finish(ids.numel(), 1.0)   # every id is a label
            opt.step()
        opt.zero_grad()
    return fwd_bwd


def bench_lm(cfg, args, dev, peak, part):
    fwd_bwd = lm_fwd_bwd(cfg, args.batch, dev, with_step=part == "step")
    if part == "graph":
        if dev.type != "cuda":
            raise SystemExit("--parts graph needs a GPU: it replays a CUDA graph")
        fwd_bwd = cuda_graphed(fwd_bwd, args.warmup)
    dt, mem = timed(fwd_bwd, args.iters, args.warmup)
    if part == "graph":
        mem = None   # the graph's memory was taken at capture, before timed() resets the peak
    if args.profile:
        profile(fwd_bwd, part)
    tokens = args.batch * cfg.seq_len
    return figures(part, dt, mem, tokens * model.lm_flops_per_token(cfg, cfg.seq_len), tokens, peak)


def cuda_graphed(fn, warmup):
    """fn captured in one CUDA graph; its replay. The eager calls before the capture run on a side stream, as
    capture requires, and compile and autotune every kernel there."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 2)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_hf(cfg, args, dev, peak):
    from transformers import NemotronHConfig, NemotronHForCausalLM
    from hf_interop import hf_config
    hf_cfg = NemotronHConfig(**hf_config(cfg), attn_implementation="sdpa", experts_implementation="grouped_mm")
    hf = NemotronHForCausalLM(hf_cfg).to(dev, torch.bfloat16).train()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=dev)

    def fwd_bwd():
        hf(input_ids=ids, labels=ids).loss.backward()
        hf.zero_grad(set_to_none=True)

    dt, mem = timed(fwd_bwd, args.iters, args.warmup)
    tokens = args.batch * cfg.seq_len
    return figures("hf_lm", dt, mem, tokens * model.lm_flops_per_token(cfg, cfg.seq_len), tokens, peak)


def bench_layer(kind, cfg, args, dev, peak):
    """One layer of `kind` (M or E) of the preset, fwd+bwd on [batch, seq, hidden]."""
    layer = model.Block(kind, cfg, {}, "alltoall").to(dev)
    holder = torch.nn.Module()
    holder.layer = layer
    model.init_weights(holder, 0, {}, cfg)
    opt = as_trained(holder, dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the residual stream's dtype in training
    x = torch.randn(args.batch, cfg.seq_len, cfg.hidden_size, device=dev, dtype=dtype, requires_grad=True)

    def fwd_bwd():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            y = layer.mixer(x)
        y.float().square().mean().backward()
        opt.zero_grad()  # as a training step starts: gradients are written, not accumulated
        x.grad = None

    dt, mem = timed(fwd_bwd, args.iters, args.warmup)
    if args.profile:
        profile(fwd_bwd, "moe" if kind == "E" else "mamba")
    T, D = args.batch * cfg.seq_len, cfg.hidden_size
    if kind == "E":
        k, F_, Fs = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
        flops = 6 * T * (k * 2 * D * F_ + 2 * D * Fs + D * cfg.n_routed_experts)
    else:
        flops = T * (6 * sum(p.numel() for n, p in layer.named_parameters() if "proj" in n)
                     + model.kind_facts(cfg, "M", cfg.seq_len)["flops"])
    out = figures("moe" if kind == "E" else "mamba", dt, mem, flops, T, peak)
    if kind == "E" and dev.type == "cuda":  # the routed FLOPs as two plain bf16 GEMMs (no activation): the ceiling
        a = torch.randn(T * k, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w1 = torch.randn(D, F_, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w2 = torch.randn(F_, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(T * k, D, device=dev, dtype=torch.bfloat16)

        def dense():
            ((a @ w1) @ w2).backward(g)
            a.grad = w1.grad = w2.grad = None

        ddt, _ = timed(dense, args.iters, args.warmup)
        dense_tflops = 6 * T * k * 2 * D * F_ / ddt / 1e12
        out["dense_equiv_tflops"] = dense_tflops
        out["moe_vs_dense"] = out["tflops"] / dense_tflops
        print(f"dense GEMM chain, same routed FLOPs: {dense_tflops:.1f} TFLOP/s; MoE layer at "
              f"{out['moe_vs_dense']:.1%} of it", flush=True)
    return out


def bench_vision(cfg, args, dev, peak):
    vision = VisionModel(cfg).to(dev)
    side = cfg.mock_image_size // cfg.vit_patch
    patches = torch.randn(side * side, 3 * cfg.vit_patch ** 2, device=dev)
    opt = as_trained(vision, dev)

    def fwd_bwd():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            y = vision(patches, [(side, side)])
        y.float().square().mean().backward()
        opt.zero_grad()

    dt, mem = timed(fwd_bwd, args.iters, args.warmup)
    if args.profile:
        profile(fwd_bwd, "vision")
    return figures("vision", dt, mem, radio.flops(cfg, [(side, side)], tower_trains=True), side * side, peak)


def train_steps(argv, peak):
    """train.main's steps after the first -> (seconds per step, tokens/s per GPU, MFU or None)."""
    history, _ = train.main(argv + ["--log-every", "1"])
    rest, world = history[1:], dist.get_world_size()
    seconds = sum(h["step_time_s"] for h in rest)
    mfu = sum(h["model_flops"] for h in rest) / seconds / world / 1e12 / peak if peak else None
    return seconds / len(rest), sum(h["tokens"] for h in rest) / seconds / world, mfu


def bench_train(args, rest, part, peak):
    """`train` or `bridge` (see the module docstring): two runs of train.py's steps in one process group."""
    for key, value in (("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29511"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)   # a lone `python bench.py`: a group of one
    if part == "bridge" and int(os.environ["WORLD_SIZE"]) < 2:
        raise SystemExit("--parts bridge needs a hetero layout: torchrun --nproc_per_node=2 (or more) bench.py ...")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():   # one group for both runs (a lone process may hold as_trained's already)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    argv = ["--preset", args.preset, "--steps", str(args.iters + 1), *shlex.split(args.train_args), *rest]
    runs = (("real", []), ("balanced", ["--moe-force-balance"])) if part == "train" else \
        (("with_images", []), ("text_only", ["--mock-text-only-frac", "1.0"]))
    out = {"part": part, "world": dist.get_world_size()}
    for name, extra in runs:
        s, tok, mfu = train_steps(argv + extra, peak)
        out.update({f"{name}_ms": s * 1e3, f"{name}_tokens_per_s_per_gpu": tok, f"{name}_mfu": mfu})
    if part == "bridge":
        out["overhead"] = out["with_images_ms"] / out["text_only_ms"] - 1
    dist.destroy_process_group()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="20l")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--parts", default="lm,step,moe,mamba,vision,train")
    p.add_argument("--vs-hf", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="per part: CUDA time by kernel kind and the top kernels of one call")
    p.add_argument("--out", default=None, help="markdown report to write (e.g. bench/2026-11-22-h100.md)")
    p.add_argument("--train-args", default="", help="train and bridge parts: train.py flags, e.g. '--vision-dp 1 "
                   "--lm-dp 1 --mock-image-size 1024 --stage 3 --global-batch 16'")
    args, rest = p.parse_known_args(argv)
    cfg, overrides = cli.config_of(["--preset", args.preset] + rest), " ".join(rest)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.profile and dev.type != "cuda":
        raise SystemExit("--profile times CUDA kernels: it needs a GPU")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    peak = logs.peak_tflops(dev)
    torch.backends.cuda.matmul.allow_tf32 = True
    results = {}
    parts = args.parts.split(",")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and parts not in (["bridge"], ["train"]):
        raise SystemExit("under torchrun only --parts bridge or train runs; the other parts measure one process on "
                         "one GPU")
    for part in parts:
        if part in ("bridge", "train"):
            results[part] = bench_train(args, rest, part, peak)
            if int(os.environ["RANK"]) != int(os.environ["WORLD_SIZE"]) - 1:  # the last rank (language) reports
                return results
            print_row(results[part])
        elif part in ("lm", "graph", "step"):
            results[part] = bench_lm(cfg, args, dev, peak, part)
        elif part in ("moe", "mamba"):
            results[part] = bench_layer("E" if part == "moe" else "M", cfg, args, dev, peak)
        elif part == "vision":
            results[part] = bench_vision(cfg, args, dev, peak)
        else:
            raise SystemExit(f"unknown part {part!r}")
        torch.cuda.empty_cache()   # a no-op without CUDA
    if args.vs_hf:
        results["hf_lm"] = bench_hf(cfg, args, dev, peak)
        if "lm" in results:
            results["speedup_vs_hf"] = results["lm"]["tokens_per_s"] / results["hf_lm"]["tokens_per_s"]
            print(f"speedup vs HF NemotronH: {results['speedup_vs_hf']:.2f}x", flush=True)
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(  # GIT_COMMIT: for a copy of the tree without .git
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit or None,
            "date": datetime.date.today().isoformat(), "preset": args.preset, "overrides": overrides,
            "batch": args.batch, "seq_len": cfg.seq_len}
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# bench {meta['date']}: {args.preset} {overrides} on {name}\n\n")
            f.write("\n".join(f"- {k}: {v}" for k, v in meta.items()) + "\n\n| part | result |\n|---|---|\n")
            for k, v in results.items():
                f.write(f"| {k} | {json.dumps(v)} |\n")
    print(json.dumps({**meta, **results}))


if __name__ == "__main__":
    main()
