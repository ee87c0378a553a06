"""HF NemotronH interop: export a checkpoint (any layout) as an HF `nemotron_h` directory, import one back.

Names: the original ones (decoder.md §9), equal to ours except that HF stores routed experts one tensor per expert
(`mixer.experts.{j}.up_proj.weight` [F, D]) where we stack them for grouped GEMM (`mixer.experts.up_proj` [E, F, D]).
CLI:  python hf_interop.py export-hf --load CKPT --out HF_DIR  |  import-hf --hf HF_DIR --out CKPT
"""
import argparse
import dataclasses
import glob
import json
import math
import os
import re

import torch
from safetensors.torch import load_file

import checkpoint
import config
import radio

WEIGHTS_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
VISION_NAME = "vision.safetensors"   # export-hf: vision tower + projector under HF Nemotron-VL names
DEFAULT_SHARD_BYTES = 5 * 10**9      # HF's classic default shard size

# Config fields: config.LANGUAGE_FIELDS are what HF's config carries, under the same names except these two.
HF_RENAMED = {"layer_norm_epsilon": "norm_eps", "initializer_range": "init_std"}
HF_SAME = tuple(f for f in config.LANGUAGE_FIELDS if f not in HF_RENAMED.values())
# HF switches whose value is baked into our model; import refuses any other value (absent = HF default = this).
HF_FIXED = dict(use_conv_bias=True, mamba_proj_bias=False, use_bias=False, attention_bias=False, mlp_bias=False,
                n_shared_experts=1, mlp_hidden_act="relu2", mamba_hidden_act="silu", n_group=1, topk_group=1,
                norm_topk_prob=True, residual_in_fp32=False, tie_word_embeddings=False, moe_latent_size=None,
                sliding_window=None)
# Written for completeness (Nano's values, decoder.md §2.1), not read back. time_step_* only drive HF's init.
# Caveat: HF's torch Mamba path clamps dt at time_step_min; ours, the CUDA kernels and Megatron do not.
HF_INFO = dict(time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, expand=2, bos_token_id=1,
               eos_token_id=2, pad_token_id=0, mamba_ssm_cache_dtype="float32", attention_dropout=0.0,
               hidden_dropout=0.0, num_logits_to_keep=1, use_mamba_kernels=True, rescale_prenorm_residual=True)
HF_LAYER_TYPES = {"linear_attention": "M", "full_attention": "*", "moe": "E", "mlp": "-"}   # transformers 5.x
STACKED_KEY = re.compile(r"^(.+\.mixer\.experts)\.(up_proj|down_proj)$")                 # ours
EXPERT_KEY = re.compile(r"^(.+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")    # HF, one per expert


# ---------------------------------------------------------------- HF export

def export_hf(cfg, lm_state_dict, out_dir, max_shard_bytes=DEFAULT_SHARD_BYTES, dtype=None):
    """Write an HF `nemotron_h` directory (config.json + safetensors, sharded above max_shard_bytes).

    lm_state_dict: LanguageModel names (strip any VLM prefix first, see language_state_dict). dtype casts the
    floating tensors, except the expert bias, which stays fp32 as HF keeps it (_keep_in_fp32_modules_strict).
    """
    checkpoint.check_tensors(lm_state_dict, checkpoint.lm_shapes(cfg), "export_hf(lm_state_dict)")
    tensors = {}
    for k, v in lm_state_dict.items():
        v = v.detach().cpu()
        if k.endswith("e_score_correction_bias"):
            v = v.float()
        elif dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        m = STACKED_KEY.match(k)
        if m:   # views; each shard copies its own slice at write time
            tensors.update({f"{m[1]}.{j}.{m[2]}.weight": w for j, w in enumerate(v.unbind(0))})
        else:
            tensors[k] = v
    os.makedirs(out_dir, exist_ok=True)
    torch_dtype = checkpoint.dtype_name(tensors["backbone.embeddings.weight"])
    checkpoint.write_atomic(os.path.join(out_dir, checkpoint.CONFIG_NAME), hf_config(cfg, torch_dtype))
    _write_shards(tensors, out_dir, max_shard_bytes)


def hf_config(cfg, torch_dtype="bfloat16"):
    hf = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "torch_dtype": torch_dtype,
          "num_hidden_layers": len(cfg.hybrid_override_pattern), "max_position_embeddings": cfg.seq_len}
    hf.update({k: getattr(cfg, k) for k in HF_SAME}, **HF_FIXED, **HF_INFO)
    hf.update({h: getattr(cfg, ours) for h, ours in HF_RENAMED.items()})
    return dict(sorted(hf.items()))


def _write_shards(tensors, out_dir, max_shard_bytes):
    """Greedy in key order. One shard -> model.safetensors; more -> model-0000k-of-0000n + index."""
    for stale in glob.glob(os.path.join(out_dir, "model*.safetensors*")):
        os.remove(stale)   # a loader would otherwise pick up shards or the index of an earlier export
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

def import_hf(hf_dir, preset="nano"):
    """-> (Config, LanguageModel state dict) from an HF `nemotron_h` directory (single file or sharded).

    Non-language Config fields come from `preset`. `mtp.*` keys are ignored (HF ignores them too). Besides the
    original names (`backbone.`, one tensor per expert) this accepts transformers' in-memory names (`model.`,
    stacked experts), which are our names under another root.
    """
    cfg_file = os.path.join(hf_dir, checkpoint.CONFIG_NAME)
    with open(cfg_file) as f:   # a missing file raises FileNotFoundError naming it
        cfg = config_from_hf(json.load(f), cfg_file, preset)
    raw, file_of = _read_hf_tensors(hf_dir)
    root = lambda k: "backbone." + k[len("model."):] if k.startswith("model.") else k   # noqa: E731
    raw = {root(k): v for k, v in raw.items() if not k.startswith("mtp.")}
    file_of = {root(k): f for k, f in file_of.items()}
    expected = checkpoint.lm_shapes(cfg)
    state_dict = _stack_experts(raw, file_of, expected, cfg.n_routed_experts)
    checkpoint.check_tensors(state_dict, expected, hf_dir, file_of)
    return cfg, state_dict


def config_from_hf(hf, source="config.json", preset="nano"):
    if hf.get("model_type", "nemotron_h") != "nemotron_h":
        raise ValueError(f"{source}: model_type {hf['model_type']!r}, expected 'nemotron_h'")
    errors = [f"{k}={hf[k]!r} (this model implements {v!r})" for k, v in HF_FIXED.items() if k in hf and hf[k] != v]
    # HF writes infinity as {"__float__": "Infinity"}
    lo, hi = (float(x["__float__"] if isinstance(x, dict) else x) for x in hf.get("time_step_limit", (0, math.inf)))
    if lo > 0 or hi != math.inf:   # a dt clamp our model does not apply
        errors.append(f"time_step_limit=[{lo}, {hi}] (this model implements [0, inf])")
    if "layers_block_type" in hf:  # transformers 5.x writes this list instead of the pattern string
        pattern = "".join(HF_LAYER_TYPES.get(t, "?") for t in hf["layers_block_type"])
    else:
        pattern = hf.get("hybrid_override_pattern", config.resolve(preset).hybrid_override_pattern)
    if set(pattern) - set("M*E-"):
        errors.append(f"layer pattern {pattern!r} (layers_block_type {hf.get('layers_block_type')}): only M * E -")
    if "num_hidden_layers" in hf and hf["num_hidden_layers"] != len(pattern):
        errors.append(f"num_hidden_layers={hf['num_hidden_layers']} but the pattern has {len(pattern)} layers")
    if errors:
        raise ValueError(f"{source}: unsupported: " + "; ".join(errors))
    types = {f.name: f.type for f in dataclasses.fields(config.Config)}
    overrides = {k: types[k](hf[k]) for k in HF_SAME if k in hf and k != "hybrid_override_pattern"}
    overrides.update({ours: types[ours](hf[h]) for h, ours in HF_RENAMED.items() if h in hf})
    overrides["hybrid_override_pattern"] = pattern
    return config.resolve(preset, overrides)


def _read_hf_tensors(hf_dir):
    """-> ({key: tensor}, {key: file}) from model.safetensors or the shards named in the index."""
    index = os.path.join(hf_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(hf_dir, WEIGHTS_NAME)):
        files = [WEIGHTS_NAME]
    else:
        raise FileNotFoundError(f"{hf_dir}: neither {WEIGHTS_NAME} nor {INDEX_NAME} found")
    tensors, file_of = {}, {}
    for name in files:
        path = os.path.join(hf_dir, name)
        for k, v in load_file(path).items():   # a missing shard raises FileNotFoundError naming it
            if k in tensors:
                raise ValueError(f"{path}: tensor {k} is also in {file_of[k]}")
            tensors[k], file_of[k] = v, path
    return tensors, file_of   # keys listed in the index but absent show up as missing in the strict check


def _stack_experts(raw, file_of, expected, num_experts):
    """Per-expert HF tensors -> our stacked [E, ...] tensors; every expert 0..E-1 present, shapes checked."""
    out, groups = {}, {}
    for k, v in raw.items():
        m = EXPERT_KEY.match(k)
        if m:
            groups.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = k
        else:
            out[k] = v
    errors = []
    for name, by_expert in groups.items():
        keys = [by_expert.get(j) for j in range(num_experts)]
        base, proj = name.rsplit(".", 1)
        errors += [f"{base}.{j}.{proj}.weight missing" for j, k in enumerate(keys) if k is None]
        errors += [f"{file_of[k]}: unexpected tensor {k} (n_routed_experts={num_experts})"
                   for j, k in by_expert.items() if j >= num_experts]
        want = expected.get(name, (None,))[1:]   # a name not expected at all is reported by the strict check
        errors += [f"{file_of[k]}: tensor {k} has shape {list(raw[k].shape)}, expected {list(want)}"
                   for k in keys if k is not None and name in expected and tuple(raw[k].shape) != want]
        if not errors:
            out[name] = torch.stack([raw[k] for k in keys])
            file_of[name] = file_of[keys[0]]
    checkpoint.raise_errors(errors)
    return out


def export(path, out_dir, max_shard_bytes=DEFAULT_SHARD_BYTES, dtype=None):
    """export-hf: a checkpoint of any layout -> the language model as HF nemotron_h (export_hf) and the vision
    tower + projector as OUT/vision.safetensors under HF Nemotron-VL names (radio.hf_name: `vision_model.…`,
    `mlp1.{0,1,3}.weight`)."""
    cfg, sd = checkpoint.load_model(path)
    export_hf(cfg, checkpoint.language_state_dict(sd), out_dir, max_shard_bytes, dtype)
    vision = {radio.hf_name(k[len("vision."):]): v.to(dtype) if dtype and v.is_floating_point() else v
              for k, v in sd.items() if k.startswith("vision.")}
    if vision:
        checkpoint.write_atomic(os.path.join(out_dir, VISION_NAME), vision)


# ---------------------------------------------------------------- CLI

def main(argv=None):
    p = argparse.ArgumentParser(description="Convert between our checkpoints and HF directories.")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-hf", help="checkpoint (any layout) -> HF nemotron_h dir + vision.safetensors")
    e.add_argument("--load", required=True, help="a save directory (uses `latest`) or a step directory")
    e.add_argument("--out", required=True)
    e.add_argument("--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES)
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast (default: keep dtypes)")
    i = sub.add_parser("import-hf", help="HF nemotron_h dir (config.json + safetensors) -> our checkpoint dir")
    i.add_argument("--hf", required=True)
    i.add_argument("--out", required=True)
    i.add_argument("--preset", default="nano", help="preset for the fields HF does not carry")
    args = p.parse_args(argv)
    if args.cmd == "export-hf":
        export(args.load, args.out, args.max_shard_bytes, getattr(torch, args.dtype) if args.dtype else None)
    else:
        cfg, sd = import_hf(args.hf, args.preset)
        checkpoint.save_model(args.out, cfg, {checkpoint.LM_PREFIX + k: v for k, v in sd.items()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
