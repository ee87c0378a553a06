"""GPU fast paths == CPU reference paths (skipped without CUDA). Tolerances: decoder spec section 10."""
import pytest
import torch

import cli
import config
import model
import moe
from mamba import Mamba2Mixer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def nano_mamba(seed=0):
    cfg = config.resolve("nano")  # realistic width: 64 heads x 64, 8 groups, state 128, chunk 128
    torch.manual_seed(seed)
    with torch.device("cuda"):
        mixer = Mamba2Mixer(cfg)
    holder = torch.nn.Module()
    holder.mixer = mixer
    model.init_weights(holder, seed, {}, cfg)
    return cfg, mixer


@cuda
@pytest.mark.parametrize("packed", [False, True])
def test_mamba_kernel_matches_reference_fp32(packed):
    cfg, mixer = nano_mamba()
    L = 1000  # not a multiple of the chunk
    zxbcdt = (torch.randn(2, L, mixer.in_proj.out_features, device="cuda") * 0.5).requires_grad_()
    seq_idx = None
    if packed:
        seq_idx = torch.cat([torch.zeros(2, 300), torch.ones(2, 450), torch.full((2, 250), 2)], 1).long().cuda()
    out_k = mixer._kernel_path(zxbcdt, seq_idx)
    g = torch.randn_like(out_k)
    grads_k = torch.autograd.grad(out_k, [zxbcdt] + list(mixer.parameters()), g, allow_unused=True)
    out_r = mixer._reference_path(zxbcdt, seq_idx)
    grads_r = torch.autograd.grad(out_r, [zxbcdt] + list(mixer.parameters()), g, allow_unused=True)
    assert rel_err(out_k, out_r) < 1e-2
    names = ["zxbcdt"] + [n for n, _ in mixer.named_parameters()]
    for name, gk, gr in zip(names, grads_k, grads_r):
        if gr is None:
            continue
        assert rel_err(gk, gr) < 1e-1, name
    print(f"mamba packed={packed}: out rel {rel_err(out_k, out_r):.2e}, "
          + ", ".join(f"{n} {rel_err(a, b):.1e}" for n, a, b in zip(names, grads_k, grads_r) if b is not None))


@cuda
@pytest.mark.parametrize("heads,head_dim,groups,state,conv", [(12, 16, 3, 16, 4), (5, 3, 1, 4, 4), (8, 16, 2, 16, 5)],
                         ids=["row492", "conv23", "width5"])
def test_mamba_odd_widths_gpu_match_cpu(heads, head_dim, groups, state, conv):
    """Widths the kernels' layout rules reject: an in_proj row of 492 (not a multiple of 8, as a tiny Omni's 12
    heads x 8 give 300; head dim 16 keeps the kernels at the tiny preset's tuned shapes, tuned.py) goes to the
    kernel as a padded row's view; 23 conv channels (the conv kernel reads 8 at a time) and a conv width of 5
    (causal_conv1d takes 2 to 4) take the reference path on CUDA. All == the CPU, values and gradients (fp32),
    packed rows."""
    cfg = config.resolve("tiny", dict(mamba_num_heads=heads, mamba_head_dim=head_dim, n_groups=groups,
                                      ssm_state_size=state, conv_kernel=conv))
    holder = torch.nn.Module()
    holder.mixer = Mamba2Mixer(cfg)
    model.init_weights(holder, 0, {}, cfg)
    u = torch.randn(2, 200, cfg.hidden_size)
    seq_idx = torch.cat([torch.zeros(2, 120), torch.ones(2, 80)], 1).long()
    res = []
    for dev in ("cpu", "cuda"):
        mixer, x = holder.mixer.to(dev), u.detach().to(dev).requires_grad_()
        mixer.zero_grad()
        y = mixer(x, seq_idx.to(dev))
        y.square().sum().backward()
        res.append([t.detach().cpu().clone() for t in [y, x.grad] + [p.grad for p in mixer.parameters()]])
    errs = [rel_err(a, b) for a, b in zip(*res)]   # the kernel's tolerances: docs/decoder.md §4
    assert errs[0] < 1e-2 and max(errs[1:]) < 1e-1, errs
    print(f"mamba {heads}x{head_dim}, {groups} groups: out rel {errs[0]:.1e}, grads max rel {max(errs[1:]):.1e}")


@cuda
def test_mamba_kernels_take_the_tuned_configs():
    """The tiny preset's Mamba forward and backward under bf16 autocast, as training runs it: each SSD kernel whose
    shape tuned.TABLE holds ran the config the table names (tuned.pin; the autotuner chose otherwise in some
    processes: bench/2026-11-26-startup.md), and the table held the shapes of most of the kernels that ran."""
    import tuned
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("tuned.TABLE applies on compute capability 9.0")
    cfg = config.resolve("tiny")
    holder = torch.nn.Module()
    holder.mixer = Mamba2Mixer(cfg)
    model.init_weights(holder, 0, {}, cfg)
    mixer = holder.mixer.cuda()
    u = torch.randn(2, cfg.seq_len, cfg.hidden_size, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        mixer(u).float().square().mean().backward()
    ran = tuned.chosen()
    tabled = {k: text for k, text in ran.items() if k[1] in tuned.TABLE.get(k[0], {})}
    assert len(tabled) >= 12, sorted(ran)
    assert all(text == tuned.TABLE[name][shape] for (name, shape), text in tabled.items()), tabled
    print(f"{len(tabled)} of {len(ran)} (kernel, shape) pairs so far took their tabled config")


@cuda
def test_grouped_mm_matches_loop_bf16():
    torch.manual_seed(0)
    counts = torch.tensor([0, 37, 5, 0, 130, 1, 64, 19], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(8, 512, 256, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    y = moe.grouped_mm(x, w, counts)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    ref = moe.grouped_mm(x.float(), w.float(), counts)
    rx, rw = torch.autograd.grad(ref, (x, w), g.float())
    assert rel_err(y, ref) < 1e-2 and rel_err(gx, rx) < 1e-2 and rel_err(gw, rw) < 1e-2


@cuda
def test_relu2_down_grouped_bf16_matches_fp32_loop():
    """moe.relu2_down on bf16 CUDA (grouped GEMMs, the weight gradients by grouped_mm_weight_grad, the compiled
    pointwise passes) == the CPU path's loop in fp32, with a LoRA A beside the down weight and empty experts."""
    torch.manual_seed(0)
    counts = torch.tensor([0, 37, 5, 0, 130, 1, 64, 19], device="cuda")
    h = torch.randn(int(counts.sum()), 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(8, 256, 512, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    a = (torch.randn(8, 8, 512, device="cuda") * 0.05).requires_grad_()       # fp32: cast inside, as autocast would
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, z = moe.relu2_down(h, counts, w, a)
    gy, gz = torch.randn_like(y), torch.randn_like(z)
    got = torch.autograd.grad((y, z), (h, w, a), (gy, gz))
    assert y.dtype == z.dtype == torch.bfloat16 and [g.dtype for g in got] == [torch.bfloat16] * 2 + [torch.float32]
    hf = h.detach().float().requires_grad_()
    ref = [moe.grouped_mm(torch.relu(hf) ** 2, p.float(), counts) for p in (w, a)]
    want = torch.autograd.grad(ref, (hf, w, a), (gy.float(), gz.float()))
    assert rel_err(y, ref[0]) < 1e-2 and rel_err(z, ref[1]) < 1e-2
    assert all(rel_err(g, r) < 1e-2 for g, r in zip(got, want))


@cuda
@pytest.mark.parametrize("preset,over", [("tiny", {}), ("small", {}), ("small", dict(
    moe_latent_size=64, num_nextn_predict_layers=1, mtp_depths=2))], ids=["tiny", "small", "small-latent-mtp"])
def test_language_model_gpu_matches_cpu_fp32(preset, over):
    """small-latent-mtp: Nemotron 3 Super's LatentMoE (grouped GEMMs in the latent width) and two MTP depths sharing
    one block, their losses in the objective."""
    cfg = config.resolve(preset, over)
    lm_cpu = model.LanguageModel(cfg)
    model.init_weights(lm_cpu, 0, {}, cfg)
    lm_gpu = model.LanguageModel(cfg).cuda()
    lm_gpu.load_state_dict(lm_cpu.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 200))
    seq_idx = torch.cat([torch.zeros(2, 77), torch.ones(2, 123)], 1).long()
    losses = []
    for lm, dev in ((lm_cpu, "cpu"), (lm_gpu, "cuda")):
        h = lm.embed(ids.to(dev))
        hidden = lm(h, seq_idx.to(dev))
        s, n = lm.loss_sum(hidden, ids.to(dev))
        if cfg.num_nextn_predict_layers:
            s = s + sum(lm.mtp_losses(hidden, h, ids.to(dev), seq_idx.to(dev)))
        (s / n).backward()
        losses.append((s / n).item())
    assert abs(losses[0] - losses[1]) < 1e-3 * abs(losses[0])
    for (name, pc), pg in zip(lm_cpu.named_parameters(), lm_gpu.parameters()):
        assert rel_err(pg.grad.cpu(), pc.grad) < 5e-2, name


@cuda
def test_language_model_bf16_autocast_close_to_fp32():
    cfg = config.resolve("small")
    lm = model.LanguageModel(cfg).cuda()
    model.init_weights(lm, 0, {}, cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 1024), device="cuda")
    with torch.no_grad():
        ref = lm.loss_sum(lm(lm.embed(ids)), ids)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = lm.loss_sum(lm(lm.embed(ids)), ids)
    assert abs(out[0].item() - ref[0].item()) / ref[0].item() < 2e-2


@cuda
@pytest.mark.parametrize("frames", [None, [2, 1, 2]])
def test_vision_cuda_attention_path_matches_cpu_fp32(frames):
    """On CUDA the packed ViT attends per image (flash SDPA loop); on CPU with a block-diagonal mask. frames: video
    tubelets of 2 frames (the video embedder) beside an image, through the same attention."""
    from radio import VisionModel
    cfg = config.resolve("small", {"video_temporal_patch": "2"})          # vit-b: 12 heads of 64, as in training
    torch.manual_seed(0)
    cpu = VisionModel(cfg)
    gpu = VisionModel(cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    grids = [(8, 12), (16, 4), (6, 6)]
    patches = torch.randn(sum(h * w * t for (h, w), t in zip(grids, frames or [1] * 3)), 3 * cfg.vit_patch ** 2)
    outs, grads = [], []
    for m, dev in ((cpu, "cpu"), (gpu, "cuda")):
        y = m(patches.to(dev), grids, frames)
        y.square().mean().backward()
        outs.append(y.detach().cpu())
        grads.append(m.blocks[0].attn.qkv.weight.grad.cpu())
        if frames:
            grads.append(m.video_embedder.weight.grad.cpu())
    assert rel_err(outs[1], outs[0]) < 1e-4 and rel_err(grads[-1 - bool(frames)], grads[0]) < 1e-3
    if frames:
        assert rel_err(grads[3], grads[1]) < 1e-3


@cuda
def test_packed_attention_flex_matches_cpu_mask():
    """Packed rows on CUDA attend through FlexAttention's block mask (memory linear in the row), on the CPU through
    a boolean mask: the same outputs and gradients (fp32), whole rows and a cp rank's two zigzag chunks."""
    import cp
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 1024, 64, generator=g) for h in (8, 2, 2))
    seq_idx = torch.tensor([[0] * 300 + [1] * 500 + [2] * 224, [0] * 1000 + [1] * 24])
    for spans, pos in (([(0, 1024)], torch.arange(1024)), (cp.spans(1024, 1, 2),
                                                            cp.local(torch.arange(1024), 1, 2, 0))):
        res = []
        for dev in ("cpu", "cuda"):
            t = [x.detach().to(dev).requires_grad_() for x in (q[:, :, pos], k, v)]
            o = model.attend(*t, spans, seq_idx.to(dev))
            o.square().sum().backward()
            res.append([x.detach().cpu().clone() for x in [o] + [x.grad for x in t]])
        assert all(rel_err(a, b) < 1e-3 for a, b in zip(res[1], res[0])), [rel_err(a, b) for a, b in zip(*res)]


@cuda
def test_fused_kernels_compiled_match_eager():
    """Each fused.* function: its torch.compile'd CUDA version == the same function run eagerly (bf16 inputs,
    fp32 math inside both), values and gradients; the norms (not compiled) == themselves on fp32 copies."""
    import fused
    torch.manual_seed(0)
    x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(256, device="cuda")).requires_grad_()
    ln = torch.nn.LayerNorm(256, eps=1e-6, device="cuda")
    with torch.no_grad():
        ln.weight.add_(0.1 * torch.randn(256, device="cuda")), ln.bias.add_(0.1 * torch.randn(256, device="cuda"))
    ln16 = torch.nn.LayerNorm(256, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    ln16.load_state_dict(ln.state_dict())
    # the norms: bf16 in, torch's kernels (no compile) == the same function on fp32 copies (the CPU's math)
    cases = ((fused.squared_relu, (x,), fused.squared_relu.__wrapped__, (x,)),
             (fused.rms_norm, (x, w.bfloat16(), 1e-5), fused.rms_norm, (x.float(), w, 1e-5)),
             (fused.layer_norm, (x, ln16), fused.layer_norm, (x.float(), ln)))
    for fn, args, ref_fn, ref_args in cases:
        with torch.autocast("cuda", dtype=torch.bfloat16):   # as the models call them
            out, ref = fn(*args), ref_fn(*ref_args)
        assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2, fn
        g = torch.randn_like(out)
        assert rel_err(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g.to(ref.dtype))[0]) < 1e-2, fn

    N, V, T, K = 64, 1000, 50, 3
    logits = torch.randn(N, V, device="cuda").to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    hit = torch.rand(N, device="cuda") > 0.3
    g = torch.rand(N, device="cuda")
    lse, pick = fused.logsumexp_and_pick(logits, t)
    lse_ref, pick_ref = fused.logsumexp_and_pick.__wrapped__(logits, t)
    assert rel_err(lse, lse_ref) < 1e-6 and rel_err(pick, pick_ref) < 1e-6
    args = (logits, lse_ref, t, hit, g)
    assert rel_err(fused.cross_entropy_grad(*args), fused.cross_entropy_grad.__wrapped__(*args)) < 1e-2

    y = torch.randn(T * K, 256, device="cuda", dtype=torch.bfloat16)
    gt = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(T * K, device="cuda")
    unorder = moe.inverse_permutation(order)
    wk = torch.rand(T, K, device="cuda")
    for fn, args in ((fused.sum_routed, (y, unorder, wk)), (fused.spread_to_routed, (gt, order, wk)),
                     (fused.routed_dots, (y, unorder, gt))):
        assert rel_err(fn(*args), fn.__wrapped__(*args)) < 1e-2, fn.__name__


def checkpoint_bytes(cfg, stage=2):
    """Bytes of a training checkpoint of Config cfg: fp32 weights, plus AdamW's two fp32 moments of what trains."""
    from radio import VisionModel
    with torch.device("meta"):
        modules = {"vision": VisionModel(cfg), "language": model.LanguageModel(cfg)}
    model.set_trainable(modules, stage)
    return sum(p.numel() * (12 if p.requires_grad else 4) for m in modules.values() for p in m.parameters())


@cuda
def test_signal_save_time_20l(tmp_path):
    """SIGTERM to a one-GPU training run of the 20l preset with 16 routed experts (the full 128 do not fit one GPU):
    seconds from the signal to the saved checkpoint and to the exit, its size, and what that gives for the full
    20l by bytes. Prints one JSON line; docs/failures.md §3 quotes it. Long: builds a 3.4B model."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    save = str(tmp_path / "ckpt")
    argv = ["--preset", "20l", "--n-routed-experts", "16", "--seq-len", "2048", "--mock-image-size", "512",
            "--global-batch", "2", "--steps", "1000", "--save", save]
    proc = subprocess.Popen([sys.executable, "train.py"] + argv, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in proc.stdout:   # two steps trained (warm), then the signal during the third
        lines.append(line)
        if line.startswith("step 2/"):
            break
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    saved_s = None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("saved checkpoint"):
            saved_s = time.perf_counter() - t0
    rc, exit_s = proc.wait(), time.perf_counter() - t0
    assert rc == 128 + signal.SIGTERM and saved_s is not None, "".join(lines[-30:])
    assert "interrupted by SIGTERM: saved step 2 to" in "".join(lines[-8:]), "".join(lines[-30:])
    step_dir = os.path.join(save, "step_00000002")
    size = sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir))
    step_ms = float(next(x for x in lines if x.startswith("step 2/")).split(" ms |")[0].rsplit("| ", 1)[1])
    full = size * checkpoint_bytes(config.resolve("20l")) / checkpoint_bytes(config.resolve("20l", {"n_routed_experts": 16}))
    print(json.dumps({"device": torch.cuda.get_device_name(), "checkpoint_gb": round(size / 1e9, 2),
                      "signal_to_saved_s": round(saved_s, 1), "signal_to_exit_s": round(exit_s, 1),
                      "step_ms": step_ms, "write_gb_per_s": round(size / 1e9 / saved_s, 2),
                      "full_20l_checkpoint_gb": round(full / 1e9, 1),
                      "full_20l_one_writer_s_estimate": round(full / size * saved_s, 1)}))


SMALL = ["--preset", "small", "--global-batch", "2", "--lr", "1e-3", "--seq-len", "512", "--lr-decay-iters", "4"]


def _losses(metrics):
    """A metrics file's losses: each step's, and an evaluation's in its place."""
    import json
    return [r["loss"] if "loss" in r else r["eval_loss"] for r in map(json.loads, open(metrics))]


def _torchrun(gpus, argv, tmp_path, name, timeout=900):
    """train.py on `gpus` GPUs -> the losses of its metrics file."""
    import os
    import subprocess
    metrics = str(tmp_path / f"{name}.jsonl")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["torchrun", "--standalone", f"--nproc_per_node={gpus}", "train.py", *argv, "--metrics-file",
                          metrics], cwd=root, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return _losses(metrics)


@cuda
def test_bf16_weights_and_cuda_resume_bit_exact(tmp_path):
    """One GPU: bf16 weights (trained ones from their fp32 main weights, the frozen tower with no other copy); a
    resumed run follows the straight run (to 1e-3: some CUDA kernels accumulate with atomics, so two
    runs of the same step need not agree to the bit; the CPU tests check bit-exact resume)."""
    import train
    history, modules = train.main(SMALL + ["--steps", "1"])
    assert modules["vision"].blocks[0].attn.qkv.weight.dtype == torch.bfloat16          # frozen: bf16, no copy
    assert modules["language"].lm_head.weight.dtype == torch.bfloat16
    save = str(tmp_path / "ckpt")

    def losses(argv):   # in this process: the compiled kernels are reused, no start-up per run
        return [h["loss"] for h in train.main(SMALL + ["--stage", "3"] + argv)[0]]
    straight = losses(["--steps", "4"])
    first = losses(["--steps", "2", "--save", save])
    resumed = losses(["--steps", "4", "--load", save])
    assert len(first + resumed) == len(straight)
    assert all(abs(a - b) < 1e-3 * b for a, b in zip(first + resumed, straight)), (first, resumed, straight)


@cuda
def test_set_up_peak_is_bf16_weights_plus_one_draw():
    """train.py's set-up on one GPU (init.py: built on the meta device, each weight materialised in bf16 and drawn
    one at a time) peaks at the weights plus one full-size fp32 draw of the largest parameter, here the 131072 x
    256 embedding (128 MiB); the LoRA base is frozen, so all of it is bf16. The fp32 init it replaces peaked at
    twice the weights plus two draws. Also the plan's set-up column (memory.py) against the measured peak."""
    import train
    import layout
    import memory
    argv = SMALL + ["--vocab-size", "131072", "--lora-rank", "8"]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peaks, real = [], train.train

    def after_setup(run, stop):
        peaks.append(torch.cuda.max_memory_allocated() - base)
        return []
    train.train = after_setup
    try:
        _, modules = train.main(argv + ["--steps", "0"])
    finally:
        train.train = real
    tensors = [t for m in modules.values() for t in [*m.parameters(), *m.buffers()]]
    assert all(t.dtype == torch.bfloat16 for m in modules.values() for t in m.parameters())
    weights = sum(t.numel() * t.element_size() for t in tensors)
    draw = 4 * 131072 * 256
    cfg = cli.config_of(argv)
    planned = memory.plan(cfg, layout.plan(cfg, 1))["language"]["setup"]
    print(f"set-up peak {peaks[0] / 2**20:.1f} MiB: weights {weights / 2**20:.1f} + draw {draw / 2**20:.1f} MiB; "
          f"planned {planned / 2**20:.1f} MiB")
    assert abs(peaks[0] - (weights + draw)) < 0.03 * (weights + draw), (peaks[0], weights, draw)   # the allocator's
    assert abs(planned - peaks[0]) < 0.03 * peaks[0], (planned, peaks[0])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_distributed_optimizer_two_gpus_tracks_plain(tmp_path):
    """dp 2: bf16 weights stepped from fp32 shards track plain fp32 AdamW (bf16 rounding of the weights only)."""
    argv = SMALL + ["--colocated", "--lm-dp", "2", "--stage", "3", "--steps", "5"]
    sharded = _torchrun(2, argv, tmp_path, "sharded")
    plain = _torchrun(2, argv + ["--no-distributed-optimizer"], tmp_path, "plain")
    assert all(abs(a - b) < 2e-2 * b for a, b in zip(sharded, plain)), (sharded, plain)
    assert sharded[-1] < sharded[0]


DEEPEP_CHECK = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import config, model, moe
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
group = dist.new_group([0, 1])
cfg = config.resolve("20l", {"n_routed_experts": "16"})   # width 2688, 16 experts (8 a rank), top 6
gen = torch.Generator("cuda").manual_seed(100 + rank)
x = torch.randn(1, 4096, cfg.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
g = torch.randn(1, 4096, cfg.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
out = {}
for name in ("alltoall", "deepep"):
    layer = moe.MoE(cfg, None, group, None, name).cuda()
    holder = torch.nn.Module()
    holder.mixer = layer
    model.init_weights(holder, 0, {"ep": (rank, 2)}, cfg)
    for p in layer.parameters():   # bf16 weights as training has them; the expert bias buffer stays fp32
        p.data = p.data.to(torch.bfloat16)
    xi = x.clone().requires_grad_()
    for _ in range(2):   # the second call runs with DeepEP's buffer made; it is the one compared
        xi.grad = None
        layer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi)
        y.backward(g)
    out[name] = [y.float(), xi.grad.float(), layer.experts.up_proj.grad.float(),
                 layer.experts.down_proj.grad.float(), layer.gate.weight.grad.float()]
err = [((a - b).norm() / b.norm()).item() for a, b in zip(out["deepep"], out["alltoall"])]
if rank == 0:
    print("DEEPEP_ERR " + json.dumps(err), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_deepep_equals_alltoall_two_gpus(tmp_path):
    """--moe-dispatcher deepep on ep 2: the MoE layer's output and the gradients of its input, experts and router
    equal the all_to_all path's to bf16 rounding (they sum the same rows in another order)."""
    pytest.importorskip("deep_ep")
    import json
    import os
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "deepep_check.py"
    script.write_text(DEEPEP_CHECK)
    out = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", str(script)], cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    err = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("DEEPEP_ERR "))[11:])
    assert max(err) < 2e-2, err


# Hetero layouts over NCCL (docs/parallel.md §9): each trains 3 steps of the mock task (images, and a quarter of the
# samples text only, so some micro-batches send 0 rows) and evaluates after the third, and its losses equal the same
# run colocated on one GPU to bf16 rounding (relative 2e-2: tp / ep / cp / the bridge sum in another order, bf16
# autocast). A deadlock ends in 4 x 30 s (the watchdog's first-step allowance) instead of hanging the suite.
HETERO = ["--preset", "tiny", "--global-batch", "8", "--steps", "3", "--lr", "3e-3", "--lr-schedule", "constant",
          "--eval-every", "3", "--collective-timeout", "30"]
HETERO_TOL = 2e-2
VTP2_LTP2_EP2 = ["--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "2", "--lm-ep", "2", "--lm-dp", "1"]
VTP2_PP2 = ["--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "1", "--lm-dp", "1", "--lm-pp", "2"]


def _on(gpus, layout, name):
    return pytest.param(gpus, layout, id=name, marks=pytest.mark.skipif(torch.cuda.device_count() < gpus,
                                                                        reason=f"needs {gpus} GPUs"))


HETERO_LAYOUTS = [
    _on(2, ["--vision-tp", "1", "--vision-dp", "1", "--lm-tp", "1", "--lm-dp", "1"], "v1|l1"),
    _on(4, VTP2_LTP2_EP2, "vtp2|ltp2-ep2"),
    _on(4, ["--vision-tp", "1", "--vision-dp", "2", "--lm-tp", "2", "--lm-dp", "1", "--micro-batch", "2"],
        "fan-in:vdp2|ltp2"),
    _on(4, ["--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "1", "--lm-dp", "2"], "fan-out:vtp2|ldp2"),
    _on(4, ["--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "1", "--lm-cp", "2", "--lm-dp", "1"], "vtp2|lcp2"),
    _on(4, ["--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "1", "--lm-dp", "2", "--lm-ep", "2",
            "--moe-dispatcher", "deepep"], "vtp2|ldp2-ep2-deepep"),
    # shared ranks, each module its own lanes: rows between leaders, in the hetero order (bridge.py)
    _on(2, ["--colocated", "--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "1", "--lm-dp", "2"], "shared:vtp2|ldp2"),
    _on(4, ["--colocated", "--vision-tp", "1", "--vision-dp", "4", "--lm-tp", "2", "--lm-dp", "2", "--lm-ep", "4",
            "--micro-batch", "2"], "shared:vdp4|ltp2-dp2-ep4"),
    # pipeline stages (docs/pipeline.md): rows to stage 0, one batch per pair of stages and round
    _on(3, ["--vision-tp", "1", "--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"], "v1|pp2"),
    _on(4, ["--vision-tp", "1", "--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "3"], "v1|pp3"),
    _on(4, VTP2_PP2, "vtp2|pp2"),
    _on(2, ["--colocated", "--vision-tp", "1", "--lm-pp", "2", "--micro-batch", "2"], "shared:vdp2|pp2"),
    _on(4, ["--colocated", "--vision-tp", "1", "--lm-pp", "2", "--lm-dp", "2", "--lm-ep", "2", "--micro-batch", "2"],
        "shared:vdp4|pp2-dp2-ep2"),
    _on(4, ["--colocated", "--vision-tp", "1", "--lm-pp", "4", "--micro-batch", "4"], "shared:vdp4|pp4"),
    _on(4, ["--colocated", "--vision-tp", "2", "--lm-tp", "2", "--lm-pp", "2", "--micro-batch", "2"],
        "shared:vtp2|tp2-pp2"),
    _on(4, ["--colocated", "--vision-tp", "2", "--lm-cp", "2", "--lm-pp", "2", "--micro-batch", "2"],
        "shared:vtp2|cp2-pp2"),
]


@pytest.fixture(scope="module")
def colocated_losses(tmp_path_factory):
    """The hetero runs' reference: the same run colocated on one GPU."""
    return _torchrun(1, HETERO, tmp_path_factory.mktemp("colocated"), "colocated", timeout=300)


def _close(losses, reference):
    return len(losses) == len(reference) and all(abs(a - b) < HETERO_TOL * b for a, b in zip(losses, reference))


@pytest.mark.parametrize("gpus, layout", HETERO_LAYOUTS)
def test_hetero_layout_over_nccl_trains_as_colocated(gpus, layout, colocated_losses, tmp_path):
    if "deepep" in layout:
        pytest.importorskip("deep_ep")
    losses = _torchrun(gpus, HETERO + layout, tmp_path, "hetero", timeout=300)
    print(f"hetero {' '.join(layout)}: {losses}; colocated {colocated_losses}")
    assert _close(losses, colocated_losses), (losses, colocated_losses)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_mtp_across_two_stages_over_nccl(tmp_path):
    """MTP (two depths, LatentMoE) on the last of two stages, the decoder input sent beside the residual stream, the
    tower on both ranks: the losses and the MTP losses of one GPU's run, to bf16 rounding."""
    import json
    mtp = HETERO + ["--moe-latent-size", "16", "--num-nextn-predict-layers", "1", "--mtp-depths", "2"]
    runs = [_torchrun(gpus, mtp + flags, tmp_path, name, timeout=300) for gpus, flags, name in (
        (1, [], "one"), (2, ["--colocated", "--vision-tp", "1", "--lm-pp", "2", "--micro-batch", "2"], "pp2"))]
    depths = [[r["mtp_loss"] for r in map(json.loads, open(tmp_path / f"{name}.jsonl")) if "mtp_loss" in r]
              for name in ("one", "pp2")]
    print(f"pp2 MTP: {runs[1]} {depths[1]}; one GPU {runs[0]} {depths[0]}")
    assert _close(runs[1], runs[0]) and len(depths[0]) == 3
    assert all(_close(a, b) for a, b in zip(depths[1], depths[0]))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("when, grid", [("mid-step", VTP2_LTP2_EP2), ("mid-evaluation", VTP2_LTP2_EP2),
                                        ("mid-step", VTP2_PP2)], ids=["mid-step", "mid-evaluation", "mid-step-pp2"])
def test_a_signal_to_a_hetero_run_saves_and_the_run_goes_on(when, grid, colocated_losses, tmp_path):
    """vision tp2 | language tp2 ep2 (or pp2) over NCCL. mid-step: SIGTERM to torchrun during step 2 saves step 1
    (the bridge and pipeline traffic in flight is matched: schedule.Schedule.train); the same line then resumes and
    trains steps 2 and 3.
    mid-evaluation: SIGHUP during the evaluation after step 3 stops it on every rank (the signal check before each
    evaluation micro-batch pairs with the forward-only bridge) and saves step 3; --eval-only then scores it. Either
    way the three steps' losses and the evaluation's equal the colocated run's."""
    import os
    import signal
    import subprocess
    import time
    from tests.spawn import slow_train
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    save, metrics, marker = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl"), str(tmp_path / "marker")
    line = HETERO + grid + ["--save", save, "--metrics-file", metrics]
    # 8 micro-batches a step: the 11th is step 2's third; the evaluation (32 mock samples) starts at the 25th
    sig, at, said = (signal.SIGTERM, 11, f"interrupted by SIGTERM: saved step 1 to {save}") if when == "mid-step" \
        else (signal.SIGHUP, 29, f"interrupted by SIGHUP during the evaluation after step 3 (not scored): saved step "
              f"3 to {save}")
    script = slow_train(str(tmp_path / "slow.py"), marker, line, at=at)
    proc = subprocess.Popen(["torchrun", "--standalone", "--nproc_per_node=4", script], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not os.path.exists(marker + "2") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert said in out, out[-3000:]
    again = line if when == "mid-step" else ["--eval-only", "--load", save]
    resumed = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=4", "train.py", *again], cwd=root,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    if when == "mid-step":
        assert "resuming" in resumed.stdout, resumed.stdout[-3000:]
        losses = _losses(metrics)
    else:
        import json
        losses = _losses(metrics) + [json.loads(resumed.stdout.strip().splitlines()[-1])["eval_loss"]]
    print(f"{sig.name} {when}, then {' '.join(again[:2])}: {losses}; colocated {colocated_losses}")
    assert _close(losses, colocated_losses), (losses, colocated_losses)
