"""The modules a rank starts from, built without an fp32 copy of the model (docs/memory.md §5): made on the meta
device, then each parameter allocated in the dtype it trains in and drawn by name at full shape, this rank's slice
copied out (comm.init_shard): the same initial values in any layout.
"""
import torch
import torch.nn as nn

import comm
import lora
import model
import optim
from radio import SEED as VISION_SEED, VisionModel, rule as vision_rule


def build(cfg, par, device, skip=frozenset()):
    """{"vision" | "language": module} of the modules this rank of `par` holds, on `device`; `skip`: full names
    ("language.lm_head.weight") left to a load, allocated and not drawn. Buffers are zeros."""
    with torch.device("meta"):
        modules = {}
        if par.in_vision:
            modules["vision"] = VisionModel(cfg, par.vision.tp)
        if par.in_lm:
            split = par.layout.lm_split if par.layout else ()   # one_device(): no layout, one stage
            modules["language"] = model.LanguageModel(cfg, {"tp": par.lm.tp, "cp": par.lm.cp, "ep": par.lm.ep,
                                                            "etp": par.lm.etp}, cfg.moe_dispatcher,
                                                      (par.lm.pp_rank, par.lm.pp_size), split)
        model.set_trainable(modules, cfg.stage, cfg.train_layers)
        if cfg.lora_rank:   # adapters only: everything else frozen
            lora.apply(modules, cfg, par)
    dtypes = optim.weight_dtypes(par, modules.get("vision"), modules.get("language"), cfg, device)
    for key, module in modules.items():
        ranks, sizes = (par.vision if key == "vision" else par.lm).shards()
        for name, p in module.named_parameters():
            real = nn.Parameter(torch.empty(p.shape, dtype=dtypes[id(p)], device=device), p.requires_grad)
            real.__dict__.update(p.__dict__)   # shards, tp_partial
            torch.utils.swap_tensors(p, real)  # the same Python object: every reference to it stays valid
            if f"{key}.{name}" in skip:
                continue
            if "lora_" in name:
                comm.init_shard(p, f"{key}.{name}", cfg.seed + lora.SEED, lora.rule(name), ranks, sizes, "cpu")
            elif key == "vision":
                comm.init_shard(p, name, cfg.seed + VISION_SEED, vision_rule(name, cfg.vit_hidden), ranks, sizes, "cpu")
            else:
                comm.init_shard(p, name, cfg.seed + model.SEED, model.rule(name, cfg), ranks, sizes, device)
        for b in module.buffers():
            torch.utils.swap_tensors(b, torch.zeros(b.shape, dtype=b.dtype, device=device))
    return modules
