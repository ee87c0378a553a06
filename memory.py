"""The memory plan: bytes per rank of weights, gradients, optimizer state and the activations of the micro-batches
in flight, for the vision and the language rank kinds of a layout, the latter per pipeline stage
(`train.py --dry-run [--world-size N]`), and the fit rule (required(), fits()) by which chooser.py chooses a layout,
or warns of one, before anything is built.

Per trained parameter (its local slice: / tp, / (ep x etp) for experts), on CUDA, in bytes (optim.py):
  distributed optimizer        weights 2 (bf16)  gradient 4 (fp32 main_grad)  optimizer 12 / d (fp32 main + moments)
                               where optim.fp32_weights: weights 4 (they are the main weights)  optimizer 8
  --no-distributed-optimizer   weights 4         gradient 4                   optimizer 8, and 2 more while a
                               micro-batch runs: the bf16 copy autocast makes of the weight and keeps for backward
d: the parameter's data-parallel group (vision dp, language dp x cp, edp). Frozen: 2 (bf16; 4 with the plain
optimizer). With --lora-rank the base is frozen and the adapters (lora.py) are the trained parameters.
CPU runs keep fp32 weights.
Activations: what autograd keeps for backward, counted per layer from the code (model.py, mamba.py, moe.py,
radio.py), in bf16 with T = micro_batch x seq_len / cp tokens per language rank; with --activation-checkpointing
only each layer's input plus one layer's worth during its recompute. MoE assumes balanced routing (T x k / tp rows
a rank). Context parallelism adds attention's whole-row K and V and the largest exchange's buffers (docs/cp.md).
Pipeline stages (model.stage_layers): a stage holds its layers' parameters (the first the embedding, the last
norm_f, lm_head and MTP), its dp and edp domains are its own, and 1F1B keeps several micro-batches' activations
(plan()). Peak = weights + gradients + optimizer + activations + cuBLAS' workspaces (the distributed optimizer's
fp32 gradient buffers are persistent; plain AdamW's gradients live from the first backward to the step, across all
micro-batches). Set-up, apart (docs/memory.md §5): the weights plus one full-size fp32 draw of the largest language
parameter (the tower and the adapters are drawn on the CPU); optim.build's buffers and main weights come after the
draw is freed, in the training peak. Checked on the GPU by bench/memory_check.py and tests/test_gpu.py.
"""
import json
import math
import os

import numpy as np
import torch

import comm
import config
import data
import lora
import model
import optim
import radio
import video
from radio import VisionModel

GIB = 2 ** 30
TRAIN_SHARE, SETUP_SHARE = 0.92, 0.95   # of a rank's memory the training and the set-up peak may use (required())
# cuBLAS and cuBLASLt each hold a 32 MiB workspace (Hopper's size) from the caching allocator, per stream they run on
BLAS_WORKSPACES = 2 * 32 * 2 ** 20
LIMITS = (("peak", TRAIN_SHARE, "training peak (weights, gradients, optimizer state, activations)"),
          ("setup", SETUP_SHARE, "set-up peak (the weights and one full-size fp32 draw)"))


def sizing_model(cfg):
    """The whole model on the meta device (no memory, no init) with this run's trainable parameters: --stage or
    --train-layers, and --lora-rank's adapters. A --train-layers regex that trains nothing is refused here, on the
    whole model (a hetero rank holds only part of it)."""
    with torch.device("meta"):
        modules = {"vision": VisionModel(cfg), "language": model.LanguageModel(model.planned(cfg))}
        model.set_trainable(modules, cfg.stage, cfg.train_layers)
        if cfg.lora_rank:
            lora.apply(modules, cfg)
    if cfg.train_layers is not None and not any(p.requires_grad for m in modules.values() for p in m.parameters()):
        names = [f"{k}.{n}" for k, m in modules.items() for n, _ in m.named_parameters()]
        raise SystemExit(f"--train-layers {cfg.train_layers!r} matches no parameter, so nothing would train; "
                         f"names look like {names[0]} or {names[-1]}")
    return modules


@config.per_config
def parameter_counts(cfg):
    """({"vision": {(expert, etp-sharded, tp-sharded, trained): parameters}, "language": [(place, that group,
    parameters)] a parameter each, place: its decoder layer, -1 for the embedding, the layer count for the rest
    (norm_f, lm_head, MTP)}, whether the tower trains: model.tower_trains) of the whole sizing model: all a layout's
    plan needs of the model. Cached: the layout chooser plans dozens of layouts of one cfg."""
    modules, n = sizing_model(cfg), len(cfg.hybrid_override_pattern)
    counts = {"vision": {}, "language": []}
    for kind, module in modules.items():
        for name, p in module.named_parameters():
            kinds = comm.shard_kinds(p)
            g = ("ep" in kinds, "etp" in kinds, "tp" in kinds, p.requires_grad)
            if kind == "vision":
                counts[kind][g] = counts[kind].get(g, 0) + p.numel()
            else:
                place = (int(name.split(".")[2]) if name.startswith("backbone.layers.") else
                         -1 if name.startswith("backbone.embeddings.") else n)
                counts[kind].append((place, g, p.numel()))
    return counts, model.tower_trains(modules["vision"])


@config.per_config
def stage_counts(cfg, pp, split=()):
    """Per pipeline stage of pp (model.stage_layers): ({group: parameters} of the language parameters it holds,
    its largest parameter). The embedding is on the first stage, norm_f, lm_head and MTP on the last."""
    where = {i: s for s, r in enumerate(model.stage_layers(cfg, pp, split)) for i in r}
    groups, largest = [{} for _ in range(pp)], [0] * pp
    for place, g, numel in parameter_counts(cfg)[0]["language"]:
        s = where.get(place, 0 if place < 0 else pp - 1)
        groups[s][g] = groups[s].get(g, 0) + numel
        largest[s] = max(largest[s], numel)
    return list(zip(groups, largest))


def local_parameters(cfg, lay, stage=0):
    """(module kind, expert, trained, parameters, data-parallel size) per parameter group of one rank of `lay`
    (of the language model, one of pipeline stage `stage`): the local slice (/ tp, / (ep x etp) for experts) and
    the size of the group its gradient is summed over (its optimizer domain: vision dp (x cp colocated), the
    stage's language dp x cp, its edp)."""
    counts = parameter_counts(cfg)[0]
    language = stage_counts(cfg, lay.lm_pp, lay.lm_split)[stage][0]
    for kind, groups in (("vision", counts["vision"]), ("language", language)):
        tp = lay.vision_tp if kind == "vision" else lay.lm_tp
        for (expert, etp_sharded, tp_sharded, trained), numel in groups.items():
            n = numel / (lay.lm_ep * (lay.lm_etp if etp_sharded else 1) if expert else tp if tp_sharded else 1)
            yield kind, expert, trained, n, (lay.vision_dp * lay.vision_cp if kind == "vision" else lay.lm_edp if expert
                                             else lay.lm_dp * lay.lm_cp)


def parameter_bytes(cfg, lay, cuda=True, stage=0):
    """{"vision" | "language": {"weights", "gradients", "optimizer", "activations", "setup"}} bytes of one rank of
    that module (of the language model, one of pipeline stage `stage`); activations: the bf16 copies autocast
    keeps of fp32 weights (plain AdamW on CUDA). setup: the set-up peak (init.py): the weights, and for the
    language model the one full-size fp32 tensor of its (stage's) largest parameter's draw (on the device; the
    tower is drawn on the CPU)."""
    distributed = cfg.distributed_optimizer
    out = {kind: {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0, "setup": 0.0}
           for kind in ("vision", "language")}
    # the sizing model's parameters are full size
    out["language"]["setup"] = 4 * stage_counts(cfg, lay.lm_pp, lay.lm_split)[stage][1]
    for kind, expert, trained, n, d in local_parameters(cfg, lay, stage):
        b = out[kind]
        fp32 = trained and optim.fp32_weights(distributed, d, expert, cuda, cfg.activation_checkpointing)
        bf16 = distributed and cuda and not fp32
        b["weights"] += n * (2 if bf16 else 4)
        b["setup"] += n * (2 if bf16 else 4)
        if trained:
            b["gradients"] += n * 4
            b["optimizer"] += n * (8 if fp32 else 12 / d)
            b["activations"] += n * 2 if cuda and not distributed else 0
    return out


def language_activation_bytes(cfg, lay, stage=0):
    """(kept, passing): bytes one micro-batch of one language rank (of pipeline stage `stage`) keeps from its
    forward to its backward, and bytes alive only while a backward runs (a layer's recompute, the logits' gradient,
    cp's exchange buffers, the gradient of a stage's outputs). Under context parallelism a rank holds T / cp tokens,
    except for attention's gathered whole-row K and V, and the largest exchange's send and receive buffers (cp.py).
    A stage but the last keeps the outputs it sent on (pipeline.py) and receives their gradient; with MTP the
    decoder input travels beside them, kept by every stage but the first (there it is the first layer's input)."""
    cp, checkpointing = lay.lm_cp, cfg.activation_checkpointing
    T, D, tp = lay.micro_batch * cfg.seq_len // cp, cfg.hidden_size, lay.lm_tp
    block = 2 * T * D + 4 * T                                   # the norm's input (the residual) and rstd
    first, last = stage == 0, stage == lay.lm_pp - 1
    r = model.stage_layers(cfg, lay.lm_pp, lay.lm_split)[stage]
    pattern, mtp = cfg.hybrid_override_pattern[r.start:r.stop], model.mtp_depths(cfg)
    depths = mtp if last else 0      # MTP: each depth's block layers, its eh_proj input and rolled embedding, head
    facts = {k: model.kind_facts(cfg, k, cfg.seq_len, T, tp, cp, lay.lm_ep, lay.lm_etp)
             for k in set(pattern + cfg.mtp_pattern)}
    layers = [block + facts[k]["saved"] for k in pattern + cfg.mtp_pattern * depths]
    kept = len(layers) * 2 * T * D if checkpointing else sum(layers)   # checkpointing: each layer's input, and
    recompute = max(layers) if checkpointing else 0                    # the one being recomputed
    exchange = max(facts[k]["exchange"] for k in pattern) if cp > 1 else 0   # the largest one's buffers
    stream = 2 * T * D * (1 + (mtp > 0))   # what a stage sends on: the residual stream (and the decoder input)
    if not last:
        return kept + 2 * T * D + 2 * T * D * (mtp > 0 and not first), recompute + stream + exchange
    chunked = checkpointing and T > model.CE_CHUNK       # model.loss_sum's chunks
    logits = 2 * (model.CE_CHUNK if chunked else T) * cfg.vocab_size / tp
    head = 2 * 2 * T * D + (0 if chunked else logits + 8 * T)   # norm_f and lm_head inputs (logits, lse: unchunked)
    # + the logits' gradient at backward (chunked: with the recomputed chunk's logits)
    return (kept + (1 + depths) * head + depths * 2 * T * 3 * D + 2 * T * D * (mtp > 0 and not first),
            recompute + (2 if chunked else 1) * logits + exchange)


def vision_items(cfg):
    """The patch grids (h, w, frames) one mock sample brings the tower: its square image, or, with a video embedder
    when more tokens, as many tubelets of a square video's canvas as its seq_len holds."""
    side = cfg.mock_image_size // cfg.vit_patch
    items = [(side, side, 1)]
    if cfg.video_temporal_patch:
        th, tw = video.canvas(1, 1, cfg.video_target_patches)
        tubelets = [(th, tw, cfg.video_temporal_patch)] * (cfg.seq_len // (th * tw // 4))
        items = max(items, tubelets, key=lambda its: sum(h * w for h, w, _ in its))
    return items


def mock_load(cfg):
    """The mock sample's tower load (vision_items) in tower_load's form: (tower tokens, projector rows, what)."""
    items = vision_items(cfg)
    what = f"{len(items)} video tubelets" if items[0][2] > 1 else f"{cfg.mock_image_size} px square image"
    return (sum(h * w + cfg.class_token_len for h, w, _ in items), sum(h * w // 4 for h, w, _ in items),
            f"the mock's {what}")


def tower_load(ds, cfg):
    """(tower tokens, projector rows, what bounds them) of the largest sample training data `ds` can produce: the
    plan's vision load (None for the mock: mock_load). From the index (formats.index_file): an image of h x w patches
    is h*w/4 placeholders and h*w + class_token_len tower tokens (a video tubelet alike). Unpacked, a sample is one
    document: the largest. Packed, a row is documents of one source whose lengths add up to at most seq_len, none
    twice (a row packs one window of one epoch: data.RealData.window): bounded by filling seq_len with the documents
    of the most tokens per token, the last in part (a fractional knapsack)."""
    if not isinstance(ds, data.RealData):
        return None
    K, most = cfg.class_token_len, [0, 0]
    for _, _, idx in ds.sources:
        lengths = idx["lengths"].astype(np.float64)
        for k, value in enumerate((4 * idx["image_tokens"] + K * idx["images"], idx["image_tokens"])):
            if not ds.pack:
                most[k] = max(most[k], int(value.max()))
                continue
            order = np.argsort(-value / lengths, kind="stable")
            v, n = value[order].astype(np.float64), lengths[order]
            whole = int(np.searchsorted(np.cumsum(n), cfg.seq_len, side="right"))   # documents that fit in whole
            part = (cfg.seq_len - n[:whole].sum()) / n[whole] * v[whole] if whole < len(v) else 0.0
            most[k] = max(most[k], math.ceil(v[:whole].sum() + part))
    what = "the densest seq_len of packed documents its index holds" if ds.pack else "its largest document"
    return most[0], most[1], f"--data {cfg.data}: {what}"


def vision_tokens(cfg, lay, load=None):
    """(tower tokens, projector tokens) of one micro-batch of one vision rank: per sample, `load`'s (tower_load:
    the largest sample the data can produce; None: the mock's)."""
    tower, rows, _ = load or mock_load(cfg)
    return lay.vision_micro_batch * tower, lay.vision_micro_batch * rows


def load_source(cfg, load=None):
    """What the plan's tower load is, in words (the dry run's line)."""
    tower, rows, what = load or mock_load(cfg)
    return f"{tower} tower tokens and {rows} image rows a sample at most ({what})"


def tower_trains(cfg):
    """Whether the tower runs a backward (and so keeps activations, and on tp > 1 all-reduces its gradients)."""
    return parameter_counts(cfg)[1]


def vision_activation_bytes(cfg, lay, load=None):
    """Bytes autograd keeps for one micro-batch of one vision rank (its samples: vision_tokens; radio.facts)."""
    return radio.facts(cfg, *vision_tokens(cfg, lay, load), lay.vision_tp, tower_trains(cfg))["saved"]


def plan(cfg, lay, cuda=True, load=None):
    """{row: {weights, gradients, optimizer, activations, setup, workspace, peak}} bytes per rank kind: "vision" and
    "language", or with pipeline stages "language pp0", "language pp1", ... (colocated: both modules on every rank,
    each row both; at pp 1 the two rows the same, beyond it one a stage). 1F1B (schedule.py): stage s of p keeps
    the activations of min(p - s, n) of the n micro-batches, the encoder min(p + 1, n) (it runs p forwards ahead);
    in place, the language backward runs the encoder's, so it keeps one beside the language model's; on its own
    lanes, one more while its next forward runs before the language model's. load: the data's tower load
    (vision_tokens; None: the mock's)."""
    p, n = lay.lm_pp, lay.num_microbatches
    vision, out = vision_activation_bytes(cfg, lay, load), {}
    # off the encoder's ranks, the first stage keeps the image rows the bridge hands it until their gradient returns
    received = 0 if lay.in_place else 2 * lay.micro_batch * (load or mock_load(cfg))[1] * cfg.hidden_size
    for s in range(p):
        rows = parameter_bytes(cfg, lay, cuda, s)   # setup: apart from the training peak
        kept, passing = language_activation_bytes(cfg, lay, s)
        if s == 0:
            kept, passing = kept + received, passing + received   # the rows and, at backward, their gradient
        language = min(p - s, n) * kept + passing
        if lay.colocated:
            row = {key: rows["vision"][key] + rows["language"][key] for key in rows["vision"]}
            row["activations"] += vision + language if lay.in_place else max(
                min(p + 1, n) * vision + min(p - s - 1, n - 1) * kept, min(p, n) * vision + language)
            if p == 1:
                out["vision"] = dict(row)
        else:
            row = rows["language"]
            row["activations"] += language
            if s == 0:
                rows["vision"]["activations"] += min(p + 1, n) * vision
                out["vision"] = rows["vision"]
        out["language" if p == 1 else f"language pp{s}"] = row
    for r in out.values():
        r["workspace"] = BLAS_WORKSPACES if cuda else 0
        r["peak"] = r["weights"] + r["gradients"] + r["optimizer"] + r["activations"] + r["workspace"]
    return out


def figure(x, places=2):
    """x to `places` decimals, or to 2 significant digits where that would print 0 (a tiny model's GiB and
    seconds)."""
    return f"{x:.{places}f}" if x == 0 or abs(x) >= 10 ** -places else f"{x:.2g}"


def capacity(device):
    """Bytes of memory one rank has: its GPU's (the share torch.cuda.set_per_process_memory_fraction allows: a larger
    card held to a smaller one's memory), or on the CPU the machine's RAM shared by the local ranks."""
    if device.type == "cuda":
        share = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
        return torch.cuda.get_device_properties(device).total_memory * share
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def required(rows):
    """The memory per rank a plan (plan()'s rows, or some of them) needs: its training peak may use 92 % of a rank's
    memory (the plan runs 1-2 % above measured peaks, bench/memory_check.py: about 90 % is really used, the rest is
    the allocator's), its set-up peak 95 % (a few large allocations, little fragmentation). An "80 GB" H100 has
    79.2 GiB: nano on 8 of them plans 71.3 GiB, 90.0 % of it."""
    return max(r[key] / share for r in rows.values() for key, share, _ in LIMITS)


def fits(rows, capacity):
    """None when a plan fits `capacity` bytes per rank (required()), else the figure that does not, in words: which
    peak, its value, and the share of the rank's memory it may use."""
    for key, share, what in LIMITS:
        need = max(r[key] for r in rows.values())
        if need > share * capacity:
            return (f"{figure(need / GIB, 1)} GiB per rank at its {what}, over the {100 * share:.0f} % of the "
                    f"{figure(capacity / GIB, 1)} GiB a rank has that it may use")
    return None


def dry_run(cfg, lay, capacity, predicted, load=None, basis=None):
    """Print the config, the layout, the plan per rank kind (GiB) and whether each kind fits `capacity` bytes per
    rank, then one JSON line (the last line); `predicted`: the layout's cost.step_seconds; load: the data's tower
    load (plan()); basis: what the prediction read, in words (cost.basis)."""
    (total_lm, active_lm), (total_mtp, _) = model.count_language_params(cfg), model.count_language_params(cfg, True)
    with torch.device("meta"):
        n_vision = sum(p.numel() for p in VisionModel(cfg).parameters())
    print("config:", json.dumps(vars(cfg)))
    print(lay.describe())
    rows = plan(cfg, lay, load=load)
    opt = "distributed optimizer, bf16 weights" if cfg.distributed_optimizer else "plain AdamW, fp32 weights"
    print(f"memory plan per rank on CUDA ({opt}; micro-batch {lay.micro_batch} x seq_len {cfg.seq_len}, "
          f"activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}; the tower: "
          f"{load_source(cfg, load)}; setup: the set-up peak, the weights and one full-size fp32 draw, over before "
          "the first step), GiB:")
    if lay.colocated and lay.lm_pp > 1:
        print("  (each rank holds the tower and its language stage: each row both)")
    width = max(map(len, rows))
    for kind, r in rows.items():
        print(f"  {kind:{width}s} " + "  ".join(f"{k} {figure(v / GIB)}" for k, v in r.items()))
    fit = {kind: fits({kind: r}, capacity) is None for kind, r in rows.items()}
    stages = f" (the slowest of {lay.lm_pp} stages)" if lay.lm_pp > 1 else ""
    print(f"predicted on Hopper GPUs (cost.py{', for ' + basis if basis else ''}): {figure(predicted['step'])} s a "
          f"step (a micro-batch: vision {figure(predicted['vision'], 3)} s, language "
          f"{figure(predicted['language'], 3)} s{stages}; tail {figure(predicted['tail'], 3)} s; bubble "
          f"{100 * predicted['bubble']:.0f} %: the slowest rank idle, filling and draining the pipe)")
    print(f"against {figure(capacity / GIB, 1)} GiB per rank (the training peak may use {100 * TRAIN_SHARE:.0f} % of "
          f"it, the set-up peak {100 * SETUP_SHARE:.0f} %):")
    for kind, r in rows.items():
        print(f"  {kind:{width}s} {'fits' if fit[kind] else 'does NOT fit'} {figure(capacity / GIB, 1)} GiB: peak "
              f"{figure(r['peak'] / GIB)} GiB ({100 * r['peak'] / capacity:.0f} %), setup "
              f"{figure(r['setup'] / GIB)} GiB ({100 * r['setup'] / capacity:.0f} %)")
    print(json.dumps({"params_total": total_lm + total_mtp + n_vision, "params_active": active_lm + n_vision,
                      "params_vision": n_vision, "params_language": total_lm, "params_mtp": total_mtp,
                      "layout": lay.describe(),
                      "gib_per_rank": {k: {key: round(v / GIB, 2) for key, v in r.items()} for k, r in rows.items()},
                      "peak_gib_per_rank": {k: round(r["peak"] / GIB, 2) for k, r in rows.items()},
                      "capacity_gib": round(capacity / GIB, 2), "fits": fit, "tower_load": load_source(cfg, load),
                      "predicted_s": {k: round(v, 4) for k, v in predicted.items()}, "predicted_for": basis}))
