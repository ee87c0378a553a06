"""LoRA adapters (lora.py) as a PEFT adapter directory: `peft.PeftModel.from_pretrained(model, DIR)` on the
transformers model of the run's base computes what the merged export computes. PEFT names the modules of the loaded
model, which transformers 5 renames from the checkpoint's keys (RENAMES).
  Linear (W [out, in])      lora_A.weight [r, in], lora_B.weight [out, r]: ours as they are
  RADIO's fused qkv         transformers splits W's rows into q / k / v (Chunk(dim=0)): each gets A and its third of B
  routed experts            target_parameters (PEFT's ParamWrapper on the 3-D `up_proj` / `down_proj` [E, out, in]),
                            one rank-r pair per expert as ours: lora_A.weight [E*r, in], row e*r + k = A_e[k];
                            lora_B.weight [out, r*E], column k*E + e = B_e[:, k] (ParamWrapper.get_delta_weight)
Scale alpha / r everywhere (not rslora), as lora.py. PEFT refuses LoRA on Mamba's out_proj in a model of type
nemotron_h (HF's fused CUDA training kernel reads out_proj.weight and would skip the adapter), so a language-only
export of such adapters is refused; the Omni's type escapes that check, and its eval forward calls out_proj.
"""
import os
import re

import checkpoint
import radio

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."       # PeftModel's root, in every key PEFT saves
# transformers 5's renames on load (conversion_mapping: nemotron_h, radio, NemotronH_Omni_Reasoning_V3), applied to
# the checkpoint keys hf_interop.export_hf writes
RENAMES = [(r"(^|\.)backbone\.", r"\1model."), (r"radio_model\.model\.blocks\.", "encoder.layer."),
           (r"\.attn\.proj$", ".attention.o_proj"), (r"\.attn\.qkv$", ".attention.qkv"),
           (r"radio_model\.model\.patch_generator\.embedder$", "embeddings.patch_projection"),
           (r"radio_model\.model\.patch_generator\.video_embedder$", "embeddings.video_patch_projection"),
           (r"^mlp1\.1$", "multi_modal_projector.linear_1"), (r"^mlp1\.3$", "multi_modal_projector.linear_2")]
# PEFT wraps a module's targeted parameters in the order the module declares them, each wrapper around the last:
# NemotronHExperts declares up_proj first, so its adapter sits one `base_layer.` deeper than down_proj's
EXPERT_DEPTH = {"up": "base_layer.", "down": ""}


def hf_module(name, lm_root):
    """Our full module name ("language.…" / "vision.…") -> its name in the loaded transformers model."""
    if name.startswith("language."):
        key = lm_root + name[len("language."):]
    else:
        key = radio.hf_name(name[len("vision."):] + ".weight")[:-len(".weight")]
    for pattern, repl in RENAMES:
        key = re.sub(pattern, repl, key)
    return key


def save_peft(state_dict, cfg, out_dir, lm_root, base_model=None):
    """Write the adapters of `state_dict` ({full name: full tensor}) as a PEFT adapter directory. lm_root: where the
    language model sits, "language_model." in a nemotron_h_omni, "" in a nemotron_h (no vision adapters then).
    base_model: its base_model_name_or_path."""
    omni = bool(lm_root)
    # transformers builds no MTP blocks (it drops their weights on load): their adapters have nothing to attach to
    adapters = {k: v for k, v in state_dict.items() if ".lora_" in k and (omni or k.startswith("language."))
                and not k.startswith("language.mtp.")}
    if not adapters:
        raise ValueError("the checkpoint has no LoRA adapters" + (" (--lora-rank 0)" if omni else " in the language "
                         "model") + ": export the full model with export-hf without --adapters-only")
    mamba_out = [k.split(".")[3] for k in adapters if k.endswith(".mixer.out_proj.lora_A")]
    if mamba_out and not omni:
        raise ValueError("PEFT refuses LoRA on a nemotron_h model's Mamba out_proj (peft.tuners.tuners_utils."
                         "_check_lora_target_modules_mamba), which this run trained (language.backbone.layers.N."
                         f"mixer.out_proj, N in {', '.join(mamba_out)}): export the whole VLM (without "
                         "--language-only) or merged (export-hf without --adapters-only)")
    r, tensors, modules, params = cfg.lora_rank, {}, set(), set()
    for k, a in adapters.items():
        owner, kind = k.rsplit(".", 1)
        if kind == "lora_A":
            key, b = hf_module(owner, lm_root), adapters[owner + ".lora_B"]
            parts = {key: b} if not key.endswith(".attention.qkv") else \
                {f"{key[:-3]}{p}_proj": bp for p, bp in zip("qkv", b.chunk(3))}
            for module, bp in parts.items():
                modules.add(module)
                tensors[f"{PREFIX}{module}.lora_A.weight"] = a
                tensors[f"{PREFIX}{module}.lora_B.weight"] = bp
        elif kind.endswith("_A"):   # routed experts: lora_up_A [E, r, in], lora_up_B [E, out, r]
            proj, key, b, E = kind[len("lora_"):-2], hf_module(owner, lm_root), adapters[k[:-1] + "B"], a.shape[0]
            params.add(f"{key}.{proj}_proj")
            root = f"{PREFIX}{key}.{EXPERT_DEPTH[proj]}"
            tensors[root + "lora_A.weight"] = a.reshape(E * r, a.shape[-1])
            tensors[root + "lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * E)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": r,
              "lora_alpha": cfg.lora_alpha, "target_modules": sorted(modules),
              "target_parameters": sorted(params) or None, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True}
    os.makedirs(out_dir, exist_ok=True)
    # clone: q / k / v share A and slice one B, and safetensors refuses tensors that share storage
    checkpoint.write_atomic(os.path.join(out_dir, WEIGHTS_NAME),
                            {k: v.detach().cpu().clone() for k, v in tensors.items()})
    checkpoint.write_atomic(os.path.join(out_dir, CONFIG_NAME), config)
