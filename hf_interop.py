"""HF interop (docs/checkpoints.md §5, §6): checkpoints (any layout) <-> transformers directories, both ways.

  nemotron_h_omni  the whole VLM, as released: `language_model.` + the LM's names, `vision_model.radio_model.model.`
                   + RADIO's timm names (radio.hf_name), `mlp1.{0,1,3}` projector
  nemotron_h       the language model alone;  radio  a vision tower alone (`radio_model.model.` + timm names)
LM names are ours (docs/decoder.md §3), except that HF stores routed experts one tensor per expert
(`mixer.experts.{j}.up_proj.weight` [F, D]) where we stack them for grouped GEMM (`mixer.experts.up_proj`).
CLI:  python hf_interop.py export-hf --load CKPT --out HF_DIR [--language-only] [--overwrite]
      python hf_interop.py import-hf --hf HF_DIR --out CKPT [--preset P] [--image-token-id N] [--vision-hf RADIO_DIR]
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile

import torch
from safetensors import safe_open

import checkpoint
import comm
import config
import data
import hf_peft
import lora
import model
import radio

WEIGHTS_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9      # HF's classic default shard size

# Config fields: config.LANGUAGE_FIELDS are what HF's config carries, under the same names except these two.
HF_RENAMED = {"layer_norm_epsilon": "norm_eps", "initializer_range": "init_std"}
HF_SAME = tuple(f for f in config.LANGUAGE_FIELDS if f not in HF_RENAMED.values() and f != "mtp_pattern")
# HF switches whose value is baked into our model; import refuses any other value (absent = HF default = this).
HF_FIXED = dict(use_conv_bias=True, mamba_proj_bias=False, use_bias=False, attention_bias=False, mlp_bias=False,
                n_shared_experts=1, mlp_hidden_act="relu2", mamba_hidden_act="silu", n_group=1, topk_group=1,
                norm_topk_prob=True, residual_in_fp32=False, tie_word_embeddings=False, sliding_window=None)
# Written for completeness (Nano's values, docs/decoder.md §1), not read back. time_step_* only drive HF's init.
# Caveat: HF's torch Mamba path clamps dt at time_step_min; ours, the CUDA kernels and Megatron do not.
HF_INFO = dict(time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, expand=2, mamba_ssm_cache_dtype="float32",
               attention_dropout=0.0, hidden_dropout=0.0, num_logits_to_keep=1, use_mamba_kernels=True,
               rescale_prenorm_residual=True)
HF_LAYER_TYPES = {f["hf"]: kind for kind, f in config.LAYER_KINDS.items() if "hf" in f}   # transformers 5.x
STACKED_KEY = re.compile(r"^(.+\.mixer\.experts)\.(up_proj|down_proj)$")                 # ours

# RADIO switches baked into radio.py (absent = HF default = this), and what an Omni config must say.
RADIO_FIXED = dict(hidden_act="gelu", use_swiglu_ffn=False, qkv_bias=True, layer_norm_eps=1e-6, num_channels=3,
                   drop_path_rate=0.0)
OMNI_LM, OMNI_VISION, RADIO_ROOT = "language_model.", "vision_model.", "radio_model.model."
# Weights of released checkpoints this model does not use: skipped on import, with one line naming them.
UNUSED = {"RADIO summary_idxs": r"summary_idxs$",
          "RADIO input conditioner": r"input_conditioner\.", "sound encoder / projection": r"^sound_",
          "LayerScale (all ones: identity)": r"\.(layer_scale[12]\.lambda1|ls[12]\.gamma)$"}
LAYER_SCALE = re.compile(UNUSED["LayerScale (all ones: identity)"])
# ... of which an export carries these through unchanged from the HF directory a run started from (copy_source)
CARRIED = ("RADIO summary_idxs", "RADIO input conditioner", "sound encoder / projection")
CARRIED_NAME = "carried.safetensors"
WEIGHT_FILES = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)$|\.index\.json$")
SHARD_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")   # ours


# ---------------------------------------------------------------- configs

def read_config(hf_dir):
    path = os.path.join(hf_dir, checkpoint.CONFIG_NAME)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing: {hf_dir} is not an HF model directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def is_hf_dir(path):
    """An HF directory (config.json with an HF model_type), not one of our checkpoints (which may hold one too)."""
    return os.path.isfile(os.path.join(path, checkpoint.CONFIG_NAME)) and not checkpoint.is_checkpoint(path) and \
        "model_type" in read_config(path)


def config_from_hf(hf, source="config.json", preset=None, image_token_id=None, radio_hf=None):
    """An HF config.json (nemotron_h_omni, or nemotron_h plus an optional radio config) -> our Config, fields HF does
    not carry from `preset` (default nano). Anything this model does not implement is refused by name."""
    kind = hf.get("model_type", "nemotron_h")
    if kind == "nemotron_h_omni":
        text = hf.get("text_config", hf.get("llm_config"))
        if not isinstance(text, dict):
            raise ValueError(f"{source}: nemotron_h_omni without a text_config")
        over, errors = _language_fields(text, f"{source}: text_config.", preset)
        vision, errs = _vision_fields(hf.get("vision_config") or {}, "vision_config.")
        over.update(vision)
        errors += errs
        if hf.get("downsample_ratio", 0.5) != 0.5:
            errors.append(f"downsample_ratio={hf['downsample_ratio']} (this model implements the 2x2 shuffle, 0.5)")
        width = hf.get("vision_hidden_size", hf.get("vit_hidden_size", 1280))
        if width != vision["vit_hidden"]:
            errors.append(f"vision_hidden_size={width}: the projector input must be 4 x the vision width "
                          f"{vision['vit_hidden']}")
        over["projector_hidden"] = hf.get("projector_hidden_size", 4096)
        # transformers' Omni always has the video embedder: vision_config's size must equal this one (default 2)
        over["video_temporal_patch"] = hf.get("video_temporal_patch_size", 2)
        if vision["video_temporal_patch"] not in (0, over["video_temporal_patch"]):
            errors.append(f"vision_config.video_temporal_patch_size={vision['video_temporal_patch']} but "
                          f"video_temporal_patch_size={over['video_temporal_patch']}")
        token = hf.get("image_token_id", hf.get("img_context_token_id"))
    elif kind == "nemotron_h":
        over, errors = _language_fields(hf, f"{source}: ", preset)
        token = hf.get("image_token_id")
        if radio_hf is not None:
            vision, errs = _vision_fields(radio_hf, "vision config ")
            over.update(vision, projector_hidden=16 * vision["vit_hidden"])   # VIT_VARIANTS' convention
            errors += errs
    else:
        raise ValueError(f"{source}: model_type {kind!r}, expected 'nemotron_h_omni' or 'nemotron_h'")
    if token is not None and image_token_id is not None and token != image_token_id:
        errors.append(f"image_token_id={token}, but --image-token-id {image_token_id} was given")
    over["image_token_id"] = token if token is not None else image_token_id
    if over["image_token_id"] is None:
        errors.append("no image_token_id: pass --image-token-id N (the id of <image> in your tokenizer)")
    if errors:
        raise ValueError(f"{source}: unsupported: " + "; ".join(errors))
    return config.resolve(preset or "nano", over)


def _language_fields(hf, where, preset):
    errors = [f"{where}{k}={hf[k]!r} (this model implements {v!r})" for k, v in HF_FIXED.items()
              if k in hf and hf[k] != v]
    # HF writes infinity as {"__float__": "Infinity"}
    lo, hi = (float(x["__float__"] if isinstance(x, dict) else x) for x in hf.get("time_step_limit", (0, math.inf)))
    if lo > 0 or hi != math.inf:   # a dt clamp our model does not apply
        errors.append(f"{where}time_step_limit=[{lo}, {hi}] (this model implements [0, inf])")
    if "layers_block_type" in hf:  # transformers 5.x writes this list instead of the pattern string
        pattern = "".join(HF_LAYER_TYPES.get(t, "?") for t in hf["layers_block_type"])
    else:
        pattern = hf.get("hybrid_override_pattern", config.resolve(preset or "nano").hybrid_override_pattern)
    mtp = hf.get("mtp_hybrid_override_pattern") or "".join(   # the MTP block's layers, as string or list
        HF_LAYER_TYPES.get(t, "?") for t in hf.get("mtp_layers_block_type") or ["full_attention", "moe"])
    for what, p, field in (("layer", pattern, "layers_block_type"), ("MTP", mtp, "mtp_layers_block_type")):
        if set(p) - set(config.LAYER_KINDS):
            errors.append(f"{where}{what} pattern {p!r} ({field} {hf.get(field)}): only {' '.join(config.LAYER_KINDS)}")
    if "num_hidden_layers" in hf and hf["num_hidden_layers"] != len(pattern):
        errors.append(f"{where}num_hidden_layers={hf['num_hidden_layers']} but the pattern has {len(pattern)} layers")
    over = {k: config.base_type(k)(hf[k]) for k in HF_SAME if hf.get(k) is not None and k != "hybrid_override_pattern"}
    over.update({ours: config.base_type(ours)(hf[h]) for h, ours in HF_RENAMED.items() if h in hf})
    over["hybrid_override_pattern"], over["mtp_pattern"] = pattern, mtp
    return over, errors


def _vision_fields(vc, where):
    errors = [f"{where}{k}={vc[k]!r} (this model implements {v!r})" for k, v in RADIO_FIXED.items()
              if k in vc and vc[k] != v]
    for key, clip in (("norm_mean", radio.CLIP_MEAN), ("norm_std", radio.CLIP_STD)):
        if key in vc and any(abs(a - b) > 1e-6 for a, b in zip(vc[key], clip)):
            errors.append(f"{where}{key}={vc[key]} (this model normalises with CLIP's {list(clip)})")
    C, p, side = vc.get("hidden_size", 1280), vc.get("patch_size", 16), vc.get("max_img_size", 2048)
    if side % p:
        errors.append(f"{where}max_img_size={side} is not a multiple of patch_size {p}")
    return dict(vit_hidden=C, vit_depth=vc.get("num_hidden_layers", 32), vit_heads=vc.get("num_attention_heads", 16),
                vit_mlp=round(C * vc.get("mlp_ratio", 4.0)), vit_patch=p, vit_cpe_grid=side // p,
                class_token_len=vc.get("num_cls_tokens", 3) + vc.get("num_registers", 7),
                video_temporal_patch=vc.get("video_temporal_patch_size") or 0), errors


def dtype_keys(dtype):
    """The weights' dtype under both its names: transformers 5 (and 4.56 on) reads and writes `dtype`; transformers
    before 4.56, and serving stacks built on it (older vLLM), read only `torch_dtype`. Transformers 5 reads a file
    with both without its deprecation warning, and keeps `dtype`."""
    return {"dtype": dtype, "torch_dtype": dtype}


def hf_config(cfg, dtype="bfloat16", token_ids=None):
    """Our Config -> an HF nemotron_h config.json (the language model)."""
    hf = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", **dtype_keys(dtype),
          "num_hidden_layers": len(cfg.hybrid_override_pattern), "max_position_embeddings": cfg.seq_len,
          "image_token_id": cfg.image_token_id,
          "mtp_layers_block_type": [t for k in cfg.mtp_pattern for t, c in HF_LAYER_TYPES.items() if c == k]}
    hf.update({k: getattr(cfg, k) for k in HF_SAME}, **HF_FIXED, **HF_INFO, **(token_ids or {}))
    hf.update({h: getattr(cfg, ours) for h, ours in HF_RENAMED.items()})
    return dict(sorted(hf.items()))


def summary_idxs(cfg):
    """RADIO's summary tokens (not used by the VLM; written so transformers finds them): its default, [0, 1]."""
    return list(range(min(cfg.class_token_len, 2)))


def omni_config(cfg, dtype="bfloat16", token_ids=None):
    """Our Config -> an HF nemotron_h_omni config.json. RADIO's class tokens and registers, one learned block to
    both, are written as up to 3 class tokens + registers (C-RADIO's split). A tower without a video embedder says
    transformers' default of 2 frames (its Omni always has one)."""
    cls, video_t = min(cfg.class_token_len, 3), cfg.video_temporal_patch or 2
    vision = {"model_type": "radio", "hidden_size": cfg.vit_hidden, "num_hidden_layers": cfg.vit_depth,
              "num_attention_heads": cfg.vit_heads, "mlp_ratio": cfg.vit_mlp / cfg.vit_hidden,
              "patch_size": cfg.vit_patch, "max_img_size": cfg.vit_cpe_grid * cfg.vit_patch, "num_cls_tokens": cls,
              "num_registers": cfg.class_token_len - cls, "norm_mean": list(radio.CLIP_MEAN),
              "norm_std": list(radio.CLIP_STD), "video_temporal_patch_size": video_t, "summary_idxs": summary_idxs(cfg),
              **RADIO_FIXED}
    text = {k: v for k, v in hf_config(cfg, dtype, token_ids).items() if k not in ("architectures",)}
    return {"architectures": ["NemotronH_Omni_Reasoning_V3"], "model_type": "nemotron_h_omni",
            **dtype_keys(dtype), "text_config": text, "vision_config": dict(sorted(vision.items())),
            "downsample_ratio": 0.5, "projector_hidden_size": cfg.projector_hidden,
            "vision_hidden_size": cfg.vit_hidden, "image_token_id": cfg.image_token_id,
            "video_temporal_patch_size": video_t}


# ---------------------------------------------------------------- HF export

def export_hf(cfg, state_dict, out_dir, max_shard_bytes=DEFAULT_SHARD_BYTES, dtype=None, tokenizer=None,
              source=None):
    """Write an HF directory, nemotron_h_omni when `state_dict` (full names) holds the vision tower, else nemotron_h.
    dtype casts the floating tensors but the expert bias (fp32 in HF: _keep_in_fp32_modules_strict). `source`
    (copy_source's): its files and carried tensors come along, its config's fields where ours say nothing."""
    lm_sd = checkpoint.language_state_dict(state_dict)
    checkpoint.check_tensors(lm_sd, meta_shapes(model.LanguageModel, cfg), "export_hf(state_dict)")
    cast = lambda v: v.detach().cpu().to(dtype) if dtype is not None and v.is_floating_point() else v.detach().cpu()
    tensors = {}
    for k, v in lm_sd.items():
        v = v.detach().cpu().float() if k.endswith("e_score_correction_bias") else cast(v)
        m = STACKED_KEY.match(k)
        if m:   # views; each shard copies its own slice at write time
            tensors.update({f"{m[1]}.{j}.{m[2]}.weight": w for j, w in enumerate(v.unbind(0))})
        else:
            tensors[k] = v
    vision = {k[len("vision."):]: v for k, v in state_dict.items() if k.startswith("vision.")}
    tok = tokenizer or data.load_tokenizer(None, cfg)
    sp = tok.special
    eos = list(dict.fromkeys([sp["</s>"]] + ([sp["<|im_end|>"]] if "<|im_end|>" in sp else [])))
    ids = dict(bos_token_id=sp.get("<s>"), eos_token_id=eos[0] if len(eos) == 1 else eos, pad_token_id=sp["<pad>"])
    saved = checkpoint.dtype_name(tensors["backbone.embeddings.weight"])
    if vision:
        checkpoint.check_tensors(vision, meta_shapes(radio.VisionModel, cfg), "export_hf(state_dict) vision.")
        tensors = {OMNI_LM + k: v for k, v in tensors.items()}
        tensors.update({radio.hf_name(k): cast(v) for k, v in vision.items()})
        tensors[OMNI_VISION + "radio_model.summary_idxs"] = torch.tensor(summary_idxs(cfg))
        tensors.update({f"{OMNI_VISION}{RADIO_ROOT}blocks.{i}.layer_scale{j}.lambda1": cast(torch.ones(cfg.vit_hidden))
                        for i in range(cfg.vit_depth) for j in (1, 2)})   # HF's RADIO has LayerScale: identity
        hf = omni_config(cfg, saved, ids)
    else:
        hf = hf_config(cfg, saved, ids)
    os.makedirs(out_dir, exist_ok=True)
    generation = {k: v for k, v in ids.items() if v is not None}
    if source is not None:
        theirs = read_config(source)
        if theirs.get("model_type") == hf["model_type"]:
            hf = _merge_config(theirs, hf)
            with safe_open(os.path.join(source, CARRIED_NAME), framework="pt") as f:
                # a checkpoint written before the video embedder trained carries it too: ours wins
                tensors.update({k: cast(f.get_tensor(k)) for k in f.keys() if k not in tensors})
        else:   # a language-only export of an Omni, or a tower added to a nemotron_h: their language models merge
            lm = _merge_config(_language_config(theirs), _language_config(hf))
            hf = {**hf, "text_config": lm} if "text_config" in hf else {**hf, **lm}
        # an Omni's processor configs and remote code do not describe its language model alone
        files = [] if theirs.get("model_type") == "nemotron_h_omni" != hf["model_type"] else os.listdir(source)
        for name in files:   # processor configs, chat template, remote code, generation config
            if name not in (checkpoint.CONFIG_NAME, CARRIED_NAME):
                shutil.copy2(os.path.join(source, name), os.path.join(out_dir, name))
    checkpoint.write_atomic(os.path.join(out_dir, checkpoint.CONFIG_NAME), hf)
    if not os.path.exists(os.path.join(out_dir, "generation_config.json")):
        checkpoint.write_atomic(os.path.join(out_dir, "generation_config.json"), generation)
    _write_shards(tensors, out_dir, max_shard_bytes)
    if hasattr(tok, "save"):
        tok.save(out_dir)


# Fields an export keeps from the source: max_position_embeddings is the context it was released for (what serving
# stacks read), where a run's seq_len is only what it trained on
SOURCE_WINS = ("max_position_embeddings",)


def _language_config(hf):
    """An HF config's language model: an Omni's text_config, or a nemotron_h config but the fields that name its
    model class (an Omni's text_config has none)."""
    if hf.get("model_type") == "nemotron_h_omni":
        return hf.get("text_config", hf.get("llm_config")) or {}
    return {k: v for k, v in hf.items() if k not in ("architectures", "auto_map")}


def _merge_config(theirs, ours):
    """The source's config.json with our fields written over it (nested configs alike), but SOURCE_WINS. RADIO's
    class tokens and registers keep the source's split of the same total."""
    out = dict(theirs)
    for k, v in ours.items():
        if k in SOURCE_WINS and k in theirs:
            continue
        out[k] = _merge_config(theirs[k], v) if isinstance(v, dict) and isinstance(theirs.get(k), dict) else v
    split = ("num_cls_tokens", "num_registers")
    if all(k in theirs for k in split) and all(k in ours for k in split) and \
            sum(theirs[k] for k in split) == sum(ours[k] for k in split):
        out.update({k: theirs[k] for k in split}, summary_idxs=theirs.get("summary_idxs", ours.get("summary_idxs")))
    return out


def copy_source(src, out):
    """What an export carries through from the HF directory `src` a run started from (or a checkpoint's copy of it)
    into `out`: every file but the weights, and in CARRIED_NAME the tensors this model does not use (CARRIED)."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        path, dst = os.path.join(src, name), os.path.join(out, name)
        if os.path.isfile(path) and (name == CARRIED_NAME or not WEIGHT_FILES.search(name)):
            if os.path.exists(dst):
                os.remove(dst)
            try:   # a checkpoint's copy is never written in place: the next checkpoint may share its files
                os.link(path, dst)
            except OSError:
                shutil.copy2(path, dst)
    if not os.path.exists(os.path.join(src, CARRIED_NAME)):   # an HF directory: its carried tensors
        files = _tensor_files(src)
        keys = [k for k in files if any(re.search(UNUSED[what], k) for what in CARRIED)]
        with contextlib.closing(checkpoint.Files()) as opened:   # each file once, for all its carried tensors
            checkpoint.write_atomic(os.path.join(out, CARRIED_NAME), {k: opened.get(files[k][0], k) for k in keys})


def meta_shapes(module, cfg, prefix=""):
    """{prefix + name: shape} of module(cfg)'s state dict, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return {prefix + k: tuple(v.shape) for k, v in module(cfg).state_dict().items()}


def _write_shards(tensors, out_dir, max_shard_bytes):
    """Greedy in key order. One shard -> model.safetensors; more -> model-0000k-of-0000n + index."""
    shards, size, total = [[]], 0, 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
        total += n
    names = [WEIGHTS_NAME] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for keys, name in zip(shards, names):   # clone: unbound expert views share storage, safetensors refuses that
        checkpoint.write_atomic(os.path.join(out_dir, name), {k: tensors[k].clone() for k in keys})
    if len(shards) > 1:
        weight_map = {k: name for keys, name in zip(shards, names) for k in keys}
        checkpoint.write_atomic(os.path.join(out_dir, INDEX_NAME),
                                {"metadata": {"total_size": total}, "weight_map": weight_map})


# ---------------------------------------------------------------- HF import

class HFSource:
    """An HF directory (nemotron_h_omni, or nemotron_h plus an optional `radio` directory) read as a checkpoint of
    our model (.cfg, .tensors, read(name), close() at a load's end: checkpoint.Files), one tensor in memory at a
    time, so train.py --load HF_DIR and import-hf share it. Names, shapes and files are checked when opened; weights
    this model does not use are skipped."""

    def __init__(self, hf_dir, preset=None, image_token_id=None, vision_hf=None, seed=0, say=print):
        hf, self.dir = read_config(hf_dir), hf_dir
        source = os.path.join(hf_dir, checkpoint.CONFIG_NAME)
        self.omni = omni = hf.get("model_type") == "nemotron_h_omni"
        if vision_hf is not None and omni:
            raise ValueError(f"--vision-hf: {source} is a nemotron_h_omni directory: it has its own vision tower")
        radio_hf = read_config(vision_hf) if vision_hf is not None else None
        if radio_hf is not None and radio_hf.get("model_type") != "radio":
            raise ValueError(f"{vision_hf}/config.json: model_type {radio_hf.get('model_type')!r}, expected 'radio'")
        self.cfg = config_from_hf(hf, source, preset, image_token_id, radio_hf)
        files = _tensor_files(hf_dir)
        tower_files = files if omni else _tensor_files(vision_hf) if vision_hf is not None else None
        if self.cfg.video_temporal_patch and tower_files is not None and \
                _vision_hf_name("vision.video_embedder.weight", omni) not in tower_files:
            # our export of a tower without one: transformers' config must still name a size (docs/vision.md §11)
            self.cfg = dataclasses.replace(self.cfg, video_temporal_patch=0)
        self.where, self.fresh, self.files, errors, skipped = {}, {}, checkpoint.Files(), [], {}
        lm_root = OMNI_LM if omni else ""
        shapes = meta_shapes(model.LanguageModel, self.cfg, "language.")
        vision = meta_shapes(radio.VisionModel, self.cfg, "vision.")
        # MTP blocks a directory announces but does not hold (transformers' save_pretrained drops them) start fresh
        no_mtp = self.cfg.num_nextn_predict_layers and not any(k.startswith(lm_root + "mtp.") for k in files)
        errors += self._map(files, {k: v for k, v in shapes.items() if not (no_mtp and ".mtp." in k)},
                            lambda k: lm_root + k[len("language."):], skipped)
        if tower_files is not None:   # --vision-hf: the tower from RADIO_DIR, a fresh projector (below)
            tower = {k: v for k, v in vision.items()   # a radio directory has neither projector nor MTP's final norm
                     if omni or not k.startswith(("vision.mlp1.", "vision.final_layernorm."))}
            errors += self._map(tower_files, tower, lambda k: _vision_hf_name(k, omni), skipped)
            shapes.update(vision)
        self.close()   # _map read LayerScale tensors: no file stays open until the load
        for k in set(shapes) - set(self.where):   # drawn when read, as a fresh model draws them (comm.draw): the
            name = k.split(".", 1)[1]             # LLaVA-style start's projector (--stage 1 trains it), MTP blocks
            self.fresh[k] = (name, seed + radio.SEED, shapes[k], radio.rule(name, self.cfg.vit_hidden)) \
                if k.startswith("vision.") else (name, seed + model.SEED, shapes[k], model.rule(name, self.cfg))
        if no_mtp:
            say(f"{hf_dir}: no MTP weights (its config announces {self.cfg.num_nextn_predict_layers} block(s)): the "
                "MTP blocks start from their initial values")
        checkpoint.raise_errors(errors)
        self.tensors = {k: {"shape": list(shapes[k]), "dtype": "?", "optim": False} for k in shapes}
        self.meta = {"step": 0, "layout": None, "ranks": 0, "counters": dict(checkpoint.FRESH)}
        if skipped:
            say(f"{hf_dir}: skipped weights this model does not use: "
                + ", ".join(f"{what} ({n} tensors)" for what, n in skipped.items()))

    def _map(self, files, shapes, hf_name, skipped):
        """Find every expected tensor (ours: full name -> shape) among `files` ({HF key: (file, shape)})."""
        errors, used = [], set()
        for name, shape in shapes.items():
            key, m = hf_name(name), STACKED_KEY.match(name)
            if m and key not in files:   # HF's original format: one tensor per expert
                hf_key = STACKED_KEY.match(key)
                keys = [f"{hf_key[1]}.{j}.{hf_key[2]}.weight" for j in range(shape[0])]
                want = tuple(shape[1:])
            else:
                keys, want = [key], tuple(shape)
            for k in keys:
                if k not in files:
                    errors.append(f"{self.dir}: missing tensor {k} ({name})")
                elif tuple(files[k][1]) != want:
                    errors.append(f"{files[k][0]}: tensor {k} has shape {list(files[k][1])}, expected {list(want)}")
            used.update(keys)
            self.where[name] = (keys != [key], [(files.get(k, (None,))[0], k) for k in keys])
        for k in files:
            vision = k.startswith((OMNI_VISION, RADIO_ROOT, "radio_model.", "mlp1.", "vision_projector."))
            if k in used or vision != next(iter(shapes)).startswith("vision."):   # an Omni directory holds both parts
                continue
            what = next((w for w, pat in UNUSED.items() if re.search(pat, k)), None)
            if what is None:
                errors.append(f"{files[k][0]}: unexpected tensor {k}")
                continue
            if LAYER_SCALE.search(k) and not torch.all(self._get(files[k][0], k) == 1):
                errors.append(f"{files[k][0]}: {k} is not all ones (LayerScale is not implemented)")
            skipped[what] = skipped.get(what, 0) + 1
        return errors

    def read(self, name, suffix="", kind="model", shards=(), coords=None, sizes=None):
        """Full tensor `name` in our layout (experts stacked), or this rank's slice like checkpoint.Reader.read."""
        shards, coords, sizes = [tuple(s) for s in shards], coords or {}, sizes or {}
        if name in self.fresh:   # one at a time, not all of them held through the load
            return comm.take_shard(comm.draw(*self.fresh[name]), shards, coords, sizes)
        per_expert, where = self.where[name]
        if not per_expert:
            return comm.take_shard(self._get(*where[0]), shards, coords, sizes)
        # one tensor per expert: read only the experts this rank's slice holds (dim 0 of the stack)
        mine = comm.take_shard(torch.arange(len(where)), [s for s in shards if s[1] == 0], coords, sizes)
        t = torch.stack([self._get(*where[j]) for j in mine.tolist()])
        return comm.take_shard(t, [s for s in shards if s[1] != 0], coords, sizes)

    def _get(self, path, key):
        return self.files.get(path, key)

    def close(self):
        self.files.close()


def _vision_hf_name(name, omni):
    key = radio.hf_name(name[len("vision."):])
    return key if omni else key[len(OMNI_VISION):]


def _tensor_files(hf_dir):
    """{HF key: (file, shape)} of model.safetensors or the shards its index names; headers only."""
    index = os.path.join(hf_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(hf_dir, WEIGHTS_NAME)):
        files = [WEIGHTS_NAME]
    else:
        raise FileNotFoundError(f"{hf_dir}: neither {WEIGHTS_NAME} nor {INDEX_NAME} found")
    out = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: missing (named in {INDEX_NAME})")
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                if k in out:
                    raise ValueError(f"{path}: tensor {k} is also in {out[k][0]}")
                out[k] = (path, f.get_slice(k).get_shape())
    return out


def import_hf(hf_dir, preset=None, image_token_id=None, vision_hf=None, say=print):
    """-> (Config, {full name: tensor}) of an HF directory (see HFSource)."""
    with contextlib.closing(HFSource(hf_dir, preset, image_token_id, vision_hf, say=say)) as src:
        return src.cfg, {name: src.read(name) for name in src.tensors}


def export(path, out_dir, max_shard_bytes=DEFAULT_SHARD_BYTES, dtype=None, language_only=False, tokenizer=None,
           adapters_only=False):
    """export-hf: a checkpoint -> nemotron_h_omni (or, language-only, nemotron_h), adapters merged, or alone as a
    PEFT adapter directory; config, tokenizer and HF files from the checkpoint. -> the checkpoint's step."""
    with contextlib.closing(checkpoint.Reader(path)) as r:
        cfg, names = r.cfg, [n for n in r.tensors if not (language_only and n.startswith("vision."))]
        lora_names = [n for n in names if "lora_" in n]
        if adapters_only:   # base_model: the HF directory the run started from, if it did
            origin = (r.meta.get("run", {}).get("lineage") or [None])[0]
            hf_peft.save_peft({n: r.read(n) for n in lora_names}, cfg, out_dir, "" if language_only else OMNI_LM,
                              base_model=origin if origin and is_hf_dir(origin) else None)
            return r.meta["step"]
        sd = {n: r.read(n) for n in names}
    if lora_names:   # adapters folded into their frozen weights: a plain HF model
        sd = lora.merge(sd, cfg.lora_alpha)
    copy = os.path.join(r.dir, checkpoint.TOKENIZER_DIR)
    tokenizer = tokenizer or (copy if os.path.isdir(copy) else cfg.tokenizer)
    source = os.path.join(r.dir, checkpoint.SOURCE_DIR)
    export_hf(cfg, sd, out_dir, max_shard_bytes, dtype, data.load_tokenizer(tokenizer, cfg),
              source if os.path.isdir(source) else None)
    return r.meta["step"]


# ---------------------------------------------------------------- CLI

def main(argv=None):
    """The command line; a user error raises SystemExit("error: <cause>. <fix>") (cli prints it)."""
    p = argparse.ArgumentParser(description="Convert between our checkpoints and HF (transformers) directories.")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-hf", help="checkpoint (any layout) -> HF nemotron_h_omni (or nemotron_h) directory")
    e.add_argument("--load", required=True, help="a save directory (its newest complete step) or a step directory")
    e.add_argument("--out", required=True, help="a new or empty directory outside every checkpoint")
    e.add_argument("--overwrite", action="store_true", help="into a directory with files: replace those export-hf "
                   "writes (and an earlier export's weight shards), keep the others")
    e.add_argument("--language-only", action="store_true", help="write the language model alone (nemotron_h)")
    e.add_argument("--tokenizer", help="HF tokenizer dir to export (default: the one the run trained with)")
    e.add_argument("--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES)
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast (default: keep dtypes)")
    e.add_argument("--adapters-only", action="store_true", help="a LoRA run's adapters alone, as a PEFT adapter "
                   "directory (else merged in)")
    i = sub.add_parser("import-hf", help="HF nemotron_h_omni / nemotron_h directory -> our checkpoint directory")
    i.add_argument("--hf", required=True)
    i.add_argument("--out", required=True, help="a new or empty directory outside every checkpoint")
    i.add_argument("--preset", default="nano", help="preset for the fields HF does not carry (seq_len, budgets, ...)")
    i.add_argument("--image-token-id", type=int, help="for a nemotron_h config without image_token_id")
    i.add_argument("--vision-hf", help="a transformers `radio` directory: its tower + a fresh projector")
    args = p.parse_args(argv)
    _check_out(args.cmd, args.out, getattr(args, "overwrite", False))
    try:
        if args.cmd == "export-hf":
            step_dir = checkpoint.pin(args.load, print)   # held from the choice: a live run's prune passes it by
            step = _staged(args.out, lambda stage: export(
                step_dir, stage, args.max_shard_bytes, getattr(torch, args.dtype) if args.dtype else None,
                args.language_only, args.tokenizer, args.adapters_only))
            print(f"wrote {args.out} from step {step} ({step_dir})")
        else:
            cfg, sd = import_hf(args.hf, args.preset, args.image_token_id, args.vision_hf)
            has_tokenizer = os.path.exists(os.path.join(args.hf, "tokenizer_config.json"))
            cfg = dataclasses.replace(cfg, tokenizer=args.hf if has_tokenizer else None)

            def save(out):   # the checkpoint carries its run: tokenizer and source files, as a training save
                checkpoint.save_model(out, cfg, sd)
                if has_tokenizer:
                    data.load_tokenizer(args.hf, cfg).save(os.path.join(out, checkpoint.TOKENIZER_DIR))
                copy_source(args.hf, os.path.join(out, checkpoint.SOURCE_DIR))
            _staged(args.out, save)
            print(f"wrote {args.out} (fields HF does not carry from --preset {args.preset}). Fine-tune it on your "
                  "data (the same line again resumes the run from YOUR_RUN_DIR): `torchrun --nproc_per_node=8 "
                  f"train.py --load {shlex.quote(args.out)} --finetune --data YOUR_DATA.jsonl --save YOUR_RUN_DIR "
                  "--steps 1000 --save-every 200`")
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    except OSError as err:   # a full disk, permissions
        raise SystemExit(f"error: {err.filename or args.out}: {type(err).__name__}: {err.strerror or err}. Free "
                         "space, or check the permissions of --load and --out") from None


def _check_out(cmd, out, overwrite):
    """--out is never, nor lies in, a checkpoint directory; new or empty unless `overwrite`."""
    held = checkpoint.enclosing(out)
    if held is not None:
        where = "is a checkpoint directory" if held == os.path.realpath(out) else \
            f"lies in the checkpoint directory {held}"
        raise SystemExit(f"error: --out {out} {where}: {cmd} never writes into one. Choose a new directory outside it")
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if names and not overwrite:
        raise SystemExit(f"error: --out {out} is not empty ({len(names)} entries, e.g. {names[0]}). Choose a new or "
                         "empty directory" + (", or pass --overwrite to replace the files export-hf writes there "
                                              "(the others stay)" if cmd == "export-hf" else ""))


def _staged(out, write):
    """write(a new directory inside `out`) -> its result; what it wrote then replaces those entries of `out` (never
    written into: a file may be a checkpoint's hard link), and an earlier export's shards it does not replace are
    dropped (a loader would pick them up). A failed write changes no file in `out`, and leaves no `out` it made."""
    made = not os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=".writing-", dir=out)
    except OSError as e:
        raise SystemExit(f"error: --out {out}: cannot write there ({type(e).__name__}: {e.strerror or e}). Choose a "
                         "writable directory") from None
    try:
        result = write(stage)
        names = os.listdir(stage)
        for name in names:
            os.replace(os.path.join(stage, name), os.path.join(out, name))
        if any(SHARD_FILES.fullmatch(n) for n in names):
            for name in set(os.listdir(out)) - set(names):
                if SHARD_FILES.fullmatch(name):
                    os.remove(os.path.join(out, name))
        return result
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if made and not os.listdir(out):
            os.rmdir(out)


def cli(argv=None):
    """main() as a command: a user error is its one line `error: <cause>. <fix>`, exit status 2 (as train.py's)."""
    try:
        main(argv)
    except SystemExit as e:
        if not isinstance(e.code, str):   # --help, argparse's usage errors (status 2)
            raise
        print(f"error: {e.code.removeprefix('error: ')}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    cli()
