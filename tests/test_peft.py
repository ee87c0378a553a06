"""hf_peft.py against PEFT (CPU, fp32): random nonzero adapters on every target kind of the tiny Omni of
test_hf_omni.py, written as a PEFT adapter directory, loaded by `PeftModel.from_pretrained` on the base
transformers model, compute the merged export's logits (nemotron_h_omni with images, and nemotron_h). A pipeline
run's adapters export as the same weights without stages do."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import hf_interop
import hf_peft
import lora
import model
import radio
from tests.spawn import run_distributed
from tests.test_hf import PP2, _trained, assert_same_dirs, warm_imports, whole  # noqa: F401 (an autouse fixture)
from tests.test_hf_omni import batch, hf_logits, omni   # noqa: F401  (omni: the fixture)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# the defaults plus every vision Linear (RADIO's fused qkv included), the projector and the LM head
EVERY = lora.TARGETS[:-2] + r"|attn\.(qkv|proj)|mlp\.fc(1|2)|mlp1\.(1|3)|embedder|lm_head)$"


def with_adapters(cfg, sd, targets, rank=4, alpha=8.0, seed=0):
    """(cfg with LoRA, sd + adapters named and shaped as lora.apply makes them, A and B random and nonzero)."""
    cfg = dataclasses.replace(cfg, lora_rank=rank, lora_alpha=alpha, lora_targets=targets)
    with torch.device("meta"):
        modules = {"vision": radio.VisionModel(cfg), "language": model.LanguageModel(cfg)}
        lora.apply(modules, cfg)
    g, out = torch.Generator().manual_seed(seed), dict(sd)
    for key, module in modules.items():
        for name, p in module.named_parameters():
            if "lora_" in name:   # A: lora.py's init; B: as after training, small against W
                std = p.shape[-1] ** -0.5 if name.endswith("A") else 0.02
                out[f"{key}.{name}"] = torch.randn(p.shape, generator=g) * std
    return cfg, out


def load_peft(cls, base_dir, peft_dir):
    base = cls.from_pretrained(base_dir, dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    written = load_file(peft_dir / hf_peft.WEIGHTS_NAME)   # every tensor written is one PEFT loaded
    loaded = peft.get_peft_model_state_dict(adapted, save_embedding_layers=False)   # lm_head: its adapter only
    assert sorted(written) == sorted(loaded) and all(torch.equal(written[k], loaded[k]) for k in written)
    return adapted


@pytest.fixture(scope="module")
def imported(omni):   # noqa: F811
    d, _ = omni
    return (d, *hf_interop.import_hf(d, preset="tiny", say=lambda m: None))


@pytest.mark.slow
def test_omni_adapters_equal_merged_export(imported, tmp_path):
    d, cfg, sd = imported
    cfg, sd = with_adapters(cfg, sd, EVERY)
    hf_interop.export_hf(cfg, lora.merge(sd, cfg.lora_alpha), tmp_path / "merged")
    hf_peft.save_peft(sd, cfg, tmp_path / "peft", hf_interop.OMNI_LM, base_model=str(d))
    written = json.loads((tmp_path / "peft" / hf_peft.CONFIG_NAME).read_text())
    assert written["target_parameters"] == [f"language_model.model.layers.{i}.mixer.experts.{p}_proj"
                                            for i in (2, 5) for p in ("down", "up")]
    assert {"vision_model.encoder.layer.1.attention.v_proj", "multi_modal_projector.linear_2",
            "vision_model.embeddings.patch_projection", "language_model.lm_head"} < set(written["target_modules"])
    cls = transformers.NemotronH_Omni_Reasoning_V3
    ids, samples = batch(cfg)
    merged = hf_logits(cls.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval(), ids, samples)
    adapted = hf_logits(load_peft(cls, d, tmp_path / "peft"), ids, samples)
    base = hf_logits(cls.from_pretrained(d, dtype=torch.float32).eval(), ids, samples)
    assert (adapted - merged).abs().max() < 1e-5
    assert (adapted - base).abs().max() > 1e-3   # the adapters act


def test_language_only_adapters_equal_merged_export(imported, tmp_path):
    """The language-only export (nemotron_h) drops the vision adapters, as the merged one drops the tower. PEFT
    refuses Mamba out_proj adapters on a nemotron_h model: so does save_peft, naming the layers."""
    _, cfg, base_sd = imported
    with pytest.raises(ValueError, match=r"PEFT refuses LoRA on a nemotron_h model's Mamba out_proj .*N in 0, 3\): "
                                         "export the whole VLM"):
        hf_peft.save_peft(with_adapters(cfg, base_sd, EVERY)[1], cfg, tmp_path / "refused", "")
    cfg, sd = with_adapters(cfg, base_sd, EVERY.replace("|out_proj", ""), seed=1)
    lm = lambda s: {k: v for k, v in s.items() if k.startswith("language.")}   # noqa: E731
    hf_interop.export_hf(cfg, lm(base_sd), tmp_path / "base")
    hf_interop.export_hf(cfg, lora.merge(lm(sd), cfg.lora_alpha), tmp_path / "merged")
    hf_peft.save_peft(sd, cfg, tmp_path / "peft", "")
    assert not any("vision" in k or "projector" in k for k in load_file(tmp_path / "peft" / hf_peft.WEIGHTS_NAME))
    cls = transformers.NemotronHForCausalLM
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = cls.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()(input_ids=ids).logits
        adapted = load_peft(cls, tmp_path / "base", tmp_path / "peft")(input_ids=ids).logits
        base = cls.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()(input_ids=ids).logits
    assert (adapted - merged).abs().max() < 1e-5
    assert (adapted - base).abs().max() > 1e-3


def test_no_adapters_refused(imported, tmp_path):
    _, cfg, sd = imported
    with pytest.raises(ValueError, match=r"^the checkpoint has no LoRA adapters \(--lora-rank 0\): export the full "
                                         r"model with export-hf without --adapters-only$"):
        hf_peft.save_peft(sd, cfg, tmp_path, hf_interop.OMNI_LM)
    _, with_vision = with_adapters(cfg, sd, r"mlp1\.(1|3)$")
    with pytest.raises(ValueError, match="no LoRA adapters in the language model"):
        hf_peft.save_peft(with_vision, cfg, tmp_path, "")


@pytest.mark.slow
def test_pipeline_adapters_export_as_without_stages(tmp_path):
    """The adapters of a LoRA run on hetero pp2 (each stage's in its own files) export as the same weights saved
    without stages do, merged and as a PEFT directory."""
    save = tmp_path / "ckpt"
    ranks = run_distributed(_trained, 3, PP2 + ["--lora-rank", "4", "--steps", "1", "--save", str(save)])
    sd = whole(ranks)
    assert any(k.endswith("lora_B") and v.abs().max() > 0 for k, v in sd.items())   # trained: B left zero
    checkpoint.save_model(tmp_path / "flat", checkpoint.saved_config(str(save)), sd)
    for flags, out in (([], "merged"), (["--adapters-only"], "peft")):
        for src in (save, tmp_path / "flat"):
            hf_interop.main(["export-hf", "--load", str(src), "--out", str(tmp_path / out / src.name), *flags])
        assert_same_dirs(tmp_path / out / "ckpt", tmp_path / out / "flat")
    assert any(".layers.0." in k for k in load_file(tmp_path / "peft" / "ckpt" / hf_peft.WEIGHTS_NAME)) and \
        any(".layers.7." in k for k in load_file(tmp_path / "peft" / "ckpt" / hf_peft.WEIGHTS_NAME))
