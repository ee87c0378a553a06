"""Presets as plain dataclass values, plus `--FIELD VALUE` overrides.

One flat `Config` holds the language model, the vision tower, the data, the optimizer and the reference
layout. Field names of the language model follow HF `config.json` (nemotron_h); vision fields start with
`vit_`. A preset is a dict of overrides on the defaults below; `resolve()` applies preset, then vision
variant, then the user's overrides, and checks the result.
"""
import dataclasses
import difflib
from dataclasses import dataclass


@dataclass
class Config:
    # ---- language model (HF nemotron_h names) ----
    vocab_size: int = 131072
    hidden_size: int = 2688
    hybrid_override_pattern: str = "MEMEM*EMEMEM*EMEMEM*"
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    mamba_num_heads: int = 64
    mamba_head_dim: int = 64
    n_groups: int = 8
    ssm_state_size: int = 128
    conv_kernel: int = 4
    chunk_size: int = 128
    n_routed_experts: int = 128
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1856
    moe_shared_expert_intermediate_size: int = 3712
    intermediate_size: int = 1856            # dense '-' MLP width
    routed_scaling_factor: float = 2.5
    norm_eps: float = 1e-5
    init_std: float = 0.0173                 # Megatron recipes, not HF's 0.02
    moe_aux_loss_coeff: float = 1e-4         # seq_aux_loss
    moe_bias_update_rate: float = 1e-3       # aux-loss-free expert-bias step
    # ---- vision tower (RADIO ViT) + projector ----
    vision: str = "vit-h"                    # variant name, expands to the vit_* fields below
    vit_hidden: int = 1280
    vit_depth: int = 32
    vit_heads: int = 16
    vit_mlp: int = 5120
    vit_patch: int = 16
    vit_cpe_grid: int = 128                  # CPE table is vit_cpe_grid x vit_cpe_grid
    class_token_len: int = 10
    vit_random_crop_cpe: bool = False
    projector_hidden: int = 20480
    min_num_patches: int = 1024
    max_num_patches: int = 13312
    image_token_id: int = 511
    # ---- data ----
    seq_len: int = 8192
    mock_image_size: int = 2048              # mock samples carry one square image of this many pixels
    mock_text_only_frac: float = 0.0
    mock_num_samples: int = 0                # > 0: the mock set has this many samples and repeats (tests)
    mock_text: str = "task"                  # task: learnable, answers only the image predicts; random (mock.py)
    # ---- reference layout (hetero when vision sizes > 0) ----
    vision_tp: int = 2
    vision_dp: int = 2
    lm_tp: int = 2
    lm_dp: int = 2
    lm_ep: int = 4                           # experts over all 4 language ranks (edp 1): the 20l fits 80 GB
    lm_etp: int = 1
    reference_world: int = 8                 # the layout above applies when WORLD_SIZE equals this
    # ---- failure handling (failsafe.py) ----
    max_skipped_steps: int = 10              # abort after this many consecutive non-finite steps (0: never)


# The language model's shape: the fields an HF nemotron_h config carries (hf_interop.py renames norm_eps, init_std).
LANGUAGE_FIELDS = ("vocab_size", "hidden_size", "hybrid_override_pattern", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "mamba_num_heads", "mamba_head_dim", "n_groups",
                   "ssm_state_size", "conv_kernel", "chunk_size", "n_routed_experts", "num_experts_per_tok",
                   "moe_intermediate_size", "moe_shared_expert_intermediate_size", "intermediate_size",
                   "routed_scaling_factor", "norm_eps", "init_std")


VIT_VARIANTS = {  # hidden, depth, heads, mlp, projector hidden (= 4 * 4C after 2x2 pixel shuffle)
    "tiny": dict(vit_hidden=32, vit_depth=2, vit_heads=4, vit_mlp=64, projector_hidden=128, vit_cpe_grid=16),
    "vit-b": dict(vit_hidden=768, vit_depth=12, vit_heads=12, vit_mlp=3072, projector_hidden=12288),
    "vit-l": dict(vit_hidden=1024, vit_depth=24, vit_heads=16, vit_mlp=4096, projector_hidden=16384),
    "vit-h": dict(vit_hidden=1280, vit_depth=32, vit_heads=16, vit_mlp=5120, projector_hidden=20480),
    "vit-g": dict(vit_hidden=1536, vit_depth=40, vit_heads=24, vit_mlp=6144, projector_hidden=24576),
}

NANO = dict(num_key_value_heads=2, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME")

PRESETS = {
    "tiny": dict(  # fast on 2 CPU cores; tp2 / ep2 / vision tp2 all divide
        vocab_size=512, hidden_size=64, hybrid_override_pattern="MEM*EM-E", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
        ssm_state_size=16, conv_kernel=4, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, intermediate_size=64,
        vision="tiny", class_token_len=2, min_num_patches=16, max_num_patches=256, image_token_id=511,
        seq_len=96, mock_image_size=64, mock_text_only_frac=0.25,
        vision_tp=1, vision_dp=2, lm_tp=1, lm_dp=2, lm_ep=1, reference_world=4),
    "small": dict(
        vocab_size=4096, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=32, chunk_size=32,
        n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=128,
        moe_shared_expert_intermediate_size=256, intermediate_size=128, vision="vit-b",
        min_num_patches=64, max_num_patches=1024, seq_len=1024, mock_image_size=256,
        vision_tp=1, vision_dp=1, lm_tp=1, lm_dp=1, lm_ep=1, reference_world=2),
    "20l": dict(),
    "54l": dict(hybrid_override_pattern="MEMEM*EMEM*EMEM*EMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEME"),
    "nano": dict(NANO),
}


def resolve(preset, overrides=None):
    """Preset name + {field: value-or-string} -> checked Config. Unknown keys name their close matches."""
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    values = dict(PRESETS[preset])
    variant = (overrides or {}).get("vision", values.get("vision", Config.vision))
    if variant not in VIT_VARIANTS:
        raise SystemExit(f"unknown vision variant {variant!r}; choose from {sorted(VIT_VARIANTS)}")
    values.update(VIT_VARIANTS[variant])
    return from_values(values, overrides)


def from_values(values, overrides=None):
    """{field: value} (a preset's, a saved config.json's) + {field: value-or-string} overrides -> checked Config.
    Fields missing from `values` keep their defaults."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for key in overrides or {}:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            raise SystemExit(f"unknown config field {key!r}" + (f"; did you mean {close}?" if close else ""))
    cfg = Config(**{**values, **{k: _parse(fields[k], v) for k, v in (overrides or {}).items()}})
    check(cfg)
    return cfg


def _parse(field, value):
    if not isinstance(value, str) or field.type is str:
        return value
    if field.type is bool:
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise SystemExit(f"--{field.name} expects true/false, got {value!r}")
    try:
        return field.type(value)
    except ValueError:
        raise SystemExit(f"--{field.name} expects {field.type.__name__}, got {value!r}") from None


def check(cfg):
    """Shape constraints of the model itself (layout constraints live in parallel.py)."""
    errors = []
    if set(cfg.hybrid_override_pattern) - set("M*E-"):
        errors.append(f"hybrid_override_pattern may only hold M * E -, got {cfg.hybrid_override_pattern!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        errors.append("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.mamba_num_heads % cfg.n_groups:
        errors.append("mamba_num_heads must be a multiple of n_groups")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        errors.append("num_experts_per_tok exceeds n_routed_experts")
    if cfg.vit_hidden % cfg.vit_heads:
        errors.append("vit_hidden must be a multiple of vit_heads")
    if not 0 <= cfg.image_token_id < cfg.vocab_size:
        errors.append("image_token_id must be a valid token id")
    if errors:
        raise SystemExit("bad config: " + "; ".join(errors))
