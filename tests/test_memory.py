"""memory.py: the --dry-run plan's arithmetic on a tiny model counted by hand, and the CLI's last JSON line."""
import json
import os
import subprocess
import sys

import pytest
import torch

import chooser
import cli
import config
import cost
import layout
import memory
from radio import VisionModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one attention and one MoE layer; hetero: vision dp2 on ranks 0-1, language tp1 dp2 ep2 (edp 1) on ranks 2-3
ARGV = ["--preset", "tiny", "--hybrid-override-pattern", "*E", "--stage", "3", "--global-batch", "2",
        "--vision-dp", "2", "--lm-dp", "2", "--lm-ep", "2"]


def _cfg_lay(extra=()):
    cfg = cli.config_of(ARGV + list(extra))
    return cfg, layout.plan(cfg, 4)


def plan(extra=()):
    cfg, lay = _cfg_lay(extra)
    return memory.plan(cfg, lay), lay


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
    moe = (2 * T * D + 4 * T * D + 4 * 2 * T * 8 + 2 * T * 64          # input, fp32 router input, scores, shared
           + 2 * (T * 2) * (2 * D + 32) + 2 * T * D + 2 * T * D)       # routed rows in/out + up, combined
    logits = 2 * T * 512
    head = 2 * 2 * T * D + logits + 8 * T
    assert (block + attn, block + moe) == (75648, 153984)
    # the mock's 64 x 64 image: 16 patches, 4 image rows after the 2 x 2 pixel shuffle, which the bridge hands over
    # and whose gradient returns
    received = 2 * 1 * 4 * D
    assert lang["activations"] == (block + attn) + (block + moe) + head + logits + 2 * received == 451584 + 1024
    assert lang["workspace"] == 2 * 2 ** 25
    assert lang["peak"] == 206208 + 412416 + 716928 + 451584 + 1024 + 2 * 2 ** 25
    # set-up (init.py): the weights as they train (bf16), + one full-size fp32 draw of the largest (embeddings, 512 x
    # 64); the training peak is higher
    assert lang["setup"] == 2 * (dense + experts) + 4 * 512 * 64 == 337280 < lang["peak"]
    checkpointed, _ = plan(["--activation-checkpointing"])
    ck = checkpointed["language"]
    assert ck["activations"] == 2 * 2 * T * D + (block + moe) + head + logits + 2 * received
    # the experts (edp 1) then keep fp32 weights that are their own main weights: 4 + 4 + 8 bytes, not 2 + 4 + 12
    assert (ck["weights"], ck["gradients"]) == (2 * dense + 4 * experts, lang["gradients"])
    assert ck["optimizer"] == 6 * dense + 8 * experts
    cpu = memory.plan(*_cfg_lay(["--activation-checkpointing"]), cuda=False)["language"]   # fp32, one-rank: aliased
    assert (cpu["weights"], cpu["optimizer"]) == (4 * (dense + experts), 6 * dense + 8 * experts)


def test_language_activations_under_cp_by_hand():
    """The dry run's language activations at cp 2 and 4 (hetero: the language row is the language model alone), on
    M * E with 4 Mamba groups: T = 96 / cp tokens a rank, attention's K and V over the whole row of 96, and the
    largest exchange's send and receive buffers (here Mamba's in_proj rows: 2 x 128 + 2 x 4 x 16 + 8 wide)."""
    D = 64
    for cp in (2, 4):
        cfg = cli.config_of(["--preset", "tiny", "--hybrid-override-pattern", "M*E", "--n-groups", "4",
                               "--stage", "3", "--vision-dp", "1", "--lm-dp", "1", "--lm-cp", str(cp)])
        lay = layout.plan(cfg, 1 + cp)
        T = 96 // cp
        block = 2 * T * D + 4 * T
        mamba = 2 * T * D + 2 * T * (2 * 128 + 2 * 64 + 8) + 2 * 2 * T * 128 + 4 * T * 4
        attn = 2 * T * D + 2 * (T * 4 + 2 * 2 * 96) * 16 + 2 * 2 * T * 4 * 16 + 4 * T * 4   # K, V: the whole row
        moe = (2 * T * D + 4 * T * D + 4 * 2 * T * 8 + 2 * T * 64
               + 2 * (T * 2) * (2 * D + 32) + 2 * T * D + 2 * T * D)
        logits = 2 * T * 512
        head = 2 * 2 * T * D + logits + 8 * T
        exchange = 2 * 2 * T * 392
        received = 2 * 4 * D   # the mock image's 4 rows, whole on every cp rank, and their gradient
        want = 3 * block + mamba + attn + moe + head + logits + exchange + 2 * received
        assert memory.plan(cfg, lay)["language"]["activations"] == want == {2: 383680, 4: 198496}[cp]


def test_pipeline_stages_by_hand():
    """tiny (MEM*EM-E, stage 2) in pipeline stages beside one vision rank (hetero): pp2 (MEM* | EM-E) at dp2, 4
    micro-batches a step; pp4 (ME | M* | EM | -E) at dp1, 8. A stage holds its layers' parameters (the first the
    embedding, the last norm_f and lm_head), its set-up draws its largest (the embedding, the head: 512 x 64), and
    stage s of p keeps the activations of min(p - s, n) micro-batches; the encoder min(p + 1, n)."""
    M = 64 + 3 * 8 + 328 * 64 + 192 * 4 + 192 + 128 + 64 * 128   # norm, dt_bias / A_log / D, in_proj, conv, norm, out
    E, experts = 64 + 8 * 64 + 2 * 64 * 64, 8 * 2 * 32 * 64    # norm, router, shared expert; the 8 experts
    A, F, V = 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64, 64 + 2 * 64 * 64, 512 * 64   # attention, MLP; embedding, head
    assert (M, E, A, F) == (30360, 8768, 12352, 8256)
    T, D = 96, 64
    block = 2 * T * D + 4 * T
    act = {"M": block + 2 * T * D + 2 * T * 328 + 2 * 2 * T * 128 + 4 * T * 2, "E": 153984, "*": 75648,
           "-": block + 2 * T * D + 2 * T * 64}             # E and *: test_language_rank_by_hand's
    out, logits = 2 * T * D, 2 * T * 512     # a stage's output (kept; its gradient comes back), the logits
    received = 2 * 4 * D   # the first stage's image rows from the bridge (kept), their gradient (passing)
    head = 2 * 2 * T * D + logits + 8 * T    # norm_f and lm_head inputs, logits, lse

    def rows(argv):
        cfg = cli.config_of(["--preset", "tiny", "--vision-dp", "1", *argv])
        lay = layout.plan(cfg, 5)
        return memory.plan(cfg, lay), memory.vision_activation_bytes(cfg, lay), lay

    pp2, vision, lay = rows(["--lm-dp", "2", "--lm-pp", "2"])
    assert (lay.num_microbatches, lay.lm_edp) == (4, 2) and list(pp2) == ["vision", "language pp0", "language pp1"]
    params = [(V + M + E + M + A, experts), (E + M + F + E + 64 + V, 2 * experts)]   # (dense, experts); 64: norm_f
    keeps = [act["M"] + act["E"] + act["M"] + act["*"] + out + received,
             act["E"] + act["M"] + act["-"] + act["E"] + head]
    passing = [out + received, logits]    # the gradient of the outputs and the rows; of the logits
    for s, ((dense, exp), kept, gone) in enumerate(zip(params, keeps, passing)):
        r, n = pp2[f"language pp{s}"], dense + exp   # dp 2, edp 2: 2 + 4 + 12 / 2 bytes a parameter
        assert (r["weights"], r["gradients"], r["optimizer"]) == (2 * n, 4 * n, 6 * n)
        assert r["setup"] == r["weights"] + 4 * 512 * 64
        assert r["activations"] == (2 - s) * kept + gone
    assert [pp2[f"language pp{s}"]["activations"] for s in (0, 1)] == [1049088, 705024]
    assert pp2["vision"]["activations"] == 3 * vision

    pp4, vision, lay = rows(["--lm-dp", "1", "--lm-pp", "4"])
    assert lay.num_microbatches == 8
    params = [(V + M + E, experts), (M + A, 0), (E + M, experts), (F + E + 64 + V, experts)]
    keeps = [act["M"] + act["E"] + out + received, act["M"] + act["*"] + out, act["E"] + act["M"] + out,
             act["-"] + act["E"] + head]
    for s, ((dense, exp), kept, gone) in enumerate(zip(params, keeps, [out + received, out, out, logits])):
        r = pp4[f"language pp{s}"]   # dp 1, edp 1: 2 + 4 + 12 bytes
        assert (r["weights"], r["optimizer"]) == (2 * (dense + exp), 12 * (dense + exp))
        assert r["activations"] == (4 - s) * kept + gone
    assert [pp4[f"language pp{s}"]["activations"] for s in range(4)] == [1231360, 689664, 620544, 413184]
    assert pp4["vision"]["activations"] == 5 * vision


def test_colocated_pipeline_stage_holds_the_tower_too():
    """Colocated pp2 on 2 ranks (the tower dp2 on its own lanes, micro-batch 2: twice the tokens of
    test_pipeline_stages_by_hand's): a row a stage, each the tower's bytes plus the stage's. The tower keeps 3
    micro-batches while its next forward runs, 2 beside a language forward; stage 0 keeps 1 then, 2 after."""
    cfg = cli.config_of(["--preset", "tiny", "--colocated", "--lm-pp", "2", "--vision-tp", "1", "--micro-batch", "2"])
    lay = layout.plan(cfg, 2)
    rows, V = memory.plan(cfg, lay), memory.vision_activation_bytes(cfg, lay)
    assert lay.kind == "own lanes" and lay.num_microbatches == 4 and list(rows) == ["language pp0", "language pp1"]
    kept = [2 * 517632, 2 * 606720]   # test_pipeline_stages_by_hand's stages at twice the tokens
    assert [memory.language_activation_bytes(cfg, lay, s) for s in (0, 1)] == [(kept[0], 2 * 2 * 96 * 64),
                                                                            (kept[1], 2 * 2 * 96 * 512)]
    received = 2 * 2 * 4 * 64   # stage 0's image rows of 2 samples from the tower's lanes, and their gradient
    assert rows["language pp0"]["activations"] == max(3 * V + kept[0] + received,
                                                      2 * V + 2 * (kept[0] + received) + 24576 + received) == 2106368
    assert rows["language pp1"]["activations"] == max(3 * V, 2 * V + kept[1] + 196608) == 1418240
    for s, r in enumerate(rows.values()):
        alone = memory.parameter_bytes(cfg, lay, True, s)
        assert r["weights"] == alone["vision"]["weights"] + alone["language"]["weights"]
        assert r["setup"] == r["weights"] + 4 * 512 * 64


def test_dry_run_shows_the_stages_and_the_bubble(capsys):
    """The dry run of a pipeline: a plan row and a verdict a stage, and the pipe's bubble."""
    cfg = cli.config_of(["--preset", "tiny", "--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "4"])
    lay = layout.plan(cfg, 5)
    predicted = cost.step_seconds(cfg, lay)
    memory.dry_run(cfg, lay, 80 * memory.GIB, predicted)
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert list(last["peak_gib_per_rank"]) == ["vision"] + [f"language pp{s}" for s in range(4)]
    assert last["predicted_s"]["bubble"] == round(predicted["bubble"], 4) and 0 < predicted["bubble"] < 1
    assert any(line.startswith("predicted on Hopper") and f"bubble {100 * predicted['bubble']:.0f} %" in line
               for line in lines)
    assert sum(line.startswith("  language pp") and " fits 80.0 GiB" in line for line in lines) == 4


def test_vision_rank_and_plain_optimizer():
    rows, lay = plan()
    with torch.device("meta"):
        n = sum(p.numel() for p in VisionModel(config.resolve("tiny")).parameters())
    vision = rows["vision"]                      # stage 3, vision tp1 dp2: every parameter trains, sharded over 2
    assert (vision["weights"], vision["gradients"], vision["optimizer"]) == (2 * n, 4 * n, 6 * n)
    assert vision["setup"] == 2 * n   # its weights: the tower is drawn on the CPU
    plain, _ = plan(["--no-distributed-optimizer"])   # fp32 weights, + autocast's bf16 copies kept for backward
    assert (plain["vision"]["weights"], plain["vision"]["optimizer"]) == (4 * n, 8 * n)
    assert plain["language"]["optimizer"] == 8 * (86720 + 16384)
    assert plain["language"]["activations"] == rows["language"]["activations"] + 2 * (86720 + 16384)
    frozen, _ = plan(["--stage", "1"])           # only the projector trains; the tower is bf16 and nothing else
    proj = sum(p.numel() for k, p in VisionModel(config.resolve("tiny"), None).named_parameters() if "mlp1" in k)
    assert frozen["vision"]["weights"] == 2 * n and frozen["vision"]["gradients"] == 4 * proj


@pytest.mark.slow
def test_dry_run_cli_last_line():
    """Nano as chosen for 8 ranks of 80 GiB, 20l's reference layout, a colocated tiny layout of 4 ranks of 16 GiB:
    the last line is the plan in GiB, with the verdict per rank kind against that memory."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")}
    cases = ((["--preset", "nano"], 8, 80), (["--preset", "20l"], 8, 80),
             (["--preset", "tiny", "--colocated", "--lm-tp", "2", "--lm-ep", "2", "--gpu-memory", "16"], 4, 16))
    for argv, world, gib in cases:
        out = subprocess.run([sys.executable, "train.py", *argv, "--dry-run", "--world-size", str(world)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        last = json.loads(lines[-1])
        cfg = cli.config_of(argv)
        lay = chooser.plan(cfg, world, gib * memory.GIB)
        rows = memory.plan(cfg, lay)
        assert last["layout"] == lay.describe()
        assert last["peak_gib_per_rank"] == {k: round(r["peak"] / 2 ** 30, 2) for k, r in rows.items()}
        assert lay.colocated == (rows["vision"] == rows["language"])
        assert last["capacity_gib"] == gib and last["fits"] == {"vision": True, "language": True}
        for kind, r in rows.items():   # e.g. "  language fits 80.0 GiB: peak 71.30 GiB (89 %), setup 19.04 GiB (24 %)"
            peak, setup = r["peak"] / memory.GIB, r["setup"] / memory.GIB
            verdict = (f"{kind} fits {gib:.1f} GiB: peak {memory.figure(peak)} GiB ({100 * peak / gib:.0f} %), setup "
                       f"{memory.figure(setup)} GiB ({100 * setup / gib:.0f} %)")
            assert verdict in [" ".join(line.split()) for line in lines], (verdict, lines)


def test_dry_run_verdict_per_rank_kind(capsys):
    """A hetero layout on ranks with room for the vision rank's plan but not for the language rank's."""
    cfg, lay = _cfg_lay()
    rows = memory.plan(cfg, lay)
    vision, language = rows["vision"]["peak"], rows["language"]["peak"]
    assert vision < language
    memory.dry_run(cfg, lay, (vision + language) / 2 / memory.TRAIN_SHARE, cost.step_seconds(cfg, lay))
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1])["fits"] == {"vision": True, "language": False}
    assert [line.split()[:3] for line in lines if line.split()[1:2] in (["fits"], ["does"])] == \
        [["vision", "fits", "0.069"], ["language", "does", "NOT"]]


def test_refusal_names_the_figure_that_does_not_fit():
    """LoRA with a 2^30-parameter embedding (2^20 x 1024) planned on the CPU (fp32 weights): set-up, the weights plus
    one full-size fp32 draw of the embedding (4 GiB), is the larger peak. A rank with room for training but not for
    set-up is warned of, naming the set-up peak and its value; one with room for neither names the training peak (the
    training peak may use 92 % of a rank's memory, the set-up peak 95 %)."""
    cfg, lay = _cfg_lay(["--lora-rank", "4", "--hidden-size", "1024", "--vocab-size", str(2 ** 20)])
    rows = memory.plan(cfg, lay, cuda=False)
    lang = rows["language"]
    assert lang["setup"] == lang["weights"] + 4 * 2 ** 30
    peak, setup = max(r["peak"] for r in rows.values()), max(r["setup"] for r in rows.values())
    assert setup > peak and memory.required(rows) == setup / 0.95
    between = (peak / memory.TRAIN_SHARE + setup / 0.95) / 2
    said = []
    chooser.plan(cfg, 4, between, cuda=False, say=said.append)
    assert said[0].startswith(f"warning: this layout may not fit: hetero layout: vision 2 (tp1 x dp2) on [0,2) + "
                                   f"language 2 (tp1 x cp1 x dp2 x pp1; experts etp1 x ep2 x edp1) on [2,4) needs "
                                   f"{setup / memory.GIB:.1f} GiB per rank at its set-up peak (the weights and one "
                                   f"full-size fp32 draw), over the 95 % of the {between / memory.GIB:.1f} GiB a rank "
                                   "has that it may use. "), said
    assert f"{setup / memory.GIB:.1f}" == "12.0" and f"{between / memory.GIB:.1f}" == "10.9"   # embedding, head: 8 GiB
    small = 0.99 * peak / memory.TRAIN_SHARE   # no room for training either: the training peak is named
    assert memory.fits(rows, small) == (f"{peak / memory.GIB:.1f} GiB per rank at its training peak (weights, "
                                        "gradients, optimizer state, activations), over the 92 % of the "
                                        f"{small / memory.GIB:.1f} GiB a rank has that it may use")
    assert memory.fits(rows, setup / 0.95) is None
    said.clear()
    chooser.plan(cfg, 4, setup / 0.95, cuda=False, say=said.append)   # room for both: no warning
    assert said == []


def test_set_up_stays_under_the_training_peak_on_the_presets():
    """init.py's set-up (the weights, one fp32 draw) is below the training peak in the presets' layouts on 80 GB: nano
    on 8 ranks, nano LoRA with activation checkpointing on one rank (its largest parameter a layer's 128 experts of
    1856 x 2688, up or down: a 2.38 GiB draw; the fp32 init planned 126.2 GiB and refused it), super LoRA on 8."""
    cases = ((["--preset", "nano"], 8), (["--preset", "nano", "--lora-rank", "8", "--activation-checkpointing"], 1),
             (["--preset", "super", "--lora-rank", "8", "--global-batch", "64"], 8))
    for argv, world in cases:
        cfg = cli.config_of(argv)
        lay = chooser.plan(cfg, world, 80 * memory.GIB)
        rows = memory.plan(cfg, lay)
        assert all(r["setup"] < r["peak"] for r in rows.values()), (argv, rows)
        if world == 1:
            assert rows["language"]["setup"] == rows["language"]["weights"] + 4 * 128 * 1856 * 2688
            assert round(rows["language"]["setup"] / memory.GIB, 2) == 63.52


# ---------------------------------------------------------------- the tower's load from the data

def test_the_tower_load_bounds_every_sample_of_real_shaped_data(tmp_path):
    """memory.tower_load on bench/real_shaped.py's small form: the index counts each document's image placeholders and
    images as its samples hold them; unpacked, the largest document exactly; packed, a bound at or above every row
    of the first epochs (and below seq_len's worth of patches and class tokens); the mock: None (memory knows its
    image). The plan grows with it."""
    import data
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import real_shaped
    path = real_shaped.write(str(tmp_path), records=96, seed=3, small=True)
    argv = ["--preset", "tiny", "--seq-len", "256", "--data", path, "--overlong", "truncate"]

    def tower(s):   # tower tokens and rows of a sample's images
        p, K = 16, 2
        return (sum((i.shape[1] // p) * (i.shape[2] // p) + K for i in s.images),
                sum((i.shape[1] // p) * (i.shape[2] // p) // 4 for i in s.images))
    loads = {}
    for pack in (False, True):
        cfg = cli.config_of(argv + (["--pack"] if pack else []))
        ds, _ = data.build(cfg, data.load_tokenizer(None, cfg), verbose=False)
        idx = ds.sources[0][2]
        docs = [ds.load(0, d, True) for d in range(len(idx["offsets"]))]
        assert idx["image_tokens"].tolist() == [sum(t == cfg.image_token_id for t in ids) for ids, _, _ in docs]
        assert idx["images"].tolist() == [len(ims) for _, _, ims in docs]
        most = memory.tower_load(ds, cfg)
        seen = [tower(ds.sample(i)) for i in range(2 * len(ds))]
        if pack:
            assert all(t <= most[0] and r <= most[1] for t, r in seen)
            assert max(t for t, _ in seen) > 0.5 * most[0] and most[0] < 4 * 256 + 2 * max(idx["images"]) * 4
        else:
            assert (most[0], most[1]) == (max(t for t, _ in seen), max(r for _, r in seen))
        loads[pack] = most
        lay = layout.plan(cfg, 1)
        assert memory.vision_tokens(cfg, lay, most)[0] == most[0] and memory.vision_tokens(cfg, lay)[0] == 16 + 2
        assert memory.plan(cfg, lay, load=most)["vision"]["peak"] > memory.plan(cfg, lay)["vision"]["peak"]
    assert loads[True][0] > loads[False][0] and "packed" in loads[True][2]
    assert memory.tower_load(__import__("mock").MockData(cfg, 0), cfg) is None


def test_the_dry_run_plans_the_data_s_largest_sample(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import real_shaped
    path = real_shaped.write(str(tmp_path), records=64, seed=0, small=True)
    out = subprocess.run([sys.executable, "train.py", "--preset", "tiny", "--seq-len", "256", "--data", path, "--pack",
                          "--overlong", "truncate", "--dry-run", "--world-size", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert "densest seq_len of packed documents" in last["tower_load"] and path in last["tower_load"]
    assert "the tower: " in out.stdout and "the tower at " in out.stdout
    assert last["predicted_for"].startswith(f"--data {path}: 256 samples read, a sample ")   # cost.basis


def test_tiny_figures_are_not_printed_as_zero(capsys):
    """A tiny model's bytes and seconds (issue 53, friction 2: the dry run printed 0.00 everywhere): two significant
    digits where the fixed decimals would print 0."""
    assert [memory.figure(x) for x in (0, 71.3, 0.06, 0.0049, 0.00037)] == ["0.00", "71.30", "0.06", "0.0049",
                                                                              "0.00037"]
    assert memory.figure(0.04, 1) == "0.04" and memory.figure(0.25, 1) == "0.2"
    cfg, lay = _cfg_lay()
    memory.dry_run(cfg, lay, 80 * memory.GIB, cost.step_seconds(cfg, lay))
    out = capsys.readouterr().out
    weights = next(line for line in out.splitlines() if line.split()[:1] == ["language"]).split()[2]
    assert float(weights) > 0 and "predicted on Hopper GPUs (cost.py): 0.00 s" not in out, out


def test_a_layer_kind_the_plan_does_not_know_is_estimated():
    """Issue 54: a fork's new pattern character (here G, past config.check) is planned as the largest known kind's
    activations (tiny's: the MoE layer's) instead of a KeyError inside the plan before any run starts."""
    import dataclasses
    tiny = config.resolve("tiny")
    lay = layout.Layout(world=1, colocated=True, vision_tp=1, vision_dp=1, lm_tp=1, lm_dp=1, lm_ep=1, lm_etp=1,
                        micro_batch=1, global_batch=8)
    new = memory.plan(dataclasses.replace(tiny, hybrid_override_pattern="MEM*GM-E"), lay)["language"]
    moe = memory.plan(dataclasses.replace(tiny, hybrid_override_pattern="MEM*EM-E"), lay)["language"]
    assert new["activations"] == moe["activations"] == 1214464
