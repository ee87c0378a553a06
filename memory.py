"""The memory plan: bytes per rank of weights, gradients, optimizer state and the activations of one micro-batch,
for the vision and the language rank kinds of a layout (`train.py --dry-run [--world-size N]`), and the fit check
train.py runs before building anything.

Per trained parameter (its local slice: / tp, / (ep x etp) for experts), on CUDA, in bytes (optim.py):
  distributed optimizer        weights 2 (bf16)  gradient 4 (fp32 main_grad)  optimizer 12 / d (fp32 main + moments)
                               where optim.fp32_weights: weights 4 (they are the main weights)  optimizer 8
  --no-distributed-optimizer   weights 4         gradient 4                   optimizer 8, and 2 more while a
                               micro-batch runs: the bf16 copy autocast makes of the weight and keeps for backward
d: the parameter's data-parallel group (vision dp, language dp, edp). Frozen: 2 (bf16; 4 with the plain optimizer).
With --lora-rank the base is frozen and the adapters (lora.py) are the trained parameters.
CPU runs keep fp32 weights.
Activations: what autograd keeps for backward, counted per layer from the code (model.py, mamba.py, moe.py,
radio.py), in bf16 with T = micro_batch x seq_len tokens per language lane; with --activation-checkpointing only each
layer's input plus one layer's worth during its recompute. MoE assumes balanced routing (T x k / tp rows a rank).
Peak = weights + gradients + optimizer + activations (the distributed optimizer's fp32 gradient buffers are
persistent; plain AdamW's gradients live from the first backward to the step, across all micro-batches).
Set-up, apart (over before the first step): every local weight in fp32 before the bf16 cast, plus init's two
full-size fp32 draws of the largest language parameter. Checked on the GPU by bench/memory_check.py.
"""
import json
import os

import torch

import lora
import model
import optim
import parallel
from radio import VisionModel

GIB = 2 ** 30


def sizing_model(cfg, args):
    """The whole model on the meta device (no memory, no init) with this run's trainable parameters: --stage or
    --train-layers, and --lora-rank's adapters. A --train-layers regex that trains nothing is refused here, on the
    whole model (a hetero rank holds only part of it)."""
    with torch.device("meta"):
        modules = {"vision": VisionModel(cfg), "language": model.LanguageModel(cfg)}
        model.set_trainable(modules, args.stage, args.train_layers)
        if getattr(args, "lora_rank", 0):
            lora.apply(modules, args)
    if args.train_layers is not None and not any(p.requires_grad for m in modules.values() for p in m.parameters()):
        names = [f"{k}.{n}" for k, m in modules.items() for n, _ in m.named_parameters()]
        raise SystemExit(f"--train-layers {args.train_layers!r} matches no parameter, so nothing would train; "
                         f"names look like {names[0]} or {names[-1]}")
    return modules


def parameter_bytes(cfg, lay, args, distributed=True, cuda=True):
    """{"vision" | "language": {"weights", "gradients", "optimizer", "casts", "setup"}} bytes of one rank of that
    module. setup: the set-up peak, before optim.build casts to bf16: every local weight in fp32, and for the
    language model the two full-size fp32 tensors model.init_weights holds while it draws its largest parameter
    (randn, then scaled; on the device: the tower is drawn on the CPU)."""
    modules = sizing_model(cfg, args)
    out = {}
    for kind, module in modules.items():
        tp = lay.vision_tp if kind == "vision" else lay.lm_tp
        b = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "casts": 0.0, "setup": 0.0}
        if kind == "language":
            b["setup"] = 8 * max(p.numel() for p in module.parameters())   # the sizing model's are full size
        for p in module.parameters():
            kinds = parallel.shard_kinds(p)
            expert = "ep" in kinds
            n = p.numel() / (lay.lm_ep * (lay.lm_etp if "etp" in kinds else 1) if expert else
                             tp if "tp" in kinds else 1)
            d = lay.vision_dp if kind == "vision" else lay.lm_edp if expert else lay.lm_dp
            fp32 = p.requires_grad and optim.fp32_weights(d, expert, cuda, args.activation_checkpointing)
            bf16 = distributed and cuda and not fp32
            b["weights"] += n * (2 if bf16 else 4)
            b["setup"] += n * 4
            if p.requires_grad:
                b["gradients"] += n * 4
                b["optimizer"] += n * (8 if fp32 or not distributed else 12 / d)
                b["casts"] += n * 2 if cuda and not distributed else 0
        out[kind] = b
    return out


def language_activation_bytes(cfg, lay, micro_batch, checkpointing):
    """Bytes autograd keeps for one micro-batch of one language rank, at the peak of its backward."""
    T, D, tp, etp = micro_batch * cfg.seq_len, cfg.hidden_size, lay.lm_tp, lay.lm_etp
    d_in, gn, H = cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    K, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    block = 2 * T * D + 4 * T                                   # the norm's input (the residual) and rstd
    mixer = {  # inputs of every matmul / kernel the mixer runs, as saved for backward, in bytes
        "M": 2 * T * D + 2 * T * (2 * d_in + 2 * gn + H) / tp + 2 * 2 * T * d_in / tp + 4 * T * cfg.n_groups / tp,
        "*": 2 * T * D + 2 * T * (nh + 2 * nkv) * hd / tp + 2 * 2 * T * nh * hd / tp + 4 * T * nh / tp,
        "-": 2 * T * D + 2 * 2 * T * cfg.intermediate_size / tp,
        "E": (2 * T * D + 4 * T * D + 4 * 2 * T * E                # input; fp32 router input, scores, sigmoid
              + 2 * 2 * T * cfg.moe_shared_expert_intermediate_size / tp
              + 2 * (T * K / tp) * etp * (2 * D + 2 * cfg.moe_intermediate_size / etp)   # rows in, out; up, act
              + 2 * T * D / tp + 2 * T * D),                        # combined rows, all-gathered over tp
    }
    layers = [block + mixer[k] for k in cfg.hybrid_override_pattern]
    logits = 2 * T * cfg.vocab_size / tp
    head = 2 * 2 * T * D + logits + 8 * T                       # norm_f and lm_head inputs, logits, lse
    if checkpointing:
        saved = len(layers) * 2 * T * D + max(layers)              # each layer's input + the one being recomputed
    else:
        saved = sum(layers)
    return saved + head + logits                                # + the logits' gradient, at the head's backward


def vision_activation_bytes(cfg, lay, stage, train_layers=None):
    """Bytes autograd keeps for one micro-batch of one vision rank (mock images: one per sample). A frozen tower
    keeps nothing (no input of it needs a gradient); the projector keeps its inputs."""
    samples = lay.vision_micro_batch
    side = cfg.mock_image_size // cfg.vit_patch
    S, Q = samples * (side * side + cfg.class_token_len), samples * side * side // 4
    C, tp = cfg.vit_hidden, lay.vision_tp
    projector = 4 * Q * 4 * C + 2 * Q * 4 * C + 2 * 2 * Q * cfg.projector_hidden
    tower_trains = stage == 3 or (train_layers is not None and "blocks" in train_layers)
    if not tower_trains:
        return projector
    per_block = 2 * S * C * 4 + 2 * S * (3 * C + C) / tp + 2 * 2 * S * cfg.vit_mlp / tp + 4 * S * cfg.vit_heads / tp
    # 1F1B keeps the encoder's activations of two micro-batches (forward m + 1 runs before backward m)
    return 2 * (cfg.vit_depth * per_block + projector)


def plan(cfg, lay, args, cuda=True):
    """{"vision" | "language": {weights, gradients, optimizer, activations, peak}} bytes per rank kind; colocated:
    both modules on every rank, both kinds the same."""
    distributed = not args.no_distributed_optimizer
    params = parameter_bytes(cfg, lay, args, distributed, cuda)
    act = {"vision": vision_activation_bytes(cfg, lay, args.stage, args.train_layers),
           "language": language_activation_bytes(cfg, lay, args.micro_batch, args.activation_checkpointing)}
    rows = {k: {"weights": params[k]["weights"], "gradients": params[k]["gradients"],
                "optimizer": params[k]["optimizer"], "activations": act[k] + params[k]["casts"],
                "setup": params[k]["setup"]} for k in params}   # setup: apart from the training peak
    if lay.colocated:
        both = {key: rows["vision"][key] + rows["language"][key] for key in rows["vision"]}
        rows = {"vision": both, "language": dict(both)}
    for r in rows.values():
        r["peak"] = r["weights"] + r["gradients"] + r["optimizer"] + r["activations"]
    return rows


def check_fits(cfg, lay, args, device):
    """Refuse a layout whose planned training peak exceeds 90 % of this device's memory (CPU: RAM / local ranks),
    or whose set-up peak exceeds 95 % (a few large allocations, little fragmentation; the Nano-shaped LoRA run set
    up at 127.88 GiB on one H200, which the 90 % bar would have refused)."""
    rows = plan(cfg, lay, args, cuda=device.type == "cuda")
    need, setup = max(r["peak"] for r in rows.values()), max(r["setup"] for r in rows.values())
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local
    if need > 0.9 * have or setup > 0.95 * have:
        what = (f"{need / GIB:.1f} GiB per rank (weights, gradients, optimizer state, activations)"
                if need > 0.9 * have else f"{setup / GIB:.1f} GiB per rank while it sets up (every weight is "
                                          f"initialised in fp32 before the bf16 cast)")
        raise SystemExit(f"error: this layout does not fit: {lay.describe()} needs {what}, a rank here has "
                         f"{have / GIB:.1f} GiB. Use more ranks (--lm-tp / --lm-ep / --vision-tp), "
                         f"--activation-checkpointing, a smaller preset (tiny, small), or see "
                         f"`--dry-run --world-size N` for the per-rank plan.")


def dry_run(cfg, lay, args):
    """Print the config, the layout, the plan per rank kind (GiB), then one JSON line (the last line)."""
    total_lm, active_lm = model.count_language_params(cfg)
    with torch.device("meta"):
        n_vision = sum(p.numel() for p in VisionModel(cfg).parameters())
    print("config:", json.dumps(vars(cfg)))
    print(lay.describe())
    rows = plan(cfg, lay, args)
    opt = "plain AdamW, fp32 weights" if args.no_distributed_optimizer else "distributed optimizer, bf16 weights"
    print(f"memory plan per rank on CUDA ({opt}; micro-batch {args.micro_batch} x seq_len {cfg.seq_len}, "
          f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}; setup: the set-up peak, "
          f"fp32 weights before the bf16 cast, over before the first step), GiB:")
    for kind, r in rows.items():
        print(f"  {kind:8s} " + "  ".join(f"{k} {v / GIB:.2f}" for k, v in r.items()))
    print(json.dumps({"params_total": total_lm + n_vision, "params_active": active_lm + n_vision,
                      "params_vision": n_vision, "params_language": total_lm, "layout": lay.describe(),
                      "gib_per_rank": {k: {key: round(v / GIB, 2) for key, v in r.items()} for k, r in rows.items()},
                      "peak_gib_per_rank": {k: round(r["peak"] / GIB, 2) for k, r in rows.items()}}))
