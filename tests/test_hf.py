"""Full-tensor checkpoints (save_model / load_model) and HF nemotron_h export/import: round trips, file layout,
errors, and logits parity with transformers' NemotronHForCausalLM (CPU, fp32); a pipeline run's checkpoint exported,
and an HF directory loaded into pipeline stages. Sharded training checkpoints: test_checkpoint.py."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint
import config
import hf_interop
import layout
import model
import parallel
import radio
import train
from tests.spawn import run_distributed
from tests.test_failsafe import warm_imports  # noqa: F401 (an autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny ('MEM*EM-E': Mamba, MoE, attention, dense MLP) and a variant with wider routing (top-6 of 16),
# MQA (one KV head) and one SSM group, so the MoE path and head grouping are exercised beyond top-2 of 8.
VARIANTS = {
    "tiny": {},
    "moe16": dict(hybrid_override_pattern="ME*EM-E", n_routed_experts=16, num_experts_per_tok=6,
                  num_key_value_heads=1, n_groups=1, routed_scaling_factor=1.7),
    "latent": dict(moe_latent_size=24),   # LatentMoE: routed experts 24 wide in a 64-wide model
}


def build_lm(seed=0, hf_ready=False, **overrides):
    cfg = config.resolve("tiny", overrides)
    lm = model.LanguageModel(cfg)
    model.init_weights(lm, seed, {}, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in lm.named_buffers():   # a nonzero expert bias, large enough to change the top-k choice
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
        for name, p in lm.named_parameters():   # LatentMoE at init: two small projections would hide the experts
            if "latent_proj" in name:
                p.mul_(20.0)
        if hf_ready:
            # HF 5.x's torch Mamba path clamps dt at time_step_min (its time_step_limit is (time_step_min, inf));
            # ours, like the CUDA kernels and Megatron, does not clamp. Our init puts softplus(dt_bias) at 1e-3
            # and up, so with in_proj's contribution some dt fall below 1e-3. Shifting dt_bias by +3 keeps every
            # softplus(dt) far above 1e-3, so both implementations compute the same thing.
            for name, p in lm.named_parameters():
                if name.endswith("dt_bias"):
                    p.add_(3.0)
    return cfg, lm.eval()


def random_ids(cfg, seed=0, shape=(2, 37)):    # 37: not a multiple of chunk_size, exercises SSD padding
    return torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def our_logits(lm, ids):
    return lm.logits(lm(lm.embed(ids)))


def full(lm_state_dict):
    return {"language." + k: v for k, v in lm_state_dict.items()}


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------- our format

def test_save_load_model_full_names(tmp_path):
    cfg, lm = build_lm()
    sd = {"language." + k: v for k, v in lm.state_dict().items()}
    assert any(k.endswith("e_score_correction_bias") for k in sd)          # persistent buffer: saved
    assert not any(k.endswith("tokens_per_expert") for k in sd)            # non-persistent counter: not saved
    sd["vision.blocks.0.weight"] = torch.randn(3, 4)                       # a VLM checkpoint holds more than the LM
    checkpoint.save_model(tmp_path, cfg, sd)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == [
        "model.language.tp0.safetensors", "model.vision.tp0.safetensors"]
    cfg2, sd2 = checkpoint.load_model(tmp_path)
    assert cfg2 == cfg
    assert_same_tensors(sd, sd2)
    with pytest.raises(ValueError, match=r"backbone\.embeddings\.weight: checkpoint names start with 'vision.'"):
        checkpoint.save_model(tmp_path / "bare", cfg, lm.state_dict())
    lm_sd = checkpoint.language_state_dict(sd2)
    assert sorted(lm_sd) == sorted(lm.state_dict())
    lm2 = model.LanguageModel(cfg2)
    lm2.load_state_dict(lm_sd)
    assert torch.equal(lm2.backbone.layers["1"].mixer.experts.up_proj, lm.backbone.layers["1"].mixer.experts.up_proj)


def _load_errors(rank, world, cases):
    """What checkpoint.load (train.py --load) raises for each (checkpoint, Config of the run's model), or None."""
    out = []
    for path, cfg in cases:
        par = parallel.setup(layout.plan(cfg, 1), cfg)
        try:
            checkpoint.load(path, par, {"language": model.LanguageModel(cfg)}, cfg=cfg)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append(None)
    return out


def test_errors_name_file_and_tensor(tmp_path):
    cfg, lm = build_lm()
    with pytest.raises(FileNotFoundError, match="nowhere/meta.json: missing"):
        checkpoint.load_model(tmp_path / "nowhere")
    sd = full(lm.state_dict())
    checkpoint.save_model(tmp_path / "good", cfg, sd)
    checkpoint.save_model(tmp_path / "short", cfg, {k: v for k, v in sd.items() if k != "language.lm_head.weight"})
    checkpoint.save_model(tmp_path / "extra", cfg, {**sd, "language.backbone.bogus": torch.zeros(2)})
    wider = config.resolve("tiny", {"hidden_size": 96})
    (errors,) = run_distributed(_load_errors, 1, [(tmp_path / d, c) for d, c in (
        ("good", cfg), ("good", wider), ("short", cfg), ("extra", cfg))])
    assert errors == [
        None,
        f"{tmp_path}/good/config.json: config mismatch: hidden_size is 64 in the checkpoint, 96 in this run",
        f"{tmp_path}/short/meta.json: missing tensor language.lm_head.weight",
        f"{tmp_path}/extra/meta.json: unexpected tensors ['language.backbone.bogus'] (not in this run's model)"]


# ---------------------------------------------------------------- HF export / import round trip

@pytest.mark.parametrize("max_shard_bytes", [hf_interop.DEFAULT_SHARD_BYTES, 40_000])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_export_import_round_trip(tmp_path, variant, max_shard_bytes):
    cfg, lm = build_lm(**VARIANTS[variant])
    sd = lm.state_dict()
    hf_interop.export_hf(cfg, full(sd), tmp_path, max_shard_bytes=max_shard_bytes)
    files = sorted(os.listdir(tmp_path))
    hf_keys = {}
    if max_shard_bytes == hf_interop.DEFAULT_SHARD_BYTES:
        assert files == ["config.json", "generation_config.json", "model.safetensors"]
        hf_keys = load_file(tmp_path / "model.safetensors")
    else:
        shards = [f for f in files if f.startswith("model-")]
        assert len(shards) > 2 and "model.safetensors" not in files
        assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        for f in shards:
            part = load_file(tmp_path / f)
            assert all(index["weight_map"][k] == f for k in part)
            hf_keys.update(part)
        assert sorted(index["weight_map"]) == sorted(hf_keys)
        assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in hf_keys.values())
    # original HF names: one tensor per expert, [F, D] up / [D, F] down, fp32 expert bias
    E, F_, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_latent_size or cfg.hidden_size
    moe_layer = cfg.hybrid_override_pattern.index("E")
    stacked = lm.backbone.layers[str(moe_layer)].mixer.experts
    for j in range(E):
        up = hf_keys[f"backbone.layers.{moe_layer}.mixer.experts.{j}.up_proj.weight"]
        down = hf_keys[f"backbone.layers.{moe_layer}.mixer.experts.{j}.down_proj.weight"]
        assert up.shape == (F_, D) and down.shape == (D, F_)
        assert torch.equal(up, stacked.up_proj[j].detach()) and torch.equal(down, stacked.down_proj[j].detach())
    bias = hf_keys[f"backbone.layers.{moe_layer}.mixer.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0
    assert not any(".experts.up_proj" in k or "tokens_per_expert" in k for k in hf_keys)
    n_expert_keys = 2 * E * cfg.hybrid_override_pattern.count("E")
    assert len(hf_keys) == len(sd) - 2 * cfg.hybrid_override_pattern.count("E") + n_expert_keys
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["model_type"] == "nemotron_h" and hf_cfg["architectures"] == ["NemotronHForCausalLM"]
    assert hf_cfg["num_hidden_layers"] == len(cfg.hybrid_override_pattern)
    assert hf_cfg["initializer_range"] == cfg.init_std and hf_cfg["layer_norm_epsilon"] == cfg.norm_eps
    assert hf_cfg["time_step_min"] == 0.001 and hf_cfg["dtype"] == hf_cfg["torch_dtype"] == "float32"
    # the byte tokenizer's ids (tiny: <s> 509, </s> 508, <|im_end|> 506, <pad> 510), not HF's defaults 1 / 2 / 0
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (509, [508, 506], 510)

    cfg2, sd2 = hf_interop.import_hf(tmp_path, image_token_id=cfg.image_token_id)
    assert_same_tensors(full(sd), sd2)
    for field in config.LANGUAGE_FIELDS:
        assert getattr(cfg2, field) == getattr(cfg, field), field


def test_export_dtype_keeps_expert_bias_fp32(tmp_path):
    cfg, lm = build_lm()
    hf_interop.export_hf(cfg, full(lm.state_dict()), tmp_path, dtype=torch.bfloat16)
    t = load_file(tmp_path / "model.safetensors")
    assert t["backbone.embeddings.weight"].dtype == torch.bfloat16
    assert t["backbone.layers.1.mixer.gate.e_score_correction_bias"].dtype == torch.float32
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"   # transformers 5's name, and older readers'
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoConfig.from_pretrained(tmp_path).dtype == torch.bfloat16


def test_import_strictness(tmp_path):
    cfg, lm = build_lm()
    hf_interop.export_hf(cfg, full(lm.state_dict()), tmp_path)
    path = tmp_path / "model.safetensors"
    t = load_file(path)
    t["mtp.layers.0.mixer.q_proj.weight"] = torch.zeros(2, 2)   # an MTP block its config does not announce
    save_file(t, path)
    with pytest.raises(ValueError, match=r"unexpected tensor mtp\.layers\.0\.mixer\.q_proj\.weight"):
        hf_interop.import_hf(tmp_path)
    del t["mtp.layers.0.mixer.q_proj.weight"]
    t["backbone.layers.0.mixer.bogus"] = torch.zeros(2)
    save_file(t, path)
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor backbone\.layers\.0\.mixer\.bogus"):
        hf_interop.import_hf(tmp_path)
    del t["backbone.layers.0.mixer.bogus"], t["backbone.layers.4.mixer.experts.5.down_proj.weight"]
    save_file(t, path)
    with pytest.raises(ValueError, match=r"missing tensor backbone\.layers\.4\.mixer\.experts\.5\.down_proj\.weight"):
        hf_interop.import_hf(tmp_path)
    t["backbone.layers.4.mixer.experts.5.down_proj.weight"] = torch.zeros(3, 3)
    save_file(t, path)
    with pytest.raises(ValueError, match=r"experts\.5\.down_proj\.weight has shape \[3, 3\], expected \[64, 32\]"):
        hf_interop.import_hf(tmp_path)

    hf = json.loads((tmp_path / "config.json").read_text())
    for bad, match in [(dict(n_group=2), "n_group=2"), (dict(mamba_proj_bias=True), "mamba_proj_bias=True"),
                       (dict(hybrid_override_pattern="MGM*EM-E"), "only M \\* E -"),
                       (dict(time_step_limit=[0.001, 0.1]), "time_step_limit"),
                       (dict(tie_word_embeddings=True), "tie_word_embeddings")]:
        with pytest.raises(ValueError, match=match):
            hf_interop.config_from_hf({**hf, **bad})


# ---------------------------------------------------------------- transformers parity

@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.slow
def test_transformers_loads_export_with_same_logits(tmp_path, variant, attn):
    transformers = pytest.importorskip("transformers")
    cfg, lm = build_lm(hf_ready=True, **VARIANTS[variant])
    hf_interop.export_hf(cfg, full(lm.state_dict()), tmp_path, max_shard_bytes=100_000)   # sharded: HF reads the index
    hf, info = transformers.NemotronHForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, dtype=torch.float32, attn_implementation=attn)
    assert all(len(v) == 0 for v in info.values()), info
    hf.eval()
    ids = random_ids(cfg)
    ours = our_logits(lm, ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape == (2, 37, cfg.vocab_size)
    assert ours.std() > 0.05                                     # logits are not trivially small
    assert (ours - theirs).abs().max() < 1e-5                    # measured ~2e-7 in fp32
    # the expert bias moves the choice (so the match above proves it is exported and used the same way)
    with torch.no_grad():
        for layer in lm.backbone.layers.values():
            if layer.kind == "E":
                layer.mixer.gate.e_score_correction_bias.zero_()
    assert (our_logits(lm, ids) - theirs).abs().max() > 1e-3


@pytest.mark.parametrize("latent", [None, 24], ids=["moe", "latent-moe"])
@pytest.mark.slow
def test_import_of_transformers_save_pretrained(tmp_path, latent):
    """latent-moe: LatentMoE (Nemotron 3 Super's moe_latent_size), the routed experts 24 wide in a 64-wide model."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.NemotronHConfig(
        vocab_size=512, hidden_size=64, hybrid_override_pattern="M*EM-E", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
        conv_kernel=4, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, intermediate_size=40, routed_scaling_factor=2.5,
        moe_latent_size=latent)
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith("dt_bias"):
                t.add_(3.0)                                      # see build_lm: avoid HF's dt clamp
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape) * 0.1)
    hf.save_pretrained(tmp_path)
    # transformers 5.x writes the original names back (backbone., per-expert tensors) and the layer list
    # `layers_block_type` instead of `hybrid_override_pattern`
    written = load_file(tmp_path / "model.safetensors")
    assert "backbone.layers.2.mixer.experts.7.up_proj.weight" in written
    assert ("backbone.layers.2.mixer.fc1_latent_proj.weight" in written) == (latent is not None)
    assert "hybrid_override_pattern" not in json.loads((tmp_path / "config.json").read_text())

    cfg, sd = hf_interop.import_hf(tmp_path, image_token_id=511)
    sd = checkpoint.language_state_dict(sd)
    assert cfg.hybrid_override_pattern == "M*EM-E" and cfg.moe_shared_expert_intermediate_size == 48
    assert cfg.init_std == 0.02 and cfg.intermediate_size == 40 and cfg.moe_latent_size == latent
    lm = model.LanguageModel(cfg)
    lm.load_state_dict(sd)
    lm.eval()
    ids = random_ids(cfg, seed=1)
    with torch.no_grad():
        theirs = hf(ids).logits
    ours = our_logits(lm, ids)
    assert ours.std() > 0.05
    assert (ours - theirs).abs().max() < 1e-5


# ---------------------------------------------------------------- CLI

@pytest.mark.slow
def test_cli_export_then_import(tmp_path):
    cfg, lm = build_lm()
    vision = radio.VisionModel(cfg)
    sd = {**full(lm.state_dict()), **{"vision." + k: v for k, v in vision.state_dict().items()}}
    checkpoint.save_model(tmp_path / "ckpt", cfg, sd)
    run = lambda *a: subprocess.run([sys.executable, "hf_interop.py", *a], cwd=ROOT, capture_output=True, text=True)
    out = run("export-hf", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--max-shard-bytes", "50000")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "nemotron_h_omni"
    out = run("import-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"), "--preset", "tiny")
    assert out.returncode == 0, out.stderr
    assert f"`torchrun --nproc_per_node=8 train.py --load {tmp_path / 'back'} --finetune --data YOUR_DATA.jsonl " \
        "--save YOUR_RUN_DIR --steps 1000 --save-every 200`" in out.stdout
    assert "LayerScale (all ones: identity) (4 tensors)" in out.stdout
    cfg2, sd2 = checkpoint.load_model(tmp_path / "back")
    assert_same_tensors(sd, sd2)
    assert cfg2 == cfg
    run("export-hf", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "lm"), "--language-only")
    assert json.loads((tmp_path / "lm" / "config.json").read_text())["model_type"] == "nemotron_h"
    # a user error is one line, no traceback, exit status 2
    out = run("import-hf", "--hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nowhere' / 'config.json'}: missing: {tmp_path / 'nowhere'} is not an HF model directory"]


# ---------------------------------------------------------------- pipeline stages

PP2 = ["--preset", "tiny", "--global-batch", "2", "--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"]   # 3 ranks


def _trained(rank, world, argv):
    """train.main in a gloo child -> {full name: tensor} of this rank's modules (its stage's part) after it."""
    _, modules = train.main(list(argv))
    return {f"{k}.{n}": t.detach().clone() for k, m in modules.items() for n, t in m.state_dict().items()}


def _loaded(rank, world, argv):
    """train.main in a gloo child -> {full name: tensor} of this rank's modules right after checkpoint.load."""
    real, seen = checkpoint.load, {}

    def load(path, par, modules, *args, **kwargs):
        counters = real(path, par, modules, *args, **kwargs)
        seen.update({f"{k}.{n}": t.detach().clone() for k, m in modules.items() for n, t in m.state_dict().items()})
        return counters
    checkpoint.load = load   # this forked child only
    try:
        train.main(list(argv))
    finally:
        checkpoint.load = real
    return seen


def whole(ranks):
    """The whole model's {full name: tensor} from each rank's part (tp 1: no tensor on two ranks)."""
    out = {}
    for state in ranks:
        assert not set(state) & set(out), "two ranks hold one tensor"
        out.update(state)
    return out


def assert_same_dirs(a, b):
    """Two HF directories with the same files: equal JSON, equal tensors (names, dtypes, values)."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for f in os.listdir(a):
        if f.endswith(".safetensors"):
            assert_same_tensors(load_file(a / f), load_file(b / f))
        elif f.endswith(".json"):
            assert json.loads((a / f).read_text()) == json.loads((b / f).read_text()), f


@pytest.mark.slow
def test_pipeline_checkpoint_exports_and_hf_loads_into_stages(tmp_path):
    """export-hf of a hetero pp2 checkpoint (each stage's files apart) equals the export of the same weights saved
    without stages; --load of the HF directory into a pp2 run fills each stage with the HF tensors of its layers."""
    save = tmp_path / "ckpt"
    ranks = run_distributed(_trained, 3, PP2 + ["--steps", "1", "--save", str(save)])
    checkpoint.save_model(tmp_path / "flat", checkpoint.saved_config(str(save)), whole(ranks))
    for src, out in ((save, "hf"), (tmp_path / "flat", "hf-flat")):
        hf_interop.main(["export-hf", "--load", str(src), "--out", str(tmp_path / out)])
    assert_same_dirs(tmp_path / "hf", tmp_path / "hf-flat")

    loaded = run_distributed(_loaded, 3, PP2 + ["--load", str(tmp_path / "hf"), "--steps", "1"])
    assert "language.backbone.embeddings.weight" in loaded[1] and "language.lm_head.weight" in loaded[2]
    _, sd = hf_interop.import_hf(tmp_path / "hf", preset="tiny", say=lambda m: None)
    assert_same_tensors(whole(loaded), sd)
