"""train.py end to end on gloo (docs/parallel.md §7-8): learning, determinism, reference equivalence of hetero /
colocated / tp / ep layouts against one process, text-only mixing, LR schedules (and the sample-counted one of an
earlier version's run record), skip-on-inf, step consensus, layout errors and the dry run. Every distributed run
is a forked gloo group (tests/spawn.py) calling train.main.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import checkpoint
import cli
import comm
import config
import layout
import data
import mock
import memory
import model
import optim
import parallel
import radio
import train
from tests.spawn import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    """Lazy imports that train.main triggers (sympy through skip_init, torch._dynamo through the optimizer) cost
    seconds; done once here, every forked child inherits them instead of importing them again, all at once."""
    torch.nn.utils.skip_init(torch.nn.Linear, 1, 1)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


# ---------------------------------------------------------------- helpers (run inside the gloo children)

def full_state(modules, grads=None):
    """{"vision.<name>" / "language.<name>": full tensor} of every parameter this rank holds (or of its gradient,
    `grads` = {id(param): tensor}), tp / ep / etp shards all-gathered over their groups and reassembled with
    comm.unshard; with the parameters also the expert-bias buffers."""
    out = {}
    for prefix, m in modules.items():
        groups = {"tp": m.tp_group}
        moe_layer = next((x for x in m.modules() if hasattr(x, "ep_group")), None)
        if moe_layer is not None:
            groups.update(ep=moe_layer.ep_group, etp=moe_layer.etp_group)
        for name, p in m.named_parameters():
            t = p.detach() if grads is None else grads.get(id(p), torch.zeros_like(p))
            for kind, dim, segments in getattr(p, "shards", ()):
                g = groups.get(kind)
                if comm.group_size(g) > 1:
                    parts = [torch.empty_like(t) for _ in range(comm.group_size(g))]
                    dist.all_gather(parts, t.contiguous(), group=g)
                    t = comm.unshard(parts, dim, segments)
            out[f"{prefix}.{name}"] = t.clone()
        for name, b in m.named_buffers():
            if grads is None and name.endswith("e_score_correction_bias"):
                out[f"{prefix}.{name}"] = b.clone()
    return out


def _train(rank, world, argv):
    """train.main in this gloo child -> (history, full weights after the run, full gradients of the last step as
    the optimizer's finish left them: DP-reduced, divided by N_global, clipped)."""
    grads = {}
    real = optim.AdamW.finish

    def spy(opt, n_global, max_norm):
        norm, ok = real(opt, n_global, max_norm)
        grads.clear()
        for b in opt.buckets if ok else ():   # the optimizer's fp32 shards, all-gathered
            grads.update({k: g.clone() for k, g in b.split(b.gather(b.main.grad)).items()})
        return norm, ok

    optim.AdamW.finish = spy      # this forked child only
    try:
        history, modules = train.main(list(argv))
    finally:
        optim.AdamW.finish = real
    return history, full_state(modules), full_state(modules, grads)


def _train_twice(rank, world, argv):
    """Two runs in the same processes: nothing may leak from the first into the second."""
    return train.main(list(argv))[0], train.main(list(argv))[0]


def run(argv, world):
    return run_distributed(_train, world, argv, timeout=60.0)


def assert_states_match(got, ref, where, atol=1e-5, rtol=0.0):
    """Every tensor of `got` equals the reference's within atol + rtol * max|reference tensor|."""
    assert got, f"{where}: nothing to compare"
    for k, t in got.items():
        assert k in ref, f"{where}: {k} not in the reference"
        assert t.shape == ref[k].shape, (where, k, t.shape, ref[k].shape)
        err, scale = (t - ref[k]).abs().max().item(), ref[k].abs().max().item()
        assert err <= atol + rtol * scale, f"{where}: {k} differs from one process by {err:.3g} (max {scale:.3g})"


def assert_covers(results, ref):
    """Together the ranks hold (full) every reference tensor, and nothing else."""
    keys = set().union(*(state.keys() for _, state, _ in results))
    assert keys == set(ref), sorted(set(ref) ^ keys)


def assert_step_matches(results, reference, where):
    """Loss, grad norm, reduced + normalised + clipped gradients, updated weights and expert biases of one step
    on every rank == the world-1 run's (docs/parallel.md §8)."""
    ref_hist, ref_state, ref_grads = reference
    assert_covers(results, ref_state)
    (r,) = ref_hist
    for rank, (hist, state, grads) in enumerate(results):
        (h,) = hist
        assert h["ok"] and h["lr"] == r["lr"], (where, rank, h)
        assert abs(h["grad_norm"] - r["grad_norm"]) <= 1e-5 * r["grad_norm"], (where, rank, h, r)
        if h["loss"] is not None:
            assert abs(h["loss"] - r["loss"]) <= 1e-5, (where, rank, h["loss"], r["loss"])
        assert_states_match(grads, ref_grads, f"{where} rank {rank} gradient", atol=1e-9, rtol=1e-5)
        assert_states_match(state, ref_state, f"{where} rank {rank}", atol=1e-5)


# ---------------------------------------------------------------- one-process references (forked, world 1)

GB = 4                                                  # global batch of every equivalence run
ONE_STEP = ["--preset", "tiny", "--steps", "1", "--global-batch", str(GB), "--stage", "3", "--lr", "3e-4",
            "--lr-schedule", "constant"]


@pytest.fixture(scope="module")
def reference():
    """(history, weights, gradients) of one --stage 3 step of the world-1 run, checked against its initial
    weights: every parameter has a gradient, the weights moved by about lr, every expert bias took its step."""
    (init,) = run(ONE_STEP + ["--steps", "0"], 1)                  # the later --steps wins
    (after,) = run(ONE_STEP, 1)
    hist, state, grads = after
    moved = max((state[k] - init[1][k]).abs().max().item() for k in grads)
    assert 1e-4 < moved < 1e-3, moved                              # the step really moved the weights (Adam: ~lr)
    biases = [v for k, v in state.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == 3 and all((b.abs() == 1e-3).sum() >= 4 for b in biases), biases  # one bias step each
    assert all(g.abs().max() > 0 for g in grads.values())          # stage 3: every parameter has a gradient
    return after


# ---------------------------------------------------------------- 1. learning, determinism, hetero == one process

@pytest.mark.slow
def test_tiny_hetero_learns_is_deterministic_and_matches_one_process():
    argv = ["--preset", "tiny", "--steps", "5", "--global-batch", str(GB), "--mock-num-samples", str(GB),
            "--lr", "3e-3", "--lr-schedule", "constant"]
    hetero = argv + ["--vision-dp", "2", "--lm-dp", "2"]             # the tiny preset's reference layout
    runs = run_distributed(_train_twice, 4, hetero, timeout=60.0)
    (ref,) = run_distributed(lambda rank, world: train.main(argv)[0], 1, timeout=60.0)  # one process
    first, second = runs[2]                                         # rank 2: language lane 0
    losses = [h["loss"] for h in first]
    assert all(h["ok"] for h in first) and [h["lr"] for h in first] == [3e-3] * 5
    assert losses[-1] < losses[0] - 0.3, losses                     # one repeated batch: it memorises
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert [h["loss"] for h in second] == losses                    # same seed: bit-identical, every step
    for rank, (h1, h2) in enumerate(runs):
        assert [h["grad_norm"] for h in h1] == [h["grad_norm"] for h in first], rank
        assert [h["grad_norm"] for h in h2] == [h["grad_norm"] for h in first], rank
        assert [h["loss"] for h in h1] == (losses if rank >= 2 else [None] * 5), rank
    for a, b in zip(losses, [h["loss"] for h in ref]):
        assert abs(a - b) <= 1e-5, (losses, [h["loss"] for h in ref])
    for a, b in zip(first, ref):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (first, ref)


# ---------------------------------------------------------------- 2. reference equivalence

LAYOUTS = {  # name: (world, grid flags, language ranks)
    "hetero v-dp2 + lm-tp2-dp2": (6, ["--vision-dp", "2", "--lm-tp", "2", "--lm-dp", "2"], 4),
    "fan-out v-dp1 -> lm-dp2": (3, ["--vision-dp", "1", "--lm-dp", "2"], 2),
    "fan-in v-dp2 -> lm-dp1": (3, ["--vision-dp", "2", "--lm-dp", "1", "--micro-batch", "2"], 1),
    "colocated dp2 ep2": (2, ["--colocated", "--lm-ep", "2"], 2),
    "hetero v-tp2 + lm-tp2-ep2": (4, ["--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "2", "--lm-dp", "1",
                                      "--lm-ep", "2"], 2),
    # both modules on every rank, each its own lanes: rows travel between leaders, or stay on a rank leading both
    "shared v-dp4 + lm-tp2-dp2": (4, ["--colocated", "--vision-tp", "1", "--vision-dp", "4", "--lm-tp", "2",
                                      "--lm-dp", "2", "--micro-batch", "2"], 4),
    "shared v-tp2 + lm-dp2-ep2": (2, ["--colocated", "--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "1",
                                      "--lm-dp", "2", "--lm-ep", "2"], 2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.slow
def test_one_step_matches_one_process(name, reference):
    world, flags, lm_ranks = LAYOUTS[name]
    results = run(ONE_STEP + flags, world)
    assert sum(h[0]["loss"] is not None for h, _, _ in results) == lm_ranks
    assert_step_matches(results, reference, name)


@pytest.mark.slow
def test_an_uneven_split_matches_one_process():
    """vision dp 2 | language dp 3 on 5 ranks (neither divides the other): vision lane 0 feeds language lanes 0 and
    1, lane 1 lanes 1 and 2."""
    argv = ONE_STEP + ["--global-batch", "6"]
    (ref,) = run(argv, 1)
    results = run(argv + ["--vision-dp", "2", "--lm-dp", "3", "--micro-batch", "2"], 5)
    assert sum(h[0]["loss"] is not None for h, _, _ in results) == 3
    assert_step_matches(results, ref, "uneven 2 | 3")


# ---------------------------------------------------------------- 3. text-only samples: 0-row payloads (docs/parallel.md §6)

@pytest.mark.slow
def test_text_only_mixing_matches_one_process():
    """Seed 15, half text-only: samples 0-3 are [text, text, image, text], placed [2, 0 | 1, 3] (lanes.py). In
    global micro-batch 0 vision lane 0 sends one image, lane 1 (rank 1) 0 rows; micro-batch 1 is text only (both
    lanes send 0 rows), so vision rank 1 encodes nothing in the whole step and still takes part in the reduction."""
    argv = ONE_STEP + ["--mock-text-only-frac", "0.5", "--seed", "15"]
    cfg = config.resolve("tiny", {"mock_text_only_frac": "0.5"})
    assert [len(mock.MockData(cfg, 15)[i].images) for i in range(GB)] == [0, 0, 1, 0]
    (reference,) = run(argv, 1)
    _, _, ref_grads = reference
    assert ref_grads["vision.blocks.0.attn.qkv.weight"].abs().max() > 0       # the one image trains the tower
    results = run(argv + ["--vision-dp", "2", "--lm-dp", "2"], 4)              # tiny reference layout, hetero
    assert [h[0]["loss"] is None for h, _, _ in results] == [True, True, False, False]
    assert_step_matches(results, reference, "text-only mix")
    # MFU counts what ran: 4 x 96 language tokens and the one image (the tower trains at stage 3), on any layout
    _, grids, _, _ = data.collate_images([mock.MockData(cfg, 15)[2]], cfg)
    flops = GB * cfg.seq_len * model.lm_flops_per_token(cfg, cfg.seq_len) + radio.flops(cfg, grids, True)
    assert grids == [(4, 4)] and reference[0][0]["model_flops"] == flops
    assert all(h[0]["model_flops"] == flops for h, _, _ in results)


# ---------------------------------------------------------------- 4. LR schedules (closed form, by hand)

def lr_at(flags, it):
    return optim.learning_rate(cli.config_of(flags), it)


def test_cosine_schedule():
    f = ["--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-iters", "4", "--lr-decay-iters", "20", "--steps", "30"]
    expected = {0: 2.5e-4,                  # warmup: lr * (it + 1) / 4
                1: 5.0e-4,
                3: 1.0e-3,                  # last warmup step reaches the peak
                4: 1.0e-3,                  # cosine progress 0
                8: 8.5501786e-4,            # progress 1/4: 1e-5 + 0.99e-3 * 0.5 * (1 + cos(pi/4)) = 1e-5 + 0.99e-3 * 0.8535534
                12: 5.05e-4,                # progress 1/2: 1e-5 + 0.99e-3 / 2
                16: 1.5498214e-4,           # progress 3/4: 1e-5 + 0.99e-3 * 0.1464466
                20: 1e-5, 25: 1e-5}         # decay done: min_lr
    for it, lr in expected.items():
        assert lr_at(f, it) == pytest.approx(lr, rel=1e-7, abs=1e-12), it
    assert lr_at(["--lr", "1e-3", "--min-lr", "0", "--steps", "10"], 5) == pytest.approx(5e-4)  # decay: --steps


def test_wsd_schedule():
    f = ["--lr-schedule", "wsd", "--lr", "1e-3", "--min-lr", "0", "--lr-warmup-iters", "2", "--steps", "100",
         "--lr-wsd-decay-iters", "20"]
    expected = {"linear": {0: 5e-4, 1: 1e-3, 50: 1e-3, 80: 1e-3, 85: 7.5e-4, 90: 5e-4, 95: 2.5e-4, 100: 0.0},
                "minus_sqrt": {80: 1e-3, 85: 5e-4,             # 1 - sqrt(1/4)
                               95: 1.339746e-4,                 # 1 - sqrt(3/4) = 1 - 0.8660254
                               100: 0.0}}
    for style, points in expected.items():
        for it, lr in points.items():
            assert lr_at(f + ["--lr-wsd-decay-style", style], it) == pytest.approx(lr, rel=1e-6, abs=1e-12), (style, it)
    default = f[:-2]                        # default tail: (100 - 2) // 10 = 9 steps, from step 91
    assert lr_at(default, 91) == pytest.approx(1e-3)
    assert lr_at(default, 94) == pytest.approx(1e-3 * 6 / 9)
    wsd_min = f + ["--min-lr", "1e-4"]      # min + (lr - min) * (1 - f)
    assert lr_at(wsd_min, 90) == pytest.approx(1e-4 + 0.9e-3 * 0.5)


@pytest.mark.parametrize("flag, use", [("train-samples", "--lr-decay-iters"), ("lr-decay-samples", "--lr-decay-iters"),
                                       ("lr-warmup-samples", "--lr-warmup-iters"),
                                       ("lr-wsd-decay-samples", "--lr-wsd-decay-iters")])
def test_the_sample_flags_of_earlier_versions_name_the_step_flag(flag, use):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--preset", "tiny", f"--{flag.replace('-', '_')}", "1000"])
    assert str(e.value).startswith(f"unknown flag --{flag}. Use {use} (samples / --global-batch: the LR schedule "
                                   "counts steps"), str(e.value)


SAMPLE_DEFAULTS = {"train_samples": None, "lr_warmup_samples": 0, "lr_decay_samples": None,
                   "lr_wsd_decay_samples": None}


def old_record(tmp_path, **fields):
    """(a step directory whose config.json an earlier version wrote: the tiny preset's run with `fields`, the
    record's values)."""
    step = tmp_path / "step_00000007"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    record = {**dataclasses.asdict(config.resolve("tiny")), **SAMPLE_DEFAULTS, **fields}
    (step / "config.json").write_text(json.dumps(record))
    return str(step), record


def old_sample_lr(r, x):
    """The LR the sample-counted schedule of earlier versions gave after x = good steps x global batch samples,
    written out as it was (r: the record)."""
    warm, end = r["lr_warmup_samples"], r["lr_decay_samples"] or r["train_samples"]
    if x < warm:
        return r["lr"] * (x + 1) / warm
    if r["lr_schedule"] == "constant":
        return r["lr"]
    if r["lr_schedule"] == "cosine":
        progress = min(max((x - warm) / max(end - warm, 1), 0.0), 1.0)
        return r["min_lr"] + (r["lr"] - r["min_lr"]) * 0.5 * (1 + math.cos(math.pi * progress))
    tail = r["lr_wsd_decay_samples"] or max((end - warm) // 10, 1)
    f = min(max((x - (end - tail)) / tail, 0.0), 1.0)
    drop = f if r["lr_wsd_decay_style"] == "linear" else math.sqrt(f)
    return r["min_lr"] + (r["lr"] - r["min_lr"]) * (1 - drop)


def test_the_old_sample_schedule_reference_by_hand():
    r = {"lr": 1e-3, "min_lr": 0.0, "lr_schedule": "cosine", "train_samples": 1000, "lr_warmup_samples": 100,
         "lr_decay_samples": 900, "lr_wsd_decay_samples": None, "lr_wsd_decay_style": "linear"}
    expected = {0: 1e-5, 49: 5e-4,          # warmup: lr * (samples + 1) / 100
                100: 1e-3,                  # cosine from here to sample 900
                300: 8.5355339e-4,          # progress 1/4: 0.5 * (1 + cos(pi/4))
                500: 5e-4, 900: 0.0, 950: 0.0}
    for x, lr in expected.items():
        assert old_sample_lr(r, x) == pytest.approx(lr, rel=1e-7, abs=1e-12), x
    assert old_sample_lr({**r, "lr_warmup_samples": 0, "lr_decay_samples": None}, 500) == pytest.approx(5e-4)
    wsd = {**r, "lr_schedule": "wsd", "lr_warmup_samples": 0, "lr_decay_samples": None, "lr_wsd_decay_samples": 200}
    assert old_sample_lr(wsd, 800) == pytest.approx(1e-3) and old_sample_lr(wsd, 900) == pytest.approx(5e-4)


def test_an_old_record_with_the_sample_fields_unused_loads_as_it_was(tmp_path):
    """At their defaults, or without --train-samples (then nothing read them), the fields are dropped; a record
    written now has none."""
    for fields in (SAMPLE_DEFAULTS, {"lr_warmup_samples": 100, "lr_decay_samples": 900}):
        step, _ = old_record(tmp_path / str(len(fields)), **fields)
        assert checkpoint.saved_config(step) == config.resolve("tiny")
    assert not set(SAMPLE_DEFAULTS) & set(config.FIELDS)


@pytest.mark.parametrize("fields, iters", [
    (dict(lr_schedule="cosine", train_samples=1000, lr_decay_samples=800, global_batch=10, steps=100),
     dict(lr_warmup_iters=0, lr_decay_iters=80, lr_wsd_decay_iters=8)),
    (dict(lr_schedule="wsd", lr_wsd_decay_style="minus_sqrt", train_samples=960, global_batch=8, steps=130),
     dict(lr_warmup_iters=0, lr_decay_iters=120, lr_wsd_decay_iters=12)),     # the default tail: 960 // 10 samples
    (dict(lr_schedule="wsd", train_samples=50, lr_warmup_samples=5, lr_decay_samples=40, lr_wsd_decay_samples=7,
          global_batch=1, steps=60), dict(lr_warmup_iters=5, lr_decay_iters=40, lr_wsd_decay_iters=7)),
    (dict(lr_schedule="constant", train_samples=1001, global_batch=8, steps=20),  # a constant LR reads no end
     dict(lr_warmup_iters=0, lr_decay_iters=None, lr_wsd_decay_iters=None)),
], ids=["cosine", "wsd-default-tail", "batch-1-warmup", "constant"])
def test_an_old_sample_schedule_becomes_the_same_schedule_in_steps(tmp_path, fields, iters):
    step, record = old_record(tmp_path, min_lr=1e-5, **fields)
    cfg = checkpoint.saved_config(step)
    assert {k: getattr(cfg, k) for k in iters} == iters
    gb = record["global_batch"]
    lrs = [optim.learning_rate(cfg, it) for it in range(record["steps"] + 5)]
    assert lrs == [old_sample_lr(record, it * gb) for it in range(record["steps"] + 5)]   # every step, exactly
    assert record["lr_schedule"] == "constant" or len(set(lrs)) > 10      # a schedule that moves


@pytest.mark.parametrize("fields, message", [
    (dict(train_samples=1000, lr_warmup_samples=100, lr_decay_samples=900, global_batch=10),
     "(--train-samples 1000 --lr-warmup-samples 100 --lr-decay-samples 900 at --global-batch 10; a warm-up in "
     'samples: no schedule in steps gives its learning rates), which this version no longer reads; to train on with '
     'the nearest schedule in steps, delete the *_samples fields of that file and set "lr_warmup_iters": 10, '
     '"lr_decay_iters": 90; '),
    (dict(train_samples=1000, global_batch=16),
     "(--train-samples 1000 at --global-batch 16; counts that are no multiple of 16: no schedule in steps gives its "
     "learning rates), which this version no longer reads; to train on with the nearest schedule in steps, delete "
     'the *_samples fields of that file and set "lr_warmup_iters": 0, "lr_decay_iters": 63; '),
], ids=["warmup", "not-a-multiple"])
def test_an_old_sample_schedule_no_step_schedule_gives_is_refused(tmp_path, fields, message):
    """A warm-up in samples rose from lr / warm-up at sample 0 (no warm-up in steps does: 1e-5, 1.1e-4 vs 1e-4,
    2e-4 here); --load of the record, any command, is one line and leaves it as it was."""
    step, record = old_record(tmp_path, lr=1e-3, **fields)
    before = open(os.path.join(step, "config.json")).read()
    with pytest.raises(SystemExit) as e:
        train.main(["--load", step, "--eval-only"])
    assert str(e.value) == (f"{step}/config.json: this run's LR schedule counts samples {message}to keep its learning "
                            "rates, resume it with the code that wrote it")
    assert open(os.path.join(step, "config.json")).read() == before


def test_a_resume_that_changes_the_schedule_says_how_the_lr_moves(tmp_path, capfd):
    """--steps 2 -> 4 on resume re-stretches the cosine: at step 3 the LR jumps from the end of the old one (min_lr)
    to its middle, and the resume says so; resuming on the same schedule says nothing."""
    save = str(tmp_path / "ckpt")
    argv = ["--preset", "tiny", "--global-batch", "2", "--save", save]
    steps = lambda n: run_distributed(lambda rank, world: train.main(argv + ["--steps", str(n)])[0], 1)[0]  # noqa
    steps(2)
    resumed = steps(4)
    assert resumed[0]["lr"] == pytest.approx(2e-6 + (2e-4 - 2e-6) / 2)     # cosine progress 1/2
    assert f"--save {save}: the learning rate at step 3 is 0.000101 (it was 2e-06 under the saved schedule)\n" \
        in capfd.readouterr().out
    assert steps(4) == [] and "learning rate at step" not in capfd.readouterr().out


# ---------------------------------------------------------------- 5. a skipped step changes nothing

def _train_with_snapshots(rank, world, argv):
    """train.main, with every trained parameter of this rank recorded as it enters each step's finish."""
    snapshots = []
    real = optim.AdamW.finish

    def spy(opt, *args, **kwargs):
        snapshots.append(torch.cat([p.detach().reshape(-1).clone() for p in opt.params()]))
        return real(opt, *args, **kwargs)

    optim.AdamW.finish = spy
    try:
        history, _ = train.main(list(argv))
    finally:
        optim.AdamW.finish = real
    return history, snapshots


@pytest.mark.slow
def test_skipped_step_does_not_advance_the_schedule(monkeypatch):
    """The optimizer's finish reports inf on step 2 (on every rank, as the real one would): the step is skipped,
    its weights and AdamW state are untouched and the LR schedule does not advance (docs/parallel.md §8)."""
    real, calls = optim.AdamW.finish, []

    def overflow_on_step_2(opt, *args, **kwargs):
        norm, ok = real(opt, *args, **kwargs)   # the real collectives, every rank
        calls.append(1)
        if len(calls) == 2:
            opt.zero_grad()
            return float("nan"), False
        return norm, ok

    monkeypatch.setattr(optim.AdamW, "finish", overflow_on_step_2)   # inherited by the forked children
    argv = ["--preset", "tiny", "--steps", "4", "--global-batch", str(GB), "--lr", "1e-3", "--min-lr", "0",
            "--lr-schedule", "cosine", "--lr-decay-iters", "4", "--vision-dp", "1", "--lm-dp", "2"]
    results = run_distributed(_train_with_snapshots, 3, argv, timeout=60.0)
    cfg = cli.config_of(argv)
    lrs = [optim.learning_rate(cfg, it) for it in (0, 1, 1, 2)]     # step 3 repeats step 2's LR
    assert len(set(lrs)) == 3, lrs
    for rank, (history, snapshots) in enumerate(results):
        assert [h["ok"] for h in history] == [True, False, True, True], rank
        assert [h["lr"] for h in history] == lrs, (rank, [h["lr"] for h in history], lrs)
        assert math.isnan(history[1]["grad_norm"]) and all(math.isfinite(history[i]["grad_norm"]) for i in (0, 2, 3))
        before = snapshots                  # weights entering steps 1, 2, 3, 4
        assert not torch.equal(before[0], before[1]), rank                   # step 1 trained
        assert torch.equal(before[1], before[2]), rank                       # step 2 was skipped: nothing moved
        assert not torch.equal(before[2], before[3]), rank                   # step 3 trained again


# ---------------------------------------------------------------- 6. step consensus: one encoder rank overflows

def train_with_inf(rank, world, argv, at, pick, backwards):
    """train.main where rank `at` turns the gradient of pick(vision, lm) (a parameter it holds) into inf at its
    `backwards` (counted from 1) -> (history, how often the hook ran). Every rank must then skip that step, and
    nobody hangs."""
    real = optim.build
    seen = []

    def build(par, vision, lm, *args, **kwargs):   # the weights as materialised (init.py), before any step
        if rank == at:
            def hook(g):
                seen.append(1)
                return torch.full_like(g, float("inf")) if len(seen) in backwards else g
            pick(vision, lm).register_hook(hook)
        return real(par, vision, lm, *args, **kwargs)

    optim.build = build   # this forked child only
    try:
        history, _ = train.main(list(argv))
    finally:
        optim.build = real
    return history, len(seen)


@pytest.mark.slow
def test_inf_on_one_encoder_rank_skips_everywhere():
    argv = ["--preset", "tiny", "--steps", "3", "--global-batch", str(GB), "--lr", "1e-3", "--lr-schedule", "constant",
            "--vision-dp", "2", "--lm-dp", "2"]                     # hetero: ranks 0-1 vision, 2-3 language
    # vision rank 1's projector weight, in step 2 (its 3rd and 4th backward: two micro-batches a step)
    results = run_distributed(train_with_inf, 4, argv, 1, lambda vision, lm: vision.mlp1["3"].weight, (3, 4),
                              timeout=60.0)
    assert [n for _, n in results] == [0, 6, 0, 0]                # the hook fired on rank 1 only, 2 per step
    for rank, (history, _) in enumerate(results):
        assert [h["ok"] for h in history] == [True, False, True], rank
        assert math.isnan(history[1]["grad_norm"]), rank
        assert history[0]["grad_norm"] == results[0][0][0]["grad_norm"] and math.isfinite(history[2]["grad_norm"])
        if rank >= 2:
            assert all(math.isfinite(h["loss"]) for h in history), rank     # forward was fine, only the update skipped


# ---------------------------------------------------------------- 7. layout errors and the dry run

def test_too_big_for_this_machine_fails_before_allocating(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = config.resolve("20l")
    lay = layout.plan(cfg, 1)
    need = max(r["peak"] for r in memory.plan(cfg, lay, cuda=False).values())
    if need < memory.TRAIN_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        pytest.skip(f"20l ({need / 2 ** 30:.0f} GiB) fits this machine's memory")

    def must_not_run(*args, **kwargs):
        raise AssertionError("got past the fit check")

    monkeypatch.setattr(parallel, "setup", must_not_run)   # models are built after it (the data is indexed before)
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "20l"])
    msg = str(e.value)
    assert msg.startswith("no layout of preset 20l on 1 rank fits") and "such ranks would fit" in msg, msg
    assert "--dry-run" in msg and "\n" not in msg, msg
    assert not dist.is_initialized()


def test_bad_grid_exits_with_the_layout_message(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("layout error came too late"))
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "--vision-dp", "3", "--lm-dp", "2"])
    msg = str(e.value)
    assert msg.startswith("bad parallel layout"), msg
    assert "!= WORLD_SIZE 4" in msg and "do not split evenly over vision dp 3" in msg, msg
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "--vision-dp", "2", "--lm-dp", "2", "--global-batch", "5"])
    assert "global_batch 5 is not divisible" in str(e.value)


@pytest.mark.slow
def test_dry_run_prints_sizes():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "train.py", "--preset", "nano", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["params_language"] == 31577937344                        # Nemotron-3 Nano 30B-A3B decoder
    assert last["params_vision"] == 811558400                            # RADIO ViT-H + projector
    assert last["params_active"] == 3580073408 + last["params_vision"]   # active decoder (~3.6B) + vision
    assert last["params_total"] == last["params_language"] + last["params_vision"]


# ---------------------------------------------------------------- 8. the command line

def _threads_in_main(rank, world, omp):
    """torch's thread count when cli.run calls train.main, with OMP_NUM_THREADS = omp (None: unset), on 2 threads before."""
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp
    torch.set_num_threads(2)
    seen = []
    train.main = lambda argv: seen.append(torch.get_num_threads())   # this forked child only
    cli.run(train.main, [])
    return seen


def test_a_cpu_run_without_torchrun_uses_one_thread():
    """As torchrun sets it: 2 threads on 2 cores are slower on these models, and far slower on shared cores."""
    assert run_distributed(_threads_in_main, 1, None) == [[1]]
    assert run_distributed(_threads_in_main, 1, "2") == [[2]]      # an explicit OMP_NUM_THREADS stays


def test_hf_epochs_flag_is_answered_with_steps():
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--num_train_epochs", "3"])
    assert str(e.value) == ("unknown flag --num-train-epochs. Use --steps (epochs x the data's samples / "
                            "--global-batch: a run counts steps)")
