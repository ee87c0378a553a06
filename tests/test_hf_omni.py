"""HF VLM interop against transformers (CPU, fp32): a transformers-saved tiny nemotron_h_omni (sharded) imports,
runs equal to transformers, exports back to something transformers loads with equal logits; train.py --load of HF
directories; chat templates and image tokens as transformers' Omni processor writes them; a radio tower added to a
language-only import; bad directories named in one error."""
import base64
import json
import os
import re
import shutil
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import checkpoint
import comm
import data
import hf_interop
import model
import radio
import train
import vlm
from tests.spawn import run_distributed
from tests.test_hf import build_lm, full

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=512, hidden_size=64, hybrid_override_pattern="M*EM-E", num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
            conv_kernel=4, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, intermediate_size=40, routed_scaling_factor=2.5)
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2.0, patch_size=16,
              max_img_size=256, num_cls_tokens=2, num_registers=1, video_temporal_patch_size=2)
SPECIAL = ["<pad>", "</s>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<image>"]   # ids 256 .. 262
IMAGE_ID = 262
CONTENT = ("{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
           "{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}")
TEMPLATES = {   # the same ChatML rendering, with and without {% generation %} markers
    "spans": "{% for m in messages %}<|im_start|>{{ m.role }}\n" + CONTENT + "<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "markers": "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
               + CONTENT + "<|im_end|>\n{% endgeneration %}{% else %}" + CONTENT + "<|im_end|>\n{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
}


def make_tokenizer(path, template):
    """A byte-level BPE tokenizer with no merges (bytes are ids 0-255) and the Omni special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]   # GPT-2's byte -> character map, byte b at id b
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    tk = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", pad_token="<pad>",
                                               additional_special_tokens=SPECIAL[2:])
    tok.chat_template = template
    tok.save_pretrained(path)
    assert tok.convert_tokens_to_ids("<image>") == IMAGE_ID
    return tok


def tiny_omni(text_config, matter=("vision_model", "projector")):
    """A transformers Omni of `text_config` and VISION, its weights set so every part shows in the logits: the
    parameters whose names hold a `matter` string drawn larger (vision outputs, and what else a test needs)."""
    torch.manual_seed(0)
    hf = transformers.NemotronH_Omni_Reasoning_V3(transformers.NemotronH_Omni_Reasoning_V3_Config(
        text_config=text_config, vision_config=VISION, projector_hidden_size=128, vision_hidden_size=32,
        image_token_id=IMAGE_ID)).eval()
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith("dt_bias"):
                t.add_(3.0)                     # test_hf.build_lm: keep clear of HF's dt clamp
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape) * 0.1)
            elif any(m in name for m in matter) and t.is_floating_point() and "layer_scale" not in name:
                t.copy_(torch.randn(t.shape) * (0.3 if t.ndim > 1 else 1.0))
    return hf


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """(directory, transformers model): a tiny Omni saved by transformers in 100 KB shards, with a tokenizer."""
    d = tmp_path_factory.mktemp("omni")
    hf = tiny_omni(TEXT)
    hf.save_pretrained(d, max_shard_size="100KB")
    make_tokenizer(d, TEMPLATES["markers"])
    assert os.path.exists(d / hf_interop.INDEX_NAME)
    return d, hf


def image(h, w, seed):
    return torch.rand(3, h, w, generator=torch.Generator().manual_seed(seed))


def batch(cfg):
    """-> ids [2, L], samples (their images, as vlm.encode reads them). Sample 0: text, a 4x6-patch image, text, a
    6x4-patch image, text; sample 1: text only."""
    grids = [(4, 6), (6, 4)]
    imgs = [radio.normalize(image(16 * h, 16 * w, i)) for i, (h, w) in enumerate(grids)]
    g = torch.Generator().manual_seed(5)
    text = lambda n: torch.randint(0, 256, (n,), generator=g)   # noqa: E731
    run = lambda hw: torch.full((hw[0] * hw[1] // 4,), cfg.image_token_id)   # noqa: E731
    s0 = torch.cat([text(5), run(grids[0]), text(3), run(grids[1]), text(4)])
    s1 = text(len(s0))
    return torch.stack([s0, s1]), [types.SimpleNamespace(images=imgs), types.SimpleNamespace(images=[])]


@torch.no_grad()
def our_logits(cfg, sd, ids, samples):
    """The logits of training's forward (vlm.encode, vlm.inputs) with the weights sd."""
    vision, lm = radio.VisionModel(cfg).eval(), model.LanguageModel(cfg).eval()
    vision.load_state_dict({k[7:]: v for k, v in sd.items() if k.startswith("vision.")})
    lm.load_state_dict(checkpoint.language_state_dict(sd))
    return lm.logits(lm(vlm.inputs(lm, ids, ids, *vlm.encode(vision, samples, cfg), cfg)))


@torch.no_grad()
def hf_logits(hf, ids, samples):
    """transformers' logits of the same batch: its pixel input is the images' patches, packed, and their grids."""
    imgs = [im for s in samples for im in s.images]
    return hf(input_ids=ids, pixel_values=torch.cat([radio.patchify(im, 16) for im in imgs]),
              image_grid_hw=torch.tensor([(im.shape[1] // 16, im.shape[2] // 16) for im in imgs])).logits


def test_omni_import_equals_transformers_and_export_loads_back(omni, tmp_path, capsys):
    d, hf = omni
    cfg, sd = hf_interop.import_hf(d, preset="tiny")
    said = capsys.readouterr().out
    assert "video embedder" not in said and "RADIO summary_idxs (1 tensors)" in said
    assert (cfg.vit_hidden, cfg.vit_depth, cfg.vit_heads, cfg.vit_mlp, cfg.vit_cpe_grid, cfg.class_token_len,
            cfg.projector_hidden, cfg.image_token_id, cfg.video_temporal_patch) == (32, 2, 4, 64, 16, 3, 128,
                                                                                    IMAGE_ID, 2)
    assert torch.equal(sd["vision.video_embedder.weight"],        # a parameter now, as transformers holds it
                       hf.vision_model.embeddings.video_patch_projection.weight)
    # a rank's slice reads only its experts: equal to slicing the full stack (ep2 x etp2 here)
    src, name = hf_interop.HFSource(d, "tiny", say=lambda m: None), "language.backbone.layers.2.mixer.experts.up_proj"
    shards, sizes = [("ep", 0, None), ("etp", 1, None)], {"ep": 2, "etp": 2}
    for at in ({"ep": 0, "etp": 1}, {"ep": 1, "etp": 0}):
        assert torch.equal(src.read(name, shards=shards, coords=at, sizes=sizes),
                           comm.take_shard(sd[name], shards, at, sizes))
    ids, samples = batch(cfg)
    ours, theirs = our_logits(cfg, sd, ids, samples), hf_logits(hf, ids, samples)
    assert ours.std() > 0.05 and (ours - theirs).abs().max() < 1e-5
    # the images change the logits (so the match above covers the vision path and the placement)
    ids_text = ids.clone()
    ids_text[ids_text == IMAGE_ID] = 7
    assert (hf(input_ids=ids_text).logits - theirs)[0].abs().max() > 1e-2

    out = tmp_path / "export"
    hf_interop.export_hf(cfg, sd, out, max_shard_bytes=50_000)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "nemotron_h_omni" and written["vision_config"]["max_img_size"] == 256
    back, info = transformers.NemotronH_Omni_Reasoning_V3.from_pretrained(out, output_loading_info=True,
                                                                           dtype=torch.float32)
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["missing_keys"]
    assert (hf_logits(back.eval(), ids, samples) - ours).abs().max() < 1e-5
    cfg2, sd2 = hf_interop.import_hf(out, preset="tiny")       # and back again: the same tensors
    assert cfg2 == cfg and all(torch.equal(sd[k], sd2[k]) for k in sd) and sorted(sd) == sorted(sd2)


def test_eval_only_load_hf_omni_equals_transformers_loss(omni, tmp_path):
    d, hf = omni
    Image = pytest.importorskip("PIL.Image")
    (tmp_path / "img.png").write_bytes(b"")
    Image.fromarray((image(64, 96, 3) * 255).byte().permute(1, 2, 0).numpy()).save(tmp_path / "img.png")
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"},
                                                      {"type": "image", "image": "img.png"}]},
                         {"role": "assistant", "content": "a cat."}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    args = ["--eval-only", "--load", str(d), "--preset", "tiny", "--data", str(tmp_path / "chat.jsonl"),
            "--global-batch", "1", "--eval-samples", "1"]
    (result,) = run_distributed(lambda r, w: train.main(args)[0], 1)[0]
    cfg = hf_interop.HFSource(d, "tiny", say=lambda m: None).cfg
    enc = data.Encoder(data.load_tokenizer(str(d), cfg), cfg)
    ids, mask, images = enc.encode(chat, str(tmp_path), pixels=True)
    s = data.make_row([(ids, mask, images)], cfg, enc.sp["<pad>"], packed=False)
    logits = hf_logits(hf, s.input_ids[None], [s])[0]
    n = int((s.labels != -100).sum())
    ref = F.cross_entropy(logits, s.labels, ignore_index=-100, reduction="sum").item() / n
    assert result["eval_tokens"] == n and abs(result["eval_loss"] - ref) < 1e-4

    # fine-tune from the HF directory (its tokenizer by default), then export: transformers reads the tokenizer back
    save = str(tmp_path / "run")
    train_args = ["--load", str(d), "--preset", "tiny", "--data", str(tmp_path / "chat.jsonl"), "--global-batch",
                  "1", "--steps", "1", "--save", save]
    assert run_distributed(lambda r, w: train.main(train_args)[0][0]["ok"], 1) == [True]
    hf_interop.main(["export-hf", "--load", save, "--out", str(tmp_path / "out")])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert tok.get_vocab() == enc.tok.tok.get_vocab() and tok.chat_template == TEMPLATES["markers"]
    assert written["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    assert written["pad_token_id"] == tok.pad_token_id and written["bos_token_id"] is None

    # language-only: its config is the full export's text_config (the source's max_position_embeddings, not the
    # run's seq_len), without the Omni's processor files; transformers loads it whole
    hf_interop.main(["export-hf", "--load", save, "--out", str(tmp_path / "lm"), "--language-only"])
    lm_only = json.loads((tmp_path / "lm" / "config.json").read_text())
    assert lm_only == {**written, "architectures": ["NemotronHForCausalLM"]}
    assert lm_only["max_position_embeddings"] == json.loads((d / "config.json").read_text())["text_config"][
        "max_position_embeddings"] != 96
    assert not (tmp_path / "lm" / "processor_config.json").exists()
    lm, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lm", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # the classes docs/checkpoints.md §5 names: both generate, the same greedy text from the same language model
    vlm_model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    said = [m.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False) for m in (vlm_model, lm)]
    assert type(vlm_model).__name__ == "NemotronH_Omni_Reasoning_V3" and type(lm).__name__ == "NemotronHForCausalLM"
    assert said[0].shape[1] == prompt["input_ids"].shape[1] + 6 and torch.equal(said[0], said[1])


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_chat_template_tokens_and_masks(tmp_path, template):
    """Tokens as the Omni processor writes them (template, then each <image> -> <img> + <image> x N + </img>,
    then the tokenizer); loss on the assistant turn (by markers, or by its span) and nowhere else."""
    tok = make_tokenizer(tmp_path, TEMPLATES[template])
    cfg = hf_interop.config_from_hf({"model_type": "nemotron_h", **TEXT}, preset="tiny", image_token_id=IMAGE_ID)
    enc = data.Encoder(data.load_tokenizer(str(tmp_path), cfg), cfg)
    png = tmp_path / "a.png"
    from PIL import Image
    Image.fromarray((image(40, 70, 1) * 255).byte().permute(1, 2, 0).numpy()).save(png)
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    ids, mask, images = enc.encode({"messages": msgs}, str(tmp_path), pixels=True)
    (th, tw), = [(im.shape[1] // 16, im.shape[2] // 16) for im in images]
    assert (th, tw) == radio.grid_for(40, 70, 4 * (cfg.seq_len - (len(ids) - th * tw // 4)), cfg.min_num_patches)
    conv = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]} for m in msgs]
    text = tok.apply_chat_template(conv, tokenize=False)
    expected = tok(text.replace("<image>", "<img>" + "<image>" * (th * tw // 4) + "</img>"),
                   add_special_tokens=False)["input_ids"]
    assert ids == expected
    trained = bytes(t for t, m in zip(ids, mask) if m and t < 256).decode()
    assert trained == "red\n" and [t for t, m in zip(ids, mask) if m and t >= 256] == [tok.convert_tokens_to_ids(
        "<|im_end|>")]
    # OpenAI image_url parts (a data: URL here) give the same sample
    msgs[1]["content"][0] = {"type": "image_url", "image_url": {"url": url}}
    ids2, mask2, images2 = enc.encode({"messages": msgs}, str(tmp_path), pixels=True)
    assert ids2 == ids and mask2 == mask and torch.equal(images2[0], images[0])


def test_processor_parity(omni, tmp_path):
    """Against transformers' own NemotronH Omni processor (needs torchvision, absent on the CPU CI)."""
    pytest.importorskip("torchvision")
    d, _ = omni
    cfg = hf_interop.HFSource(d, "tiny", say=lambda m: None).cfg
    enc = data.Encoder(data.load_tokenizer(str(d), cfg), cfg)
    from PIL import Image
    Image.fromarray((image(40, 70, 1) * 255).byte().permute(1, 2, 0).numpy()).save(tmp_path / "a.png")
    msgs = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok"}]
    ids, _, images = enc.encode({"messages": msgs}, str(tmp_path), pixels=True)
    n_text = len(ids) - sum(im.shape[1] * im.shape[2] // 16 ** 2 // 4 for im in images)
    proc = transformers.NemotronH_Omni_Reasoning_V3Processor(
        image_processor=transformers.NemotronH_Omni_Reasoning_V3ImageProcessor(
            min_num_patches=cfg.min_num_patches, max_num_patches=cfg.max_num_patches,
            max_model_len=cfg.seq_len - n_text + 4), tokenizer=transformers.AutoTokenizer.from_pretrained(d),
        video_processor=transformers.NemotronH_Omni_Reasoning_V3VideoProcessor(),
        feature_extractor=transformers.ParakeetFeatureExtractor())
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok"}]
    text = proc.tokenizer.apply_chat_template(conv, tokenize=False)
    out = proc(images=[Image.open(tmp_path / "a.png")], text=text, return_tensors="pt")
    assert out["input_ids"][0].tolist() == ids
    torch.testing.assert_close(out["pixel_values"], radio.patchify(images[0], 16), atol=2e-2, rtol=0)


def test_language_only_import_any_vocab_and_train_load(tmp_path):
    cfg, lm = build_lm(hf_ready=True, vocab_size=300, image_token_id=299)
    hf_interop.export_hf(cfg, full(lm.state_dict()), tmp_path / "lm")
    path = tmp_path / "lm" / "config.json"
    hf = json.loads(path.read_text())
    del hf["image_token_id"]                     # as released nemotron_h configs: no image token
    path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="no image_token_id: pass --image-token-id N"):
        hf_interop.import_hf(tmp_path / "lm", preset="tiny")
    cfg2, sd = hf_interop.import_hf(tmp_path / "lm", preset="tiny", image_token_id=299)
    assert cfg2.vocab_size == 300 and cfg2.image_token_id == 299
    assert all(torch.equal(sd[k], v) for k, v in full(lm.state_dict()).items())
    # train.py --load of the HF directory: its model (shape overrides refused), a fresh run on mock data
    base = ["--load", str(tmp_path / "lm"), "--preset", "tiny", "--image-token-id", "299", "--steps", "1",
            "--global-batch", "2", "--mock-image-size", "32"]
    history, vocab = run_distributed(lambda r, w: (lambda h, m: (h, m["language"].lm_head.weight.shape[0]))(
        *train.main(base)), 1)[0]
    assert history[0]["ok"] and 0 < history[0]["loss"] < 10 and vocab == 300
    with pytest.raises(RuntimeError, match="is an HF directory: the model's shape comes from its config.json; "
                                           "drop --hidden-size"):
        run_distributed(lambda r, w: train.main(base + ["--hidden-size", "96"]), 1)


def test_vision_hf_adds_a_radio_tower(tmp_path):
    torch.manual_seed(1)
    tower = transformers.RadioModel(transformers.RadioConfig(**VISION)).eval()
    with torch.no_grad():
        for name, t in tower.named_parameters():
            if "layer_scale" not in name:
                t.copy_(torch.randn(t.shape) * 0.3)
    tower.save_pretrained(tmp_path / "radio")
    cfg, lm = build_lm()
    hf_interop.export_hf(cfg, full(lm.state_dict()), tmp_path / "lm")
    released = {**json.loads((tmp_path / "lm" / "config.json").read_text()), "max_position_embeddings": 4096}
    (tmp_path / "lm" / "config.json").write_text(json.dumps(released))
    cfg2, sd = hf_interop.import_hf(tmp_path / "lm", preset="tiny", vision_hf=tmp_path / "radio")
    assert cfg2.projector_hidden == 16 * 32 and sd["vision.mlp1.1.weight"].std() > 0
    vision = radio.VisionModel(cfg2).eval()
    vision.load_state_dict({k[7:]: v for k, v in sd.items() if k.startswith("vision.")})
    grids = [(4, 6), (2, 2)]
    patches = [radio.patchify(radio.normalize(image(16 * h, 16 * w, i)), 16) for i, (h, w) in enumerate(grids)]
    tower.make_preprocessor_external()   # as the Omni model does: inputs come CLIP-normalised
    with torch.no_grad():
        ours = vision.features(patches, grids)
        theirs = tower(torch.cat(patches), image_grid_hw=torch.tensor(grids)).features
    assert ours.std() > 0.1 and (ours - theirs.reshape(ours.shape)).abs().max() < 1e-4
    # exported, the nemotron_h source's config is the Omni's text_config (its context, not the run's seq_len)
    hf_interop.copy_source(tmp_path / "lm", tmp_path / "source")
    hf_interop.export_hf(cfg2, sd, tmp_path / "omni", source=tmp_path / "source")
    text = json.loads((tmp_path / "omni" / "config.json").read_text())["text_config"]
    assert text["max_position_embeddings"] == 4096 != cfg2.seq_len and "architectures" not in text


def test_bad_directories_are_named(omni, tmp_path):
    d, _ = omni
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    hf = json.loads((bad / "config.json").read_text())
    for change, match in [(dict(model_type="llama"), "model_type 'llama', expected 'nemotron_h_omni'"),
                          (dict(downsample_ratio=0.25), "downsample_ratio=0.25"),
                          (dict(vision_config={**hf["vision_config"], "norm_mean": [0.5, 0.5, 0.5]}),
                           r"vision_config\.norm_mean=\[0\.5, 0\.5, 0\.5\]"),
                          (dict(text_config={**hf["text_config"], "mtp_layers_block_type": ["moe", "conv"]}),
                           r"text_config\.MTP pattern 'E\?'"),
                          (dict(vision_hidden_size=64), "vision_hidden_size=64")]:
        (bad / "config.json").write_text(json.dumps({**hf, **change}))
        with pytest.raises(ValueError, match=match) as e:
            hf_interop.import_hf(bad, preset="tiny")
        assert str(bad / "config.json") in str(e.value)
    (bad / "config.json").write_text(json.dumps(hf))
    index = json.loads((bad / hf_interop.INDEX_NAME).read_text())
    shard = sorted(set(index["weight_map"].values()))[3]
    os.remove(bad / shard)
    with pytest.raises(FileNotFoundError, match=f"{shard}: missing"):
        hf_interop.import_hf(bad, preset="tiny")
    shutil.copy(d / shard, bad / shard)
    key = "vision_model.radio_model.model.blocks.0.layer_scale1.lambda1"
    t = load_file(bad / index["weight_map"][key])
    t[key] = torch.full((32,), 0.5)
    save_file(t, bad / index["weight_map"][key])
    with pytest.raises(ValueError, match="layer_scale1.lambda1 is not all ones"):
        hf_interop.import_hf(bad, preset="tiny")


def test_broken_hf_directory_is_one_line_from_train(omni, tmp_path):
    """--load of an HF directory whose index names a missing shard, or whose config.json sizes are not its weights':
    one line naming the file, not a traceback (train.py's cli prints it as `error: ...`, exit 2)."""
    d, _ = omni
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    index = json.loads((bad / hf_interop.INDEX_NAME).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(bad / shard)
    with pytest.raises(SystemExit) as e:
        train.main(["--load", str(bad), "--preset", "tiny", "--steps", "1"])
    assert str(e.value) == f"{bad / shard}: missing (named in {hf_interop.INDEX_NAME}). Check --load (a save " \
                           "directory or DIR/step_N of a run of this model)"
    shutil.copy(d / shard, bad / shard)
    hf = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**hf, "text_config": {**hf["text_config"], "hidden_size": 96}}))
    with pytest.raises(SystemExit) as e:
        train.main(["--load", str(bad), "--preset", "tiny", "--steps", "1"])
    msg = str(e.value)
    assert "\n" not in msg and re.match(r"\d+ checkpoint error\(s\): \S+: tensor \S+ has shape \[", msg) and \
        re.search(r"; and \d+ more\. Check --load", msg), msg
