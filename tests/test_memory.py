"""memory.py: the --dry-run plan's arithmetic on a tiny model counted by hand, and the CLI's last JSON line."""
import json
import os
import subprocess
import sys

import pytest
import torch

import config
import memory
import parallel
import train
from radio import VisionModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one attention and one MoE layer; hetero: vision dp2 on ranks 0-1, language tp1 dp2 ep2 (edp 1) on ranks 2-3
ARGV = ["--preset", "tiny", "--hybrid-override-pattern", "*E", "--stage", "3", "--global-batch", "2",
        "--vision-dp", "2", "--lm-dp", "2", "--lm-ep", "2"]


def _cfg_lay(extra=()):
    args, overrides = train.parse_args(ARGV + list(extra))
    cfg = config.resolve(args.preset, overrides)
    return cfg, parallel.plan_layout(cfg, 4, args.micro_batch, args.global_batch, vision_dp=2, lm_dp=2, lm_ep=2), args


def plan(extra=()):
    cfg, lay, args = _cfg_lay(extra)
    return memory.plan(cfg, lay, args), lay


def test_language_rank_by_hand():
    """tiny: V 512, D 64, 4 heads / 2 KV of 16, 8 experts (top 2) of width 32, shared expert 64, seq 96."""
    rows, lay = plan()
    assert (lay.lm_dp, lay.lm_ep, lay.lm_edp) == (2, 2, 1)
    dense = (2 * 512 * 64          # embeddings, lm_head
             + 64 + 64 + 64        # norm_f, the two layers' norms
             + 64 * 64 + 2 * 32 * 64 + 64 * 64   # q, k, v, o
             + 8 * 64 + 2 * 64 * 64)             # router, shared expert up / down
    experts = 8 // 2 * 2 * 32 * 64               # this rank's 4 experts, up and down
    assert dense == 86720 and experts == 16384
    lang = rows["language"]
    # bf16 weight 2 + fp32 main_grad 4 + (main, exp_avg, exp_avg_sq) 12 / d: dense d = dp 2, experts d = edp 1
    assert lang["weights"] == 2 * (dense + experts) == 206208
    assert lang["gradients"] == 4 * (dense + experts) == 412416
    assert lang["optimizer"] == 6 * dense + 12 * experts == 716928
    T, D = 96, 64
    block = 2 * T * D + 4 * T                                           # residual into the norm, rstd
    attn = 2 * T * D + 2 * T * (4 + 2 * 2) * 16 + 2 * 2 * T * 4 * 16 + 4 * T * 4
    moe = (2 * T * D + 4 * T * D + 4 * 2 * T * 8 + 2 * 2 * T * 64      # input, fp32 router input, scores, shared
           + 2 * (T * 2) * (2 * D + 2 * 32) + 2 * T * D + 2 * T * D)   # routed rows in/out + up/act, combined
    logits = 2 * T * 512
    head = 2 * 2 * T * D + logits + 8 * T
    assert (block + attn, block + moe) == (75648, 178560)
    assert lang["activations"] == (block + attn) + (block + moe) + head + logits == 476160
    assert lang["peak"] == 206208 + 412416 + 716928 + 476160
    # set-up: every local weight in fp32, + init's two full-size fp32 draws of the largest (embeddings, 512 x 64)
    assert lang["setup"] == 4 * (dense + experts) + 8 * 512 * 64 == 674560
    checkpointed, _ = plan(["--activation-checkpointing"])
    ck = checkpointed["language"]
    assert ck["activations"] == 2 * 2 * T * D + (block + moe) + head + logits
    # the experts (edp 1) then keep fp32 weights that are their own main weights: 4 + 4 + 8 bytes, not 2 + 4 + 12
    assert (ck["weights"], ck["gradients"]) == (2 * dense + 4 * experts, lang["gradients"])
    assert ck["optimizer"] == 6 * dense + 8 * experts
    cpu = memory.plan(*_cfg_lay(["--activation-checkpointing"]), cuda=False)["language"]   # fp32, one-rank: aliased
    assert (cpu["weights"], cpu["optimizer"]) == (4 * (dense + experts), 6 * dense + 8 * experts)


def test_vision_rank_and_plain_optimizer():
    rows, lay = plan()
    with torch.device("meta"):
        n = sum(p.numel() for p in VisionModel(config.resolve("tiny")).parameters())
    vision = rows["vision"]                      # stage 3, vision tp1 dp2: every parameter trains, sharded over 2
    assert (vision["weights"], vision["gradients"], vision["optimizer"]) == (2 * n, 4 * n, 6 * n)
    assert vision["setup"] == 4 * n   # drawn on the CPU, moved in fp32
    plain, _ = plan(["--no-distributed-optimizer"])   # fp32 weights, + autocast's bf16 copies kept for backward
    assert (plain["vision"]["weights"], plain["vision"]["optimizer"]) == (4 * n, 8 * n)
    assert plain["language"]["optimizer"] == 8 * (86720 + 16384)
    assert plain["language"]["activations"] == rows["language"]["activations"] + 2 * (86720 + 16384)
    frozen, _ = plan(["--stage", "1"])           # only the projector trains; the tower is bf16 and nothing else
    proj = sum(p.numel() for k, p in VisionModel(config.resolve("tiny"), None).named_parameters() if "mlp1" in k)
    assert frozen["vision"]["weights"] == 2 * n and frozen["vision"]["gradients"] == 4 * proj


def test_dry_run_cli_last_line():
    """Nano's reference layout (hetero, 8 ranks) and a colocated tiny layout: the last line is the plan, in GiB."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")}
    cases = ((["--preset", "nano"], 8), (["--preset", "tiny", "--colocated", "--lm-tp", "2", "--lm-ep", "2"], 4))
    for argv, world in cases:
        out = subprocess.run([sys.executable, "train.py", *argv, "--dry-run", "--world-size", str(world)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        last = json.loads(out.stdout.strip().splitlines()[-1])
        args, overrides = train.parse_args(argv)
        cfg = config.resolve(args.preset, overrides)
        lay = parallel.plan_layout(cfg, world, 1, args.global_batch, lm_tp=args.lm_tp, lm_ep=args.lm_ep,
                                   colocated=True if args.colocated else None)
        rows = memory.plan(cfg, lay, args)
        assert last["peak_gib_per_rank"] == {k: round(r["peak"] / 2 ** 30, 2) for k, r in rows.items()}
        assert lay.colocated == (rows["vision"] == rows["language"])


def test_fit_check_names_the_set_up_peak(monkeypatch):
    """LoRA with wide embeddings (8192 x 1024): the frozen base's fp32 init and init's two full-size draws of the
    embeddings make set-up the larger peak; a rank with room for training but not for set-up is refused naming the
    set-up (CPU: a rank's memory is RAM / LOCAL_WORLD_SIZE)."""
    cfg, lay, args = _cfg_lay(["--lora-rank", "4", "--hidden-size", "1024", "--vocab-size", "8192"])
    rows = memory.plan(cfg, lay, args, cuda=False)
    peak, setup = max(r["peak"] for r in rows.values()), max(r["setup"] for r in rows.values())
    assert setup > peak
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(int(0.95 * ram / ((peak / 0.9 * 0.95 + setup) / 2))))
    with pytest.raises(SystemExit) as e:
        memory.check_fits(cfg, lay, args, torch.device("cpu"))
    assert "while it sets up" in str(e.value) and "initialised in fp32" in str(e.value), str(e.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(int(0.95 * ram / (setup * 1.01))))
    memory.check_fits(cfg, lay, args, torch.device("cpu"))   # room for both: passes
