"""LoRA (docs/memory.md §3): W x + (alpha / r) * B (A x) with W frozen; the adapters shard like their frozen weight,
so any tp / ep layout computes the one-device function. Routed experts get one adapter pair per expert, applied
inside the grouped GEMM (moe.expert_ffn); a down projection after a squared ReLU has its A applied inside
moe.relu2_down, which recomputes the squared ReLU A reads. Every other parameter is frozen, the routers' expert
biases too, so the adapters alone (hf_peft.py) reproduce the run on the released weights.
"""
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

import comm
import moe

SEED = 40000   # offset of the adapters' init seed from --seed
TARGETS = r"(q_proj|k_proj|v_proj|o_proj|in_proj|out_proj|up_proj|down_proj|fc1_latent_proj|fc2_latent_proj)$"


def apply(modules, cfg, par=None):
    """Add cfg.lora_rank adapters to the layers of {"vision" | "language": module} that cfg.lora_targets matches,
    freeze everything else. Allocated, not drawn (init.py draws them). `par`: the run's layout, checked."""
    if (par is not None and par.lm is not None and par.lm.etp_size > 1) or cfg.moe_dispatcher != "alltoall":
        raise SystemExit("error: LoRA on routed experts needs --lm-etp 1 and the alltoall dispatcher. Drop "
                         "--lm-etp / --moe-dispatcher deepep.")
    targets, r, scale = re.compile(cfg.lora_targets or TARGETS), cfg.lora_rank, cfg.lora_alpha / cfg.lora_rank
    layers = {}   # the names that take adapters, a layer index as N: {all but the last part: {last parts}}
    for key, module in modules.items():
        for p in module.parameters():
            p.requires_grad_(False)
        for name, sub in list(module.named_modules()):
            full = f"{key}.{name}" + ".up_proj" * isinstance(sub, moe.Experts)
            if isinstance(sub, (nn.Linear, moe.Experts)):
                head, _, last = re.sub(r"\.\d+\.", ".N.", full).rpartition(".")
                layers.setdefault(head, {})[last] = None
            if isinstance(sub, nn.Linear) and targets.search(full):
                _attach_linear(sub, r, scale)
            elif isinstance(sub, moe.Experts) and targets.search(full):
                E, Fl, D = sub.up_proj.shape
                for proj, (n_in, n_out) in (("up", (D, Fl)), ("down", (Fl, D))):
                    a, b = nn.Parameter(torch.empty(E, r, n_in)), nn.Parameter(torch.zeros(E, n_out, r))
                    setattr(sub, f"lora_{proj}_A", comm.mark_shard(a, ("ep", 0, None)))
                    setattr(sub, f"lora_{proj}_B", comm.mark_shard(b, ("ep", 0, None)))
                sub.lora_scale = scale
    # judged on the whole model (memory.sizing_model's, which every rank builds first): a hetero rank holds a part
    if set(modules) == {"vision", "language"} and not any(p.requires_grad for m in modules.values()
                                                          for p in m.parameters()):
        raise SystemExit(f"--lora-targets {targets.pattern!r} matches no layer, so no adapter would train. The layers: "
                         + ", ".join(f"{head}.{next(iter(last))}" if len(last) == 1 else f"{head}.{{{','.join(last)}}}"
                                     for head, last in layers.items()))


def rule(name):
    """How adapter `name` is drawn, as comm.draw takes it: A uniform(+-1 / sqrt(fan_in)), B zeros."""
    if name.endswith("_A"):
        return lambda shape, gen: (torch.rand(shape, generator=gen) * 2 - 1) / math.sqrt(shape[-1])
    return lambda shape, gen: torch.zeros(shape)


def _attach_linear(lin, r, scale):
    out_f, in_f = lin.weight.shape
    lin.lora_A, lin.lora_B = nn.Parameter(torch.empty(r, in_f)), nn.Parameter(torch.zeros(out_f, r))
    tp = next((s for s in getattr(lin.weight, "shards", ()) if s[0] == "tp"), None)
    if getattr(lin.weight, "tp_partial", False):   # LatentMoE's projections: a token slice per tp rank
        lin.lora_A.tp_partial = lin.lora_B.tp_partial = True
    elif tp is not None and tp[1] == 0:     # column-parallel
        comm.mark_shard(lin.lora_B, tp)
        lin.lora_A.tp_partial = True
    elif tp is not None:                    # row-parallel
        comm.mark_shard(lin.lora_A, ("tp", 1, tp[2]))
        lin.lora_B.tp_partial = True
    lin.lora_scale = scale
    lin.register_forward_hook(add_adapter)


def add_adapter(lin, inputs, out):
    """out + scale * B (A x): an adapted Linear's forward hook; a caller that applies the weight itself (a
    row-parallel layer whose bias comes after the tp sum) calls it directly, before its reduce (moe.relu2_linear
    applies the same sum itself)."""
    if not hasattr(lin, "lora_A"):
        return out
    return out + F.linear(F.linear(inputs[0], lin.lora_A), lin.lora_B) * lin.lora_scale


def merge(state_dict, alpha):
    """{full name: full tensor} with adapters -> the same without them, each folded into its weight."""
    out = {k: v for k, v in state_dict.items() if "lora_" not in k}
    for k, a in state_dict.items():
        if k.endswith("_A") and ".lora_" in k:   # W += s B A: a Linear's lora_A, or per expert lora_up_A -> up_proj
            base, proj = k.rsplit(".lora_", 1)
            w, b = f"{base}.weight" if proj == "A" else f"{base}.{proj[:-2]}_proj", state_dict[k[:-1] + "B"]
            out[w] = (out[w].float() + alpha / a.shape[-2] * (b.float() @ a.float())).to(out[w].dtype)
    return out
