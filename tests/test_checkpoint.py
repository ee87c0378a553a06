"""Checkpoints on CPU gloo ranks: bit-exact resume (sync; async + SIGTERM), crash safety, resharding (tp2 ep2 on 4
ranks -> 1 process; across pipeline stages: pp2 -> pp1, pp4, one process, pp1 -> pp2, tp2 ep2 pp2 -> pp2), errors
that name file and tensor, export of a trained sharded checkpoint, --eval-only."""
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import checkpoint
import comm
import config
import hf_interop
import layout
import model
import optim
import parallel
import radio
import train
from tests.spawn import run_distributed
from tests.test_failsafe import warm_imports  # noqa: F401 (an autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --lr-decay-iters 6: a 3-step run follows the LR schedule of the 6-step one
TINY = ["--preset", "tiny", "--global-batch", "2", "--lr-decay-iters", "6"]
HETERO = TINY + ["--vision-dp", "2", "--lm-dp", "2"]   # 4 ranks: vision 0-1 | language 2-3, tiny's reference layout
SHARDED = TINY + ["--colocated", "--lm-tp", "2", "--lm-ep", "2"]   # vision tp2 dp2, language tp2 dp2 ep2 edp2


def _train(rank, world, argv, sigterm_at_step=None):
    """train.main in a gloo child -> (losses, {full name: tensor}). sigterm_at_step: rank 0 gets SIGTERM during
    that step (after its backward), so every rank stops after it and saves."""
    if sigterm_at_step and rank == 0:
        finish, calls = optim.AdamW.finish, []

        def finish_then_signal(*a, **k):
            calls.append(1)
            if len(calls) == sigterm_at_step:
                os.kill(os.getpid(), signal.SIGTERM)
            return finish(*a, **k)
        optim.AdamW.finish = finish_then_signal   # this forked child only
    history, modules = train.main(argv)
    return [h["loss"] for h in history], {f"{k}.{n}": t.detach().clone() for k, m in modules.items()
                                          for n, t in m.state_dict().items()}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def straight():
    return run_distributed(_train, 4, HETERO + ["--steps", "6"])


@pytest.mark.parametrize("mode", ["sync", "async_sigterm"])
@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path, straight, mode):
    save = str(tmp_path / "ckpt")
    if mode == "sync":
        first = run_distributed(_train, 4, HETERO + ["--steps", "3", "--save", save, "--save-every", "1",
                                                     "--keep-last", "2"])
    else:   # a signal during step 3 of a 6-step run: the loop stops after it and saves (in a thread)
        first = run_distributed(_train, 4, HETERO + ["--steps", "6", "--save", save, "--save-every", "2",
                                                     "--async-save"], 3)
    assert sorted(os.listdir(save)) == ["latest", "run_config.json", "step_00000002", "step_00000003"]
    assert open(os.path.join(save, "latest")).read().strip() == "step_00000003"
    step_dir = os.path.join(save, "step_00000003")
    meta = json.load(open(os.path.join(step_dir, "meta.json")))
    assert meta["counters"] == {"step": 3, "good_steps": 3, "consumed_samples": 6, "skipped": 0}
    assert [lane["next_sample"] for lane in meta["data"]["lanes"]] == [6, 7]
    assert sorted(f for f in os.listdir(step_dir) if f.endswith(".safetensors")) == [
        f"{kind}.{shard}.safetensors" for kind in ("model", "optim")
        for shard in ("language.ep0-etp0", "language.tp0", "vision.tp0")]
    assert sorted(f for f in os.listdir(step_dir) if f.startswith("rank_")) == [f"rank_{r:05d}.json" for r in range(4)]
    optim = load_file(os.path.join(step_dir, "optim.vision.tp0.safetensors"))   # stage 2: only the projector trains
    assert optim and all(k.startswith("vision.mlp1.") for k in optim)

    if mode == "sync":   # hetero (vision ranks 0-1, language ranks 2-3) -> one colocated process
        (counters, full, _), = run_distributed(_load_one_process, 1, save, 2)
        assert counters == meta["counters"]
        assert_same(full, {**first[0][1], **first[2][1]})

    resumed = run_distributed(_train, 4, HETERO + ["--steps", "6", "--load", save])   # a fresh process group
    for rank in range(4):
        losses, weights = straight[rank]
        assert first[rank][0][:3] + resumed[rank][0] == losses                       # per-step losses, exactly
        assert_same(weights, resumed[rank][1])                                       # final weights, bit-exact


CRASH = r"""
import sys, time
sys.path.insert(0, {root!r})
import checkpoint, train
write, calls = checkpoint.write_atomic, []
def hang_midway(path, obj):
    if "step_00000002" in path and path.endswith(".safetensors"):
        calls.append(path)
        if len(calls) == 2:              # the first file of the save is written, the second never is
            open({marker!r}, "w").close()
            time.sleep(600)
    write(path, obj)
checkpoint.write_atomic = hang_midway
train.main({argv!r})
"""


@pytest.mark.slow
def test_killed_save_leaves_latest_at_previous_checkpoint(tmp_path):
    save, marker = str(tmp_path / "ckpt"), str(tmp_path / "hanging")
    argv = TINY + ["--steps", "4", "--save", save, "--save-every", "1"]
    proc = subprocess.Popen([sys.executable, "-c", CRASH.format(root=ROOT, marker=marker, argv=argv)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not os.path.exists(marker) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.exists(marker), "the save never reached the hanging write"
    assert open(os.path.join(save, "latest")).read().strip() == "step_00000001"
    assert not os.path.exists(os.path.join(save, "step_00000002", "meta.json"))
    with pytest.raises(FileNotFoundError, match=r"step_00000002/meta\.json: missing"):
        checkpoint.resolve(os.path.join(save, "step_00000002"))
    (losses, _), = run_distributed(_train, 1, TINY + ["--steps", "2", "--load", save])
    assert len(losses) == 1


# ---------------------------------------------------------------- resharding

def _grid_coords(lay, rank):
    """{"vision": {tp}, "language": {tp, ep, etp}} of a rank of a colocated layout."""
    lm, ex = parallel.lm_grid(lay).coords(rank), parallel.expert_grid(lay).coords(rank)
    return {"vision": {"tp": parallel.vision_grid(lay).coords(rank)["tp"]},
            "language": {"tp": lm["tp"], "ep": ex["ep"], "etp": ex["etp"]}}


def _load_one_process(rank, world, path, stage):
    cfg = config.resolve("tiny")
    par = parallel.setup(layout.plan(dataclasses.replace(cfg, global_batch=4), 1), cfg)
    modules = {"vision": radio.VisionModel(cfg), "language": model.LanguageModel(cfg)}
    model.set_trainable(modules, stage)
    opt = optim.build(par, modules["vision"], modules["language"], dataclasses.replace(
        cfg, distributed_optimizer=False), torch.device("cpu"))
    counters = checkpoint.load(path, par, modules, opt, cfg)
    names = {id(p): f"{k}.{n}" for k, m in modules.items() for n, p in m.named_parameters()}
    return (counters, {f"{k}.{n}": t.detach().clone() for k, m in modules.items() for n, t in m.state_dict().items()},
            {names[i]: s for i, s in opt.gather_state().items() if s["step"] > 0})   # state: AdamW stepped it


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """2 steps under colocated tp2 ep2 on 4 ranks, saved: (checkpoint dir, per-rank weights)."""
    save = str(tmp_path_factory.mktemp("sharded") / "ckpt")
    return save, run_distributed(_train, 4, SHARDED + ["--steps", "2", "--save", save])



def test_export_hf_pins_the_step_it_chose(sharded, tmp_path, monkeypatch):
    """export-hf of a save directory holds the step it resolved against --keep-last pruning from the moment it
    chose it: a prune between the choice and the reads (a live run's save) leaves the step, and the export is
    that step's."""
    import locks
    save, _ = sharded
    copy = str(tmp_path / "ckpt")
    shutil.copytree(save, copy)
    export = hf_interop.export

    def pruned_first(path, *args, **kwargs):   # the run's prune lands right after export-hf chose its step
        locks.prune(copy, [os.path.basename(path)])
        return export(path, *args, **kwargs)
    monkeypatch.setattr(hf_interop, "export", pruned_first)
    try:
        hf_interop.main(["export-hf", "--load", copy, "--out", str(tmp_path / "hf")])
    finally:
        locks.unpin()
    assert os.path.isdir(os.path.join(copy, "step_00000002"))
    assert_same(hf_interop.import_hf(str(tmp_path / "hf"), preset="tiny")[1], checkpoint.load_model(save)[1])

@pytest.mark.slow
def test_reshard_tp2_ep2_to_one_process(sharded, tmp_path):
    save, ranks = sharded
    assert sorted(f for f in os.listdir(os.path.join(save, "step_00000002")) if f.startswith("model.")) == [
        "model.language.ep0-etp0.safetensors", "model.language.ep1-etp0.safetensors",
        "model.language.tp0.safetensors", "model.language.tp1.safetensors",
        "model.vision.tp0.safetensors", "model.vision.tp1.safetensors"]
    # stage 2 checkpoint into a stage 3 run: the vision tower has no saved AdamW state and starts fresh
    (counters, full, state), = run_distributed(_load_one_process, 1, save, 3)
    assert counters["step"] == 2 and counters["consumed_samples"] == 4
    cfg = config.resolve("tiny")
    lay = layout.plan(dataclasses.replace(cfg, global_batch=4, lm_tp=2, lm_ep=2, colocated=True), 4)
    sizes = {"vision": {"tp": 2}, "language": {"tp": 2, "ep": 2, "etp": 1}}
    specs = {f"{k}.{n}": getattr(t, "shards", ()) for k, m in (("vision", radio.VisionModel(cfg)),
             ("language", model.LanguageModel(cfg))) for n, t in m.state_dict(keep_vars=True).items()}
    for rank, (_, local) in enumerate(ranks):   # the one-process tensors, resharded, are each rank's tensors
        coords = _grid_coords(lay, rank)
        for name, t in local.items():
            module = name.split(".")[0]
            expected = full[name]
            for kind, dim, segments in specs[name]:
                expected = comm.shard(expected, dim, coords[module][kind], sizes[module][kind], segments)
            assert torch.equal(expected, t), (rank, name)
    assert any(k.endswith("e_score_correction_bias") and full[k].abs().max() > 0 for k in full)
    assert "vision.blocks.0.attn.qkv.weight" not in state and state["vision.mlp1.1.weight"]["step"] == 2
    assert state["language.backbone.layers.1.mixer.experts.up_proj"]["exp_avg"].shape == (8, 32, 64)

    # continuing on 1 process tracks the 4-rank run (same math, other reduction order: not bit-exact)
    more = ["--steps", "3", "--load", save, "--save"]   # saved elsewhere: the fixture stays at step 2
    four = run_distributed(_train, 4, SHARDED + more + [str(tmp_path / "four")])
    (one, weights), = run_distributed(_train, 1, TINY + more + [str(tmp_path / "one")])
    assert len(one) == 1 and abs(one[0] - four[0][0][0]) < 1e-5
    assert (weights["language.lm_head.weight"][:256] - four[0][1]["language.lm_head.weight"]).abs().max() < 1e-6


def test_errors_name_file_and_tensor(sharded, tmp_path):
    save, _ = sharded
    src = os.path.join(save, "step_00000002")

    def copy():
        dst = str(tmp_path / f"copy{len(os.listdir(tmp_path))}")
        shutil.copytree(src, dst)
        return dst
    bad = copy()
    path = os.path.join(bad, "model.language.ep1-etp0.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=r"ep1-etp0\.safetensors: tensor language\.\S+: unreadable \(.*incomplete"):
        checkpoint.load_model(bad)
    bad = copy()
    path = os.path.join(bad, "model.language.tp1.safetensors")
    with open(path, "r+b") as f:   # one flipped byte in the last tensor's data
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ValueError, match=r"model\.language\.tp1\.safetensors: tensor language\.\S+: checksum"):
        checkpoint.load_model(bad)
    bad = copy()
    os.remove(os.path.join(bad, "model.vision.tp1.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"model\.vision\.tp1\.safetensors: missing \(holds tensor vision"):
        checkpoint.load_model(bad)
    with pytest.raises(RuntimeError, match=r"resumes its run, whose value differs: --hidden-size 96 \(the checkpoint's: 64\)"):
        run_distributed(_train, 1, TINY + ["--steps", "3", "--load", save, "--hidden-size", "96"])


def test_export_hf_of_sharded_checkpoint(sharded, tmp_path):
    save, _ = sharded
    out = str(tmp_path / "hf")
    hf_interop.main(["export-hf", "--load", save, "--out", out])
    cfg, full = checkpoint.load_model(save)
    with open(os.path.join(out, hf_interop.INDEX_NAME if os.path.exists(os.path.join(out, hf_interop.INDEX_NAME))
                           else "config.json")) as f:
        assert f.read()
    cfg2, back = hf_interop.import_hf(out, preset="tiny")
    assert_same(back, full)
    assert all(getattr(cfg2, k) == getattr(cfg, k) for k in config.MODEL_FIELDS)


def _opened_per_file(rank, world, path, carried_from=None):
    """checkpoint.load into one process of `path` (a checkpoint; an HF directory through HFSource, which the caller
    keeps, as train.py does) -> ({file: opens during the load}, the files of `path` still mapped once the load is
    done). carried_from: instead, copy_source of that HF directory into `path`, counting its opens."""
    opens, real = {}, checkpoint.safe_open

    def counting(file, **kw):
        opens[file] = opens.get(file, 0) + 1
        return real(file, **kw)
    checkpoint.safe_open = counting
    if carried_from is not None:
        hf_interop.copy_source(carried_from, path)
        return opens, None
    source = hf_interop.HFSource(path, "tiny", say=lambda m: None) if hf_interop.is_hf_dir(path) else path
    opens.clear()   # HFSource's own checks
    cfg = config.resolve("tiny")
    par = parallel.setup(layout.plan(dataclasses.replace(cfg, global_batch=4), 1), cfg)
    modules = {"vision": radio.VisionModel(cfg), "language": model.LanguageModel(cfg)}
    opt = optim.build(par, modules["vision"], modules["language"], cfg, torch.device("cpu"))
    checkpoint.load(source, par, modules, opt, cfg)
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if os.path.realpath(path) in line}
    return opens, mapped


def test_a_load_opens_each_file_once_and_keeps_none(sharded, tmp_path):
    """A load (weights and AdamW state) opens each safetensors file once for all the tensors it holds and closes
    them at its end (checkpoint.Files): a checkpoint's, and an HF directory's, whose HFSource train.py keeps for the
    whole run. copy_source reads all the carried tensors of a file at one opening."""
    save, _ = sharded
    hf = str(tmp_path / "hf")
    hf_interop.main(["export-hf", "--load", save, "--out", hf, "--max-shard-bytes", "200000"])
    shards = [f for f in os.listdir(hf) if f.endswith(".safetensors")]
    for path, files in ((save, 2 * 2 * 4), (hf, len(shards))):   # model and optim, 2 modules, 4 shards at most
        (opens, mapped), = run_distributed(_opened_per_file, 1, path)
        assert 1 < len(opens) <= files and set(opens.values()) == {1} and not mapped, (path, opens, mapped)
    with safe_open(os.path.join(hf, shards[0]), framework="pt") as f:   # a released directory's extra weights
        first = {k: f.get_tensor(k) for k in f.keys()}
    sound = {"sound_encoder.weight": torch.randn(3, 2), "sound_projection.weight": torch.randn(2, 2)}
    save_file({**first, **sound}, os.path.join(hf, shards[0]))
    index = os.path.join(hf, hf_interop.INDEX_NAME)
    with open(index) as f:
        meta = json.load(f)
    meta["weight_map"].update({k: shards[0] for k in sound})
    with open(index, "w") as f:
        json.dump(meta, f)
    (opens, _), = run_distributed(_opened_per_file, 1, str(tmp_path / "source"), hf)
    assert opens[os.path.join(hf, shards[0])] == 1 and set(opens.values()) == {1}
    carried = load_file(tmp_path / "source" / hf_interop.CARRIED_NAME)
    assert sorted(carried) == sorted([*sound, "vision_model.radio_model.summary_idxs"])
    assert all(torch.equal(carried[k], v) for k, v in sound.items())


@pytest.mark.slow
def test_eval_only_prints_json_last(sharded):
    save, _ = sharded   # the tiny preset's model, read from the checkpoint's config.json (no --preset given)
    out = subprocess.run([sys.executable, "train.py", "--eval-only", "--load", save], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) == {"eval_loss", "eval_ppl", "eval_tokens", "eval_samples"}, result
    assert result["eval_samples"] == train.MOCK_EVAL_SAMPLES and result["eval_tokens"] > 0 and 0 < result["eval_loss"] < 20
    assert abs(result["eval_ppl"] - math.exp(result["eval_loss"])) <= 1e-9 * result["eval_ppl"]


@pytest.mark.slow
def test_resume_across_the_three_kinds_of_layout(tmp_path):
    """Saved after 2 steps on 4 shared ranks where each module has its own lanes (vision dp4, language tp2 dp2
    ep2), step 3 runs on the same layout, a hetero one and an in-place colocated one: each equals the 3-step run
    that never stopped (loss to 1e-5; other reduction orders, not bit-exact)."""
    argv = TINY + ["--global-batch", "4", "--micro-batch", "2"]
    shared = ["--colocated", "--vision-tp", "1", "--vision-dp", "4", "--lm-tp", "2", "--lm-dp", "2", "--lm-ep", "2"]
    save = str(tmp_path / "shared")
    straight = run_distributed(_train, 4, argv + shared + ["--steps", "3"])[0][0]
    run_distributed(_train, 4, argv + shared + ["--steps", "2", "--save", save])
    for name, flags in (("shared", shared), ("hetero", ["--vision-tp", "2", "--vision-dp", "1", "--lm-dp", "2"]),
                        ("in place", ["--colocated", "--lm-tp", "2", "--lm-ep", "2"])):
        ranks = run_distributed(_train, 4, argv + flags + ["--steps", "3", "--load", save, "--save",
                                                           str(tmp_path / ("to-" + name.replace(" ", "-")))])
        (loss,) = {h[0] for h, _ in ranks if h[0] is not None}
        assert abs(loss - straight[2]) < 1e-5, (name, loss, straight)


# ---------------------------------------------------------------- pipeline stages

def PP(n):
    """Hetero with n language pipeline stages: vision on rank 0, stage s on rank 1 + s (1 + n ranks)."""
    return TINY + ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", str(n)]


def _whole(ranks):
    """{full name: tensor} of the whole model, from _train's per-rank results (each rank holds its stage's part)."""
    out = {}
    for _, state in ranks:
        assert not set(state) & set(out), "two ranks hold one tensor"
        out.update(state)
    return out


def assert_close(a, b, atol=1e-6):
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k] - b[k]).abs().max() <= atol, k


@pytest.fixture(scope="module")
def pp_straight():
    """3 steps of hetero pp2 on 3 ranks that never stopped: (the last stage's losses, the whole model)."""
    ranks = run_distributed(_train, 3, PP(2) + ["--steps", "3"])
    return ranks[-1][0], _whole(ranks)


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_at_any_pp(pp_straight, tmp_path):
    """Saved after 2 steps of hetero pp2: each stage writes files of its own, which one process loads exactly;
    step 3 on the same layout is bit-exact, on 1 stage (2 ranks) and on 4 (5 ranks, tiny's 8 layers 2 a stage)
    it equals the straight run (loss to 1e-5; weights to 1e-6)."""
    losses, weights = pp_straight
    save = str(tmp_path / "pp2")
    first = run_distributed(_train, 3, PP(2) + ["--steps", "2", "--save", save])
    step_dir = os.path.join(save, "step_00000002")
    assert sorted(f for f in os.listdir(step_dir) if f.endswith(".safetensors")) == [
        f"{kind}.{shard}.safetensors" for kind in ("model", "optim") for shard in (
            "language.pp0-ep0-etp0", "language.pp0-tp0", "language.pp1-ep0-etp0", "language.pp1-tp0", "vision.tp0")]
    tensors = json.load(open(os.path.join(step_dir, "meta.json")))["tensors"]
    stages = model.stage_layers(config.resolve("tiny"), 2)
    assert tensors["language.backbone.embeddings.weight"]["pp"] == 0 and tensors["language.lm_head.weight"]["pp"] == 1
    assert tensors[f"language.backbone.layers.{stages[1][0]}.norm.weight"]["pp"] == 1
    assert all("pp" not in spec for name, spec in tensors.items() if name.startswith("vision."))
    (counters, full, state), = run_distributed(_load_one_process, 1, save, 2)
    assert counters["step"] == 2
    assert_same(full, _whole(first))
    assert state["language.lm_head.weight"]["step"] == 2 and "language.backbone.embeddings.weight" in state

    for n in (2, 1, 4):
        ranks = run_distributed(_train, 1 + n, PP(n) + ["--steps", "3", "--load", save, "--save",
                                                        str(tmp_path / f"to-pp{n}")])
        assert all(h == [None] for h, _ in ranks[:-1])   # the loss is known on the last stage only
        if n == 2:   # the same layout: RNG restored, every rank's tensors bit-exact
            assert first[-1][0] + ranks[-1][0] == losses
            assert_same(_whole(ranks), weights)
        else:
            assert abs(ranks[-1][0][0] - losses[2]) < 1e-5, (n, ranks[-1][0], losses)
            assert_close(_whole(ranks), weights)


@pytest.mark.slow
def test_one_stage_checkpoint_resumes_in_a_pipeline(pp_straight, tmp_path):
    """Saved after 2 steps of hetero pp1 (2 ranks): the format without stages (no pp in names or specs); step 3 on
    hetero pp2 equals the straight pp2 run."""
    losses, weights = pp_straight
    save = str(tmp_path / "pp1")
    run_distributed(_train, 2, PP(1) + ["--steps", "2", "--save", save])
    step_dir = os.path.join(save, "step_00000002")
    assert sorted(f for f in os.listdir(step_dir) if f.startswith("model.")) == [
        "model.language.ep0-etp0.safetensors", "model.language.tp0.safetensors", "model.vision.tp0.safetensors"]
    assert all("pp" not in spec for spec in json.load(open(os.path.join(step_dir, "meta.json")))["tensors"].values())
    ranks = run_distributed(_train, 3, PP(2) + ["--steps", "3", "--load", save])
    assert abs(ranks[-1][0][0] - losses[2]) < 1e-5, (ranks[-1][0], losses)
    assert_close(_whole(ranks), weights)


@pytest.mark.slow
def test_pipeline_with_tp_and_ep_reshards(pp_straight, tmp_path):
    """Colocated tp2 ep2 pp2 on 4 ranks (each stage's tp, ep slices in files of their own): the one-process tensors,
    resharded, are each rank's; step 3 resumed on hetero pp2 equals the straight run."""
    losses, _ = pp_straight
    flags = ["--colocated", "--vision-tp", "2", "--vision-dp", "2", "--lm-tp", "2", "--lm-ep", "2", "--lm-pp", "2",
             "--micro-batch", "2"]
    save = str(tmp_path / "sharded")
    ranks = run_distributed(_train, 4, TINY + flags + ["--steps", "2", "--save", save])
    assert sorted(f for f in os.listdir(os.path.join(save, "step_00000002")) if f.startswith("model.language")) == [
        f"model.language.pp{s}-{shard}.safetensors" for s in (0, 1) for shard in ("ep0-etp0", "ep1-etp0", "tp0", "tp1")]
    (_, full, _), = run_distributed(_load_one_process, 1, save, 2)
    cfg = config.resolve("tiny")
    lay = layout.plan(dataclasses.replace(cfg, global_batch=2, micro_batch=2, vision_tp=2, vision_dp=2, lm_tp=2,
                                          lm_ep=2, lm_pp=2, colocated=True), 4)
    sizes = {"vision": {"tp": 2}, "language": {"tp": 2, "ep": 2, "etp": 1}}
    specs = {f"{k}.{n}": getattr(t, "shards", ()) for k, m in (("vision", radio.VisionModel(cfg)),
             ("language", model.LanguageModel(cfg))) for n, t in m.state_dict(keep_vars=True).items()}
    for rank, (_, local) in enumerate(ranks):
        coords = _grid_coords(lay, rank)
        assert ("language.lm_head.weight" in local) == (rank >= 2)   # stage 1 on ranks 2, 3
        for name, t in local.items():
            module, expected = name.split(".")[0], full[name]
            for kind, dim, segments in specs[name]:
                expected = comm.shard(expected, dim, coords[module][kind], sizes[module][kind], segments)
            assert torch.equal(expected, t), (rank, name)
    resumed = run_distributed(_train, 3, PP(2) + ["--steps", "3", "--load", save, "--save", str(tmp_path / "pp2")])
    assert abs(resumed[-1][0][0] - losses[2]) < 1e-5, (resumed[-1][0], losses)


def test_the_field_lists_are_what_the_fields_say():
    """Issue 54: each field says its role in its metadata (config.ROLES) and the lists a checkpoint and a resume
    check are derived from them: a field added with role="language" is checked on --load with no list to edit."""
    import dataclasses
    assert {f.metadata.get("role") for f in dataclasses.fields(config.Config)} == {None, *config.ROLES}
    assert set(config.MODEL_FIELDS) == set(config.LANGUAGE_FIELDS) | set(config.VISION_FIELDS) | {"image_token_id"}
    assert set(config.FIXED_ON_RESUME) - set(config.MODEL_FIELDS) == {"preset", "lora_rank", "lora_alpha",
                                                                         "lora_targets", "tokenizer"}
    assert len(config.LANGUAGE_FIELDS) == 23 and len(config.VISION_FIELDS) == 10
    assert config.LAYOUT_FIELDS == ("vision_tp", "vision_dp", "lm_tp", "lm_dp", "lm_ep", "lm_etp", "lm_cp", "lm_pp",
                                    "colocated")
    assert {"mtp_depths", "mtp_loss_scale", "min_num_patches", "seq_len", "steps"}.isdisjoint(config.FIXED_ON_RESUME)
    # fields a record of an earlier version may lack (later=True): the 13 added since records began
    assert set(config.LATER_FIELDS) == {"wandb", "moe_latent_size", "num_nextn_predict_layers", "mtp_pattern",
                                        "mtp_depths", "mtp_loss_scale", "lm_cp", "video_temporal_patch",
                                        "video_target_patches", "video_fps", "max_frames", "collective_timeout",
                                        "lm_pp"}
