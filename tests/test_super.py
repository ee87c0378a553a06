"""The Nemotron 3 Super family (docs/super.md): LatentMoE and MTP in a tiny transformers-saved 3.5-Super-VL-shaped
Omni (equal logits, MTP weights through import and export), the MTP loss against a hand transcription of the
formula (depths 1 and 2, shared and unshared blocks, packed documents), MTP training in parallel layouts == one
process, and the super preset's parameter count against transformers'."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import config
import hf_interop
import model
import train
from tests.spawn import run_distributed
from tests.test_hf_omni import TEXT, batch, hf_logits, our_logits, tiny_omni
from tests.test_run import ENV, ROOT
from tests.test_train import _train

transformers = pytest.importorskip("transformers")
SUPER_TEXT = dict(TEXT, moe_latent_size=24, num_nextn_predict_layers=1)   # LatentMoE, one MTP block ('*E')


@pytest.fixture(scope="module")
def super_vl(tmp_path_factory):
    """(directory, transformers model): a tiny Omni whose language model has LatentMoE and an MTP block, so its tower
    has the final LayerNorm 3.5 Super VL has (transformers saves no MTP weights)."""
    d = tmp_path_factory.mktemp("super_vl")
    hf = tiny_omni(SUPER_TEXT, ("vision_model", "projector", "latent_proj", "final_layernorm"))
    hf.save_pretrained(d)
    return d, hf


@pytest.mark.slow
def test_latent_moe_and_mtp_omni_equal_transformers_and_keep_mtp_weights(super_vl, tmp_path):
    d, hf = super_vl
    said = []
    cfg, sd = hf_interop.import_hf(d, preset="tiny", say=said.append)
    assert (cfg.moe_latent_size, cfg.num_nextn_predict_layers, cfg.mtp_pattern) == (24, 1, "*E")
    assert any("no MTP weights" in s for s in said)                      # transformers saves none: fresh ones
    assert sd["vision.final_layernorm.weight"].std() > 0.1               # the Super-VL tower norm, imported
    ids, samples = batch(cfg)
    ours, theirs = our_logits(cfg, sd, ids, samples), hf_logits(hf, ids, samples)
    assert ours.std() > 0.05 and (ours - theirs).abs().max() < 1e-5
    # export: transformers loads it whole (it ignores language_model.mtp.*), the same logits; MTP weights written
    # under their published names and back bit for bit
    hf_interop.copy_source(str(d), str(tmp_path / "source"))   # what a run keeps of the HF directory it came from
    hf_interop.export_hf(cfg, sd, tmp_path / "out", source=str(tmp_path / "source"))
    back, info = transformers.NemotronH_Omni_Reasoning_V3.from_pretrained(tmp_path / "out", output_loading_info=True,
                                                                          dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (hf_logits(back.eval(), ids, samples) - ours).abs().max() < 1e-5
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert {"language_model.mtp.layers.0.eh_proj.weight", "language_model.mtp.layers.1.final_layernorm.weight",
            "language_model.mtp.layers.1.mixer.experts.7.up_proj.weight",
            "vision_projector.vision_final_layernorm.bias"} <= set(written)
    assert written["language_model.mtp.layers.0.eh_proj.weight"].shape == (64, 128)
    cfg2, sd2 = hf_interop.import_hf(tmp_path / "out", preset="tiny", say=said.append)
    assert cfg2 == cfg and sorted(sd2) == sorted(sd) and all(torch.equal(sd[k], sd2[k]) for k in sd)
    text = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert (text["num_nextn_predict_layers"], text["mtp_layers_block_type"], text["moe_latent_size"]) == \
        (1, ["full_attention", "moe"], 24)


def _reference_mtp(lm, cfg, h_in, hidden, labels, seq_idx, depths):
    """MTP by hand (docs/super.md §3-4), position by position where it can be: depth k embeds token i + k, chains
    the previous depth's output, runs block (k - 1) mod n, and scores token i + k + 1 within the document."""
    B, L, _ = h_in.shape
    P, out = len(cfg.mtp_pattern), []
    for k in range(1, depths + 1):
        layers = lm.mtp.layers[((k - 1) % cfg.num_nextn_predict_layers) * P:][:P]
        e = torch.zeros_like(h_in)
        e[:, :L - k] = h_in[:, k:]                                           # the token k ahead (zeros past the end)
        x = torch.cat([layers[0].enorm(e), layers[0].hnorm(hidden)], -1) @ layers[0].eh_proj.weight.T
        for layer in layers:
            x = layer(x, seq_idx)
        hidden = layers[-1].final_layernorm(x)
        logp = F.log_softmax(hidden @ lm.lm_head.weight.T, -1)
        total = 0.0
        for b in range(B):
            for i in range(L - k):
                same_doc = seq_idx is None or seq_idx[b, i] == seq_idx[b, i + k]
                if same_doc and labels[b, i + k] != -100:
                    total = total - logp[b, i, labels[b, i + k]]
        out.append(total)
    return out


@pytest.mark.parametrize("blocks,depths", [(1, 1), (1, 2), (2, 2)], ids=["depth1", "shared", "unshared"])
def test_mtp_losses_match_the_formula(blocks, depths):
    cfg = config.resolve("tiny", dict(moe_latent_size=16, num_nextn_predict_layers=blocks, mtp_depths=depths))
    torch.manual_seed(0)
    lm = model.LanguageModel(cfg)
    model.init_weights(lm, 3, {}, cfg)
    ids = torch.randint(0, 256, (2, 20))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[0, 3:6] = -100                                    # a prompt / image span: no targets there
    seq_idx = torch.tensor([[0] * 8 + [1] * 12, [0] * 20])   # row 0 packs two documents
    labels[0, 7] = -100                                      # a document's last token predicts nothing
    with torch.no_grad():
        h_in = lm.embed(ids)
        hidden = lm(h_in, seq_idx)
        got = lm.mtp_losses(hidden, h_in, labels, seq_idx)
        want = _reference_mtp(lm, cfg, h_in, hidden, labels, seq_idx, depths)
    assert len(got) == depths
    for g, w in zip(got, want):
        assert abs(g.item() - w.item()) < 1e-4 * abs(w.item())
    if depths == 2:   # the second depth runs the first block again (shared) or the second (unshared)
        assert (blocks == 1) == torch.equal(lm.mtp.layers[0].eh_proj.weight,
                                            lm.mtp.layers[(blocks - 1) * 2].eh_proj.weight)
    # the counts a step weights each depth by are the targets the formula scores
    n = [int(model.mtp_labels(labels, seq_idx, k).ne(-100).sum()) for k in range(1, depths + 1)]
    assert n[0] == sum(1 for b in range(2) for i in range(19) if seq_idx[b, i] == seq_idx[b, i + 1]
                       and labels[b, i + 1] != -100)


MTP = ["--preset", "tiny", "--steps", "3", "--global-batch", "4", "--lr", "1e-3", "--lr-schedule", "constant",
       "--stage", "3", "--moe-latent-size", "16", "--num-nextn-predict-layers", "1", "--mtp-depths", "2"]


@pytest.mark.parametrize("world,flags", [(4, ["--vision-dp", "2", "--lm-dp", "2"]),
                                         (4, ["--colocated", "--lm-tp", "2", "--lm-ep", "2"]),
                                         (4, ["--colocated", "--lm-cp", "2", "--lm-ep", "2"])],
                         ids=["hetero", "colocated-tp2-ep2", "colocated-cp2-ep2"])
@pytest.mark.slow
def test_mtp_training_equals_one_process(world, flags):
    """Two MTP depths sharing one block, LatentMoE: per-step loss, MTP losses and the trained weights of a parallel
    layout equal one process (fp32)."""
    (one,) = run_distributed(_train, 1, MTP)
    many = run_distributed(_train, world, MTP + flags, timeout=120.0)
    ref_hist, ref_w, _ = one
    assert all(len(h["mtp_loss"]) == 2 for h in ref_hist) and ref_hist[-1]["loss"] < ref_hist[0]["loss"]
    for hist, weights, _ in many:
        for a, b in zip(hist, ref_hist):
            if a["loss"] is not None:   # vision-only ranks report none
                assert abs(a["loss"] - b["loss"]) < 1e-5 * b["loss"]
                assert all(abs(x - y) < 1e-5 * y for x, y in zip(a["mtp_loss"], b["mtp_loss"]))
        for k, v in weights.items():   # as test_train's layouts: fp32 reduction order, through three AdamW steps
            assert (v - ref_w[k]).abs().max() < 1e-5, k


@pytest.mark.slow
def test_super_preset_counts_equal_transformers():
    """--preset super --dry-run: the language model's parameters equal transformers' NemotronH built from the same
    config on the meta device; the MTP block apart (transformers builds none); the totals the model card rounds
    (120.7 B + 2.9 B MTP, docs/super.md §1) and 12.8 B active."""
    out = subprocess.run([sys.executable, "train.py", "--preset", "super", "--dry-run", "--world-size", "64",
                          "--global-batch", "64"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = config.resolve("super")
    text = {k: v for k, v in hf_interop.hf_config(cfg).items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**text))
    assert res["params_language"] == sum(p.numel() for p in hf.parameters()) == 120_668_687_360
    assert res["params_mtp"] == 2_942_324_736
    assert res["params_active"] - res["params_vision"] == 12_770_216_960
    assert res["fits"] == {"vision": True, "language": True}


def test_fine_tune_from_the_super_vl_directory(super_vl):
    """train.py --load of the directory: its MTP block (fresh, as the directory holds none) trains one depth."""
    d, _ = super_vl
    (hist,) = run_distributed(lambda r, w: train.main(["--load", str(d), "--preset", "tiny", "--steps", "2",
                                                        "--global-batch", "2", "--mock-image-size", "32"])[0], 1)
    assert [len(h["mtp_loss"]) for h in hist] == [1, 1] and all(0 < h["mtp_loss"][0] < 10 for h in hist)


def test_language_only_export_keeps_mtp_weights(tmp_path):
    """nemotron_h (no tower): LatentMoE and MTP weights out under their published names and back bit for bit."""
    cfg = config.resolve("tiny", dict(moe_latent_size=16, num_nextn_predict_layers=1))
    lm = model.LanguageModel(cfg)
    model.init_weights(lm, 5, {}, cfg)
    sd = {"language." + k: v for k, v in lm.state_dict().items()}
    hf_interop.export_hf(cfg, sd, tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.1.mixer.fc2_latent_proj.weight",
            "mtp.layers.1.mixer.experts.3.down_proj.weight"} <= set(written)
    cfg2, sd2 = hf_interop.import_hf(tmp_path, preset="tiny", image_token_id=cfg.image_token_id)
    assert all(getattr(cfg2, k) == getattr(cfg, k) for k in config.MODEL_FIELDS)
    assert sorted(sd2) == sorted(sd) and all(torch.equal(sd[k], sd2[k]) for k in sd)
