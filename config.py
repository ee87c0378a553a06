"""The run's one config: the model, the data, training, the layout, logging and checkpoints in one flat dataclass,
its command line (`--field-name VALUE`, one flag per field) and the presets.

A preset is a dict of overrides on the defaults below; `resolve()` applies preset, then vision variant, then the
user's values, and checks the result. Field names of the language model follow HF `config.json` (nemotron_h);
vision fields start with `vit_`. A checkpoint saves the whole Config as its run record (checkpoint.py) and
`--load` restores it (resume.py; a record of an earlier version through upgrade_record). Each field's metadata says
its role (ROLES): the model's fields (MODEL_FIELDS, derived) say what its weights mean, so a different value given
with `--load` is refused, as for the fixed ones; every other field may change on resume, and a change is logged.
"""
import argparse
import dataclasses
import difflib
import functools
import math
import re
import types
from dataclasses import dataclass, field


def _f(default, help=None, **meta):
    """A field with its --help text (and `choices`) for the command line, and where it has one its role (ROLES):
    what a checkpoint and a resumed run make of it; later=True: added after run records began (LATER_FIELDS)."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class Config:
    preset: str = _f("tiny", "model and defaults (fields below override it)", role="fixed",
                     choices=("tiny", "small", "20l", "54l", "nano", "super"))
    # ---- language model (HF nemotron_h names) ----
    vocab_size: int = _f(131072, role="language")
    hidden_size: int = _f(2688, role="language")
    hybrid_override_pattern: str = _f("MEMEM*EMEMEM*EMEMEM*", role="language")
    num_attention_heads: int = _f(32, role="language")
    num_key_value_heads: int = _f(8, role="language")
    head_dim: int = _f(128, role="language")
    mamba_num_heads: int = _f(64, role="language")
    mamba_head_dim: int = _f(64, role="language")
    n_groups: int = _f(8, role="language")
    ssm_state_size: int = _f(128, role="language")
    conv_kernel: int = _f(4, role="language")
    chunk_size: int = _f(128, role="language")
    n_routed_experts: int = _f(128, role="language")
    num_experts_per_tok: int = _f(6, role="language")
    moe_intermediate_size: int = _f(1856, role="language")
    moe_shared_expert_intermediate_size: int = _f(3712, role="language")
    moe_latent_size: int | None = _f(None, "LatentMoE: routed experts run in this width (fc1 / fc2_latent_proj around "
                                     "them); None: the hidden size, no projections", role="language", later=True)
    intermediate_size: int = _f(1856, "dense '-' MLP width", role="language")
    routed_scaling_factor: float = _f(2.5, role="language")
    num_nextn_predict_layers: int = _f(0, "multi-token prediction blocks (their weights); depth k runs block (k-1) mod "
                                       "this (docs/super.md §3)", role="language", later=True)
    mtp_pattern: str = _f("*E", "the layers of one MTP block (HF mtp_layers_block_type)", role="language", later=True)
    mtp_depths: int | None = _f(None, "MTP depths trained (default: num_nextn_predict_layers; more: blocks shared)",
                                later=True)
    mtp_loss_scale: float = _f(0.1, "weight of the MTP loss, the mean over depths (Megatron's 0.1; Super trains 0.3)",
                               later=True)
    norm_eps: float = _f(1e-5, role="language")
    init_std: float = _f(0.0173, "Megatron recipes' init std, not HF's 0.02", role="language")
    moe_aux_loss_coeff: float = _f(1e-4, "seq_aux_loss")
    moe_bias_update_rate: float = _f(1e-3, "aux-loss-free expert-bias step")
    # ---- vision tower (RADIO ViT) + projector ----
    vision: str = _f("vit-h", "variant name, expands to the vit_* fields below", role="vision",
                     choices=("tiny", "vit-b", "vit-l", "vit-h", "vit-g"))
    vit_hidden: int = _f(1280, role="vision")
    vit_depth: int = _f(32, role="vision")
    vit_heads: int = _f(16, role="vision")
    vit_mlp: int = _f(5120, role="vision")
    vit_patch: int = _f(16, role="vision")
    vit_cpe_grid: int = _f(128, "the CPE table is vit_cpe_grid x vit_cpe_grid", role="vision")
    class_token_len: int = _f(10, role="vision")
    vit_random_crop_cpe: bool = False
    projector_hidden: int = _f(20480, role="vision")
    min_num_patches: int = 1024
    max_num_patches: int = 13312
    image_token_id: int = _f(511, role="model")
    video_temporal_patch: int = _f(0, "frames per video tubelet of the tower's video embedder (Nano Omni: 2; "
                                   "0: no video embedder, images only); docs/vision.md §11", role="vision", later=True)
    video_target_patches: int = _f(1024, "a video frame's fixed canvas, in patches (its aspect kept): "
                                   "transformers' video_target_num_patches", later=True)
    video_fps: float = _f(0.0, "sample a video at this many frames per second of its own time (0: every frame)",
                          later=True)
    max_frames: int = _f(0, "at most this many frames of a video, sampled evenly over it (0: no limit)", later=True)
    # ---- data ----
    seq_len: int = 8192
    data: str = _f("mock", "mock | PATH (.jsonl, .json, .parquet, dir, glob) | weighted blend "
                   "'0.7:a.jsonl,0.3:b/*.parquet'")
    eval_data: str | None = _f(None, "held-out data (file or blend) for --eval-every, with any --data")
    eval_frac: float = _f(0.0, "else hold out the last FRAC of every --data file")
    tokenizer: str | None = _f(None, "HF tokenizer directory (its chat template renders chats) or tokenizer.json; "
                               "default: offline byte-level tokenizer. A checkpoint keeps a copy", role="fixed")
    train_on: str = _f("assistant", "chat tokens with loss", choices=("assistant", "all"))
    pack: bool = _f(False, "pack documents into seq_len rows (document masks)")
    skip_bad_samples: bool = _f(False, "skip and count bad data lines, not fail")
    overlong: str = _f("error", "a document longer than seq_len: fail (counted skip under --skip-bad-samples), skip, "
                       "or truncate it (never inside an image)", choices=("error", "skip", "truncate"))
    data_columns: str | None = _f(None, "parquet columns, e.g. messages=conversations,images=image")
    num_workers: int | None = _f(None, "DataLoader workers; default 2 on GPU, 0 on CPU")
    mock_image_size: int = _f(2048, "mock samples carry one square image of this many pixels")
    mock_text_only_frac: float = 0.0
    mock_num_samples: int = _f(0, "> 0: the mock set has this many samples and repeats (tests)")
    mock_text: str = _f("task", "task: learnable, answers only the image predicts; random (mock.py)",
                        choices=("task", "random"))
    # ---- training ----
    steps: int = _f(20, "total optimizer steps of the run (resumed runs too)")
    global_batch: int = _f(8, "samples per optimizer step")
    micro_batch: int = _f(1, "samples per language lane per micro-batch")
    lr: float = 2e-4
    min_lr: float = 2e-6
    lr_schedule: str = _f("cosine", None, choices=("cosine", "wsd", "constant"))
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = _f(None, "default: --steps")
    lr_wsd_decay_iters: int | None = _f(None, "WSD decay tail; default 10%% of decay")
    lr_wsd_decay_style: str = _f("linear", None, choices=("linear", "minus_sqrt"))
    weight_decay: float = 0.05
    clip_grad: float = _f(1.0, "global grad-norm clip (0: off)")
    seed: int = 1234
    stage: int = _f(2, "1: projector only, 2: vision tower frozen, 3: everything", choices=(1, 2, 3))
    train_layers: str | None = _f(None, "regex over vision.* / language.* names (overrides --stage)")
    activation_checkpointing: bool = False
    distributed_optimizer: bool = _f(True, "sharded AdamW, bf16 weights on CUDA (optim.py); off: plain AdamW, fp32 "
                                     "weights, gradients and state replicated over data parallel")
    lora_rank: int = _f(0, "train LoRA adapters of this rank only (lora.py)", role="fixed")
    lora_alpha: float = _f(32.0, "LoRA scale = alpha / rank", role="fixed")
    lora_targets: str | None = _f(None, "regex over full layer names (default: lora.TARGETS)", role="fixed")
    moe_dispatcher: str = _f("alltoall", None, choices=("alltoall", "deepep"))
    moe_force_balance: bool = _f(False, "benchmarks only: route every token to fixed experts in turn, so all experts "
                                 "get the same rows (the routers of published throughputs)")
    max_skipped_steps: int = _f(10, "abort after this many consecutive non-finite steps (0: never)")
    collective_timeout: float = _f(300.0, "seconds the ranks may wait on each other before the run ends with a line "
                                   "naming the wait (set-up, the first step and evaluation: 4 times it; watchdog.py)",
                                   later=True)
    # ---- layout (None: chosen, chooser.py) ----
    vision_tp: int | None = _f(None, role="layout")
    vision_dp: int | None = _f(None, role="layout")
    lm_tp: int | None = _f(None, role="layout")
    lm_dp: int | None = _f(None, role="layout")
    lm_ep: int | None = _f(None, role="layout")
    lm_etp: int | None = _f(None, role="layout")
    lm_cp: int | None = _f(None, "context parallel: each language rank of a lane holds 1/N of every sequence (cp.py)",
                           role="layout", later=True)
    lm_pp: int | None = _f(None, "pipeline parallel: the language model's layers in N stages (docs/pipeline.md)",
                           role="layout", later=True)
    colocated: bool | None = _f(None, "both modules on every rank", role="layout")
    # ---- logging ----
    log_every: int = 1
    metrics_file: str | None = None
    moe_stats_every: int = 10
    tensorboard: str | None = _f(None, "TensorBoard log directory (pip install -e '.[tensorboard]')")
    wandb: str | None = _f(None, "Weights & Biases project (pip install -e '.[wandb]'; WANDB_MODE=offline works "
                           "without a network)", later=True)
    eval_every: int = 0
    eval_samples: int | None = _f(None, "an evaluation scores the first N eval samples; default: the whole eval data "
                                  "(32 of mock data)")
    # ---- checkpoints ----
    save: str | None = _f(None, "save directory: DIR/step_N/ + DIR/latest; a run saved there resumes from it")
    save_every: int = _f(0, "also save every N steps (always: last step, signal)")
    keep_last: int = _f(0, "keep only the newest K checkpoints (0: all)")
    async_save: bool = _f(False, "write checkpoints in a background thread")


FIELDS = {f.name: f for f in dataclasses.fields(Config)}

# What each field is (its metadata's role), a field at home saying it: the language model's shape, the fields an
# HF nemotron_h config carries (hf_interop.py renames norm_eps, init_std); the tower's shape; what else a checkpoint's
# weights mean; what a resumed run may not change besides (the adapters, the preset behind the defaults, the
# tokenizer, compared by content: resume.py); the layout. Any other field may change on resume, and a change is
# logged.
ROLES = ("language", "vision", "model", "fixed", "layout")


def _role(*roles):
    return tuple(name for name, f in FIELDS.items() if f.metadata.get("role") in roles)


LANGUAGE_FIELDS = _role("language")
VISION_FIELDS = _role("vision")
# What a checkpoint's weights mean: they load only into a run with equal values (checkpoint.load checks them).
MODEL_FIELDS = _role("language", "vision", "model")
FIXED_ON_RESUME = _role("language", "vision", "model", "fixed")
LAYOUT_FIELDS = _role("layout")


VIT_VARIANTS = {  # hidden, depth, heads, mlp, projector hidden (= 4 * 4C after 2x2 pixel shuffle)
    "tiny": dict(vit_hidden=32, vit_depth=2, vit_heads=4, vit_mlp=64, projector_hidden=128, vit_cpe_grid=16),
    "vit-b": dict(vit_hidden=768, vit_depth=12, vit_heads=12, vit_mlp=3072, projector_hidden=12288),
    "vit-l": dict(vit_hidden=1024, vit_depth=24, vit_heads=16, vit_mlp=4096, projector_hidden=16384),
    "vit-h": dict(vit_hidden=1280, vit_depth=32, vit_heads=16, vit_mlp=5120, projector_hidden=20480),
    "vit-g": dict(vit_hidden=1536, vit_depth=40, vit_heads=24, vit_mlp=6144, projector_hidden=24576),
}

PRESETS = {
    "tiny": dict(  # fast on 2 CPU cores; tp2 / ep2 / vision tp2 all divide
        vocab_size=512, hidden_size=64, hybrid_override_pattern="MEM*EM-E", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
        ssm_state_size=16, conv_kernel=4, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, intermediate_size=64,
        vision="tiny", class_token_len=2, min_num_patches=16, max_num_patches=256, image_token_id=511,
        seq_len=96, mock_image_size=64, mock_text_only_frac=0.25),
    "small": dict(
        vocab_size=4096, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=32, chunk_size=32,
        n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=128,
        moe_shared_expert_intermediate_size=256, intermediate_size=128, vision="vit-b",
        min_num_patches=64, max_num_patches=1024, seq_len=1024, mock_image_size=256),
    "20l": dict(),
    "54l": dict(hybrid_override_pattern="MEMEM*EMEM*EMEM*EMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEME",
                activation_checkpointing=True),
    # a 31.6 B-parameter model: activation checkpointing is what lets a full fine-tune fit 8 x 80 GB (memory.py)
    "nano": dict(num_key_value_heads=2, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                 activation_checkpointing=True),
    # Nemotron 3 Super 120B-A12B (docs/super.md §1): LatentMoE, one MTP block trained as two depths sharing it
    # (Megatron-Bridge's Super recipe, loss scale 0.3); Megatron's init std 0.014
    "super": dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, mamba_num_heads=128, n_groups=8,
        hybrid_override_pattern="MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*"
                                "EMEMEMEME",
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, routed_scaling_factor=5.0, init_std=0.014,
        num_nextn_predict_layers=1, mtp_pattern="*E", mtp_depths=2, mtp_loss_scale=0.3, activation_checkpointing=True),
}

# A preset's reference layout: the layout chooser (layout.py) takes it first on this many ranks when it fits.
# Hetero: vision tp/dp on the first ranks, the language grid on the rest.
REFERENCE_LAYOUTS = {
    "tiny": (4, dict(vision_tp=1, vision_dp=2, lm_tp=1, lm_dp=2, lm_ep=1, lm_etp=1, colocated=False)),
    "small": (2, dict(vision_tp=1, vision_dp=1, lm_tp=1, lm_dp=1, lm_ep=1, lm_etp=1, colocated=False)),
    # experts over all 4 language ranks (edp 1): the 20l fits 80 GB
    "20l": (8, dict(vision_tp=2, vision_dp=2, lm_tp=2, lm_dp=2, lm_ep=4, lm_etp=1, colocated=False)),
}


def per_config(fn):
    """fn(cfg, *args) cached per the config's values and the arguments: for counts that build a model on the meta
    device (about a second for Nano), which the layout chooser and every training step ask for again."""
    cache = {}

    @functools.wraps(fn)
    def call(cfg, *args):
        key = (tuple(vars(cfg).items()), args)
        if key not in cache:
            cache[key] = fn(cfg, *args)
        return cache[key]
    return call


def resolve(preset, overrides=None):
    """Preset name + {field: value-or-string} -> checked Config. Unknown keys name their close matches."""
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    values = dict(PRESETS[preset], preset=preset)
    variant = (overrides or {}).get("vision", values.get("vision", Config.vision))
    if variant not in VIT_VARIANTS:
        raise SystemExit(f"unknown vision variant {variant!r}; choose from {sorted(VIT_VARIANTS)}")
    values.update(VIT_VARIANTS[variant])
    return from_values(values, overrides)


def from_values(values, overrides=None):
    """{field: value} (a preset's, a saved config.json's) + {field: value-or-string} overrides -> checked Config.
    Fields missing from `values` keep their defaults."""
    for key in overrides or {}:
        if key not in FIELDS:
            close = difflib.get_close_matches(key, FIELDS, n=3)
            raise SystemExit(f"unknown config field {key!r}" + (f"; did you mean {close}?" if close else ""))
    cfg = Config(**{**values, **{k: parse_value(k, v) for k, v in (overrides or {}).items()}})
    check(cfg)
    return cfg


# The sample-counted LR schedule of earlier versions (--train-samples, --lr-*-samples): what they counted was always
# good steps x --global-batch, so a schedule in steps says the same (cli.ALIASES answers the flags).
SAMPLE_FIELDS = ("train_samples", "lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples")


# The fields added since checkpoints began to carry the whole Config (the run record) say so (later=True): a record
# written before one was added lacks it, and its default is what that version did (no W&B, no LatentMoE, no MTP,
# the layout's cp and pp chosen, no video, a 300 s timeout). A field added from now on says later=True too. Every
# other field is in every record: none stands in for a run's value.
LATER_FIELDS = tuple(name for name, f in FIELDS.items() if f.metadata.get("later"))


def check_record(values, where):
    """A run record's {field: value} (a checkpoint's config.json, `where`) that lacks fields (but LATER_FIELDS) or
    whose values are not of their field's type (a hand edit: "steps": "ten", "lr": null) -> ValueError naming each,
    else nothing."""
    kinds = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}
    missing = [f'"{k}"' for k in FIELDS if k not in values and k not in LATER_FIELDS]
    wrong = [f"missing {', '.join(missing)} (no default stands in for the run's value)"] if missing else []
    for k, v in values.items():
        if k in SAMPLE_FIELDS:
            allowed, none = (int,), True
        elif k in FIELDS:
            allowed, none = kinds[base_type(k)], isinstance(FIELDS[k].type, types.UnionType)
        else:
            continue
        if not (v is None and none or isinstance(v, allowed) and (bool in allowed or not isinstance(v, bool))):
            wrong.append(f'"{k}": {_json_value(v)} (expected {base_type(k).__name__ if k in FIELDS else "int"}'
                         f'{" or null" if none else ""})')
    if wrong:
        raise ValueError(f"{where}: " + ", ".join(wrong) + "; correct the file (it is the run's record)")


def _json_value(v):
    return "null" if v is None else f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v


def upgrade_record(values, where):
    """A run record written by an earlier version (the {field: value} of `where`, a checkpoint's config.json) -> its
    values for this one, by docs/checkpoints.md §1's rule: SAMPLE_FIELDS go, dropped when unused, else as the same
    schedule in steps where one gives the same LR at every step; else one line refuses the record, naming the fix."""
    values = dict(values)
    old = {k: values.pop(k, None) for k in SAMPLE_FIELDS}
    if not old["train_samples"]:
        return values
    gb, kind = values.get("global_batch", Config.global_batch), values.get("lr_schedule", Config.lr_schedule)
    warm, end = old["lr_warmup_samples"] or 0, old["lr_decay_samples"] or old["train_samples"]
    counts = {"lr_warmup_iters": warm, "lr_decay_iters": end,
              "lr_wsd_decay_iters": old["lr_wsd_decay_samples"] or max((end - warm) // 10, 1)}
    read = list(counts)[:{"constant": 1, "cosine": 2}.get(kind, 3)]
    if (warm == 0 or gb == 1) and all(counts[k] % gb == 0 for k in read):
        return {**values, **{k: n // gb if n % gb == 0 else None for k, n in counts.items()}}
    used = " ".join(f"--{flag(k)} {v}" for k, v in old.items() if v)
    why = "a warm-up in samples" if warm and gb > 1 else f"counts that are no multiple of {gb}"
    nearest = ", ".join(f'"{k}": {-(-counts[k] // gb)}' for k in read)
    raise SystemExit(f"{where}: this run's LR schedule counts samples ({used} at --global-batch {gb}; {why}: no "
                     "schedule in steps gives its learning rates), which this version no longer reads; to train on "
                     f"with the nearest schedule in steps, delete the *_samples fields of that file and set {nearest}; "
                     "to keep its learning rates, resume it with the code that wrote it")


def base_type(name):
    """int for `int | None`, and so on."""
    t = FIELDS[name].type
    return next(a for a in t.__args__ if a is not type(None)) if isinstance(t, types.UnionType) else t


def parse_value(name, value):
    """A field's value from its command-line string (non-strings pass)."""
    t = base_type(name)
    if not isinstance(value, str) or t is str:
        return value
    try:
        if t is bool:
            return _bool(value)
        return t(value)
    except (ValueError, argparse.ArgumentTypeError):
        raise SystemExit(f"--{flag(name)} expects {t.__name__}, got {value!r}") from None


def flag(name):
    return name.replace("_", "-")


def add_arguments(parser):
    """One flag per field, --field-name VALUE; booleans also bare (--pack) and negated (--no-pack). Defaults are
    left out of the namespace, so what a command line gave is exactly what it holds (given())."""
    for name, f in FIELDS.items():
        meta, t = f.metadata, base_type(name)
        kw = dict(dest=name, default=argparse.SUPPRESS, help=meta.get("help"))
        if t is bool:
            parser.add_argument(f"--{flag(name)}", nargs="?", const=True, type=_bool, metavar="BOOL", **kw)
            parser.add_argument(f"--no-{flag(name)}", action="store_const", const=False, dest=name,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            parser.add_argument(f"--{flag(name)}", type=t, choices=meta.get("choices"),
                                metavar=None if meta.get("choices") else t.__name__.upper(), **kw)


def _bool(value):
    if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError(f"expects true/false, got {value!r}")
    return value.lower() in ("1", "true", "yes")


def given(namespace):
    """{field: value} of the Config fields a parsed command line holds (add_arguments' flags)."""
    return {k: v for k, v in vars(namespace).items() if k in FIELDS}


def summary(cfg):
    """A run's config in a line: its preset and each field that differs from it (the whole: run_config.json)."""
    diff = changes(resolve(cfg.preset), cfg) if cfg.preset in PRESETS else []
    return f"preset {cfg.preset}" + "".join(f", {k} {v}" for k, _, v in diff)


def changes(old, new, names=None):
    """[(field, old value, new value)] where two Configs differ, over `names` (default: every field)."""
    return [(k, getattr(old, k), getattr(new, k)) for k in names or FIELDS if getattr(old, k) != getattr(new, k)]


# Ranges of the run's numbers: (fields, lowest allowed, what it means). Non-finite numbers never pass, None (not
# given) always does.
RANGES = [
    (("steps", "lr_warmup_iters", "save_every", "keep_last", "max_skipped_steps", "eval_every",
      "moe_stats_every", "lora_rank", "num_workers", "mock_num_samples", "seed", "num_nextn_predict_layers",
      "video_temporal_patch", "max_frames", "class_token_len", "min_num_patches", "max_num_patches"), 0,
     ">= 0"),
    (("global_batch", "micro_batch", "lr_decay_iters", "lr_wsd_decay_iters", "log_every", "eval_samples", "seq_len",
      "vision_tp", "vision_dp", "lm_tp", "lm_dp", "lm_ep", "lm_etp", "lm_cp", "lm_pp", "moe_latent_size", "mtp_depths",
      "video_target_patches", "mock_image_size", "vocab_size", "hidden_size", "vit_hidden", "vit_depth", "vit_heads",
      "vit_mlp", "vit_patch", "vit_cpe_grid", "projector_hidden"), 1, ">= 1"),
    (("lr", "min_lr", "weight_decay", "moe_aux_loss_coeff", "moe_bias_update_rate", "eval_frac", "mock_text_only_frac",
      "mtp_loss_scale", "video_fps"), 0.0, ">= 0"),
    (("collective_timeout",), 1.0, ">= 1 (seconds)"),
]
POSITIVE = ("lora_alpha", "norm_eps", "init_std", "routed_scaling_factor")   # finite and > 0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# What the config and layout checks know of each layer kind (a hybrid_override_pattern character; its code and what
# the plan counts of it: model.KINDS): its sizes, each >= 1 where the model has such a layer (an HF model without
# attention may leave the attention sizes at 0: a zero divides by zero, reshapes into nothing or trains a degenerate
# model); what must be a multiple of what (heads of KV groups, Mamba heads of groups); the sizes tp splits; its
# name in an HF config (transformers 5.x layers_block_type)
LAYER_KINDS = {
    "M": dict(sizes=("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "chunk_size"),
              multiple=("mamba_num_heads", "n_groups"), tp=("mamba_num_heads", "n_groups"), hf="linear_attention"),
    "*": dict(sizes=("num_attention_heads", "num_key_value_heads", "head_dim"),
              multiple=("num_attention_heads", "num_key_value_heads"),
              tp=("num_attention_heads", "num_key_value_heads"), hf="full_attention"),
    "E": dict(sizes=("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "moe_shared_expert_intermediate_size"), tp=("moe_shared_expert_intermediate_size",), hf="moe"),
    "-": dict(sizes=("intermediate_size",), tp=("intermediate_size",), hf="mlp"),
}


@functools.lru_cache(maxsize=256)   # layout.py's chooser asks for thousands of layouts on a large world (remedy)
def nearest_divisors(sizes, k, most):
    """'a or b': the numbers nearest k that divide every one of `sizes`, one below k and one above it up to `most`
    (where there is one; 1 always divides)."""
    fits = [next((d for d in range(min(k, most + 1) - 1, 0, -1) if all(n % d == 0 for n in sizes)), None),
            next((d for d in range(k + 1, most + 1) if all(n % d == 0 for n in sizes)), None)]
    return " or ".join(str(d) for d in fits if d)


def check(cfg):
    """Every field's constraints, at once: its choices (argparse checks a flag's; a record's are checked here), the
    run's numbers (RANGES, POSITIVE, min_lr <= lr, fractions below 1, the --train-layers and --lora-targets regexes)
    and the model's shape: every size of its kinds' layers and what must divide what (LAYER_KINDS), top-k within
    the experts, the patch budget (layout constraints live in layout.py). One SystemExit line names every offender."""
    layers = cfg.hybrid_override_pattern + (cfg.mtp_pattern if cfg.num_nextn_predict_layers else "")
    ranges = RANGES + [(f["sizes"], 1, ">= 1") for kind, f in LAYER_KINDS.items() if kind in layers]
    errors = [f"--{flag(k)} {getattr(cfg, k)}: must be a finite number {what}" for names, low, what in ranges
              for k in names if getattr(cfg, k) is not None and not (math.isfinite(getattr(cfg, k)) and
                                                                      getattr(cfg, k) >= low)]
    errors += [f"--{flag(k)} {getattr(cfg, k)}: must be a finite number > 0" for k in POSITIVE
               if not (math.isfinite(getattr(cfg, k)) and getattr(cfg, k) > 0)]
    errors += [f"--{flag(k)} {getattr(cfg, k)!r}: must be one of {', '.join(map(str, f.metadata['choices']))}"
               for k, f in FIELDS.items() if getattr(cfg, k) not in f.metadata.get("choices", (getattr(cfg, k),))]
    if cfg.collective_timeout > MAX_TIMEOUT_S:   # torch's own timeouts (watchdog.backstop) overflow far above
        errors.append(f"--collective-timeout {cfg.collective_timeout}: must be at most {MAX_TIMEOUT_S:g} s (a week)")
    if cfg.clip_grad < 0 or not math.isfinite(cfg.clip_grad):
        errors.append(f"--clip-grad {cfg.clip_grad}: must be >= 0 (0 turns clipping off)")
    if 0 <= cfg.lr < math.inf and 0 <= cfg.min_lr < math.inf and cfg.min_lr > cfg.lr:
        errors.append(f"--min-lr {cfg.min_lr}: must not exceed --lr {cfg.lr} (the schedule decays from --lr to it)")
    errors += [f"--{flag(k)} {getattr(cfg, k)}: must be below 1 (a fraction)"
               for k in ("eval_frac", "mock_text_only_frac") if getattr(cfg, k) >= 1]
    for k in ("train_layers", "lora_targets"):   # matching nothing: memory.sizing_model, lora.apply
        try:
            re.compile(getattr(cfg, k) or "")
        except re.error as e:
            errors.append(f"--{flag(k)} {getattr(cfg, k)!r}: not a regular expression ({e})")
    errors += [f"{k} may only hold {' '.join(LAYER_KINDS)}, got {getattr(cfg, k)!r}"
               for k in ("hybrid_override_pattern", "mtp_pattern")
               if set(getattr(cfg, k)) - set(LAYER_KINDS) or not getattr(cfg, k)]
    if cfg.mtp_depths and not cfg.num_nextn_predict_layers:
        errors.append(f"--mtp-depths {cfg.mtp_depths}: the model has no MTP block (num_nextn_predict_layers 0)")
    multiples = [(kind, *f["multiple"]) for kind, f in LAYER_KINDS.items() if "multiple" in f]
    for kind, whole, part in multiples + [("", "vit_hidden", "vit_heads")]:   # "": the tower, always
        n, k = getattr(cfg, whole), getattr(cfg, part)
        if kind in layers and n > 0 and k > 0 and n % k:
            errors.append(f"{whole} must be a multiple of {part} ({n} and {k}: --{flag(part)} "
                          f"{nearest_divisors((n,), k, n)} would do)")
    if "E" in layers and cfg.num_experts_per_tok > cfg.n_routed_experts > 0:
        errors.append(f"--num-experts-per-tok {cfg.num_experts_per_tok}: must be at most n_routed_experts "
                      f"{cfg.n_routed_experts} (each token picks that many different experts)")
    if 0 < cfg.max_num_patches < cfg.min_num_patches:
        errors.append(f"--max-num-patches {cfg.max_num_patches}: must be 0 (no maximum) or at least --min-num-patches "
                      f"{cfg.min_num_patches}")
    if cfg.video_temporal_patch == 1:   # transformers tells tubelets from images by their channel count
        errors.append("--video-temporal-patch 1: must be 0 (no video embedder) or at least 2")
    if not 0 <= cfg.image_token_id < cfg.vocab_size:
        errors.append("image_token_id must be a valid token id")
    if errors:
        raise SystemExit("; ".join(errors))
