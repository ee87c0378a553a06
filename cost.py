"""The layout chooser's cost model: the predicted seconds of one training step of a layout on Hopper GPUs
(docs/layouts.md §1: how it is built and how far it holds).

Per micro-batch, on a rank of each module:
- compute: the module's FLOPs (model.py's counts) over its share of them (/ tp; the language model's / cp too) at
  a calibrated fraction of the bf16 peak;
- collectives: tp all-reduces of activations, ep all-to-alls of the routed rows, cp exchanges and the bridge's
  rows and their gradient where they travel: the bytes a rank sends at its link's bandwidth (NVLink inside a node,
  the network between nodes) plus a fixed latency each;
per step: the dp gradient reduce-scatter and weight all-gather (plain AdamW: an all-reduce), and the optimizer's
pass over its state at memory bandwidth (the tail).
Colocated, a rank runs both modules one after the other: step = n (V + L) + tail. Hetero, the two grids run 1F1B
over the bridge (schedule.py): the slower side sets the pace and the faster one's micro-batch fills and drains the
pipe: step = n max(V, L) + min(V, L) + tail. n: micro-batches per step; V, L: a vision, a language micro-batch.
"""
import model
import memory

PEAK_FLOPS = 989e12         # dense bf16 of an H100 / H200 SXM (logs.PEAK_TFLOPS)
# Measured: the language model's fwd + bwd on one H100, 20l (bench/2026-11-25-speed-h100.md: 44.5 % MFU).
LM_EFFICIENCY = 0.445
# Fitted (least squares of the relative error) to the step times of the full 20l (128 experts, seq 8192, one
# 2048² image a sample) in 7 layouts on 4 x H200 (bench/2026-11-26-hetero-nccl.md, bench/2026-11-27-shared-ranks.md;
# stage 3 in place tp1: the mean of 1.718 and 1.788 s): within 10 % of each.
VISION_EFFICIENCY = 0.40    # the tower's and projector's FLOPs (attention over 16k-token images: flash kernels)
LATENCY_S = 190e-6          # per collective: launch, and waiting for the group's slowest rank
HOST_PATCH_S = 0.05 / 128 ** 2   # per sample a module handles, time outside its kernels: 0.05 s a 2048² image
# Taken, not fitted (the 4-GPU step times cannot tell bandwidth from the latency above): NCCL's bus bandwidth
# on NVLink 4 inside a node; between nodes one 400 Gb/s NIC per GPU (DGX H100); an H100's HBM3 for the optimizer.
NVLINK_BYTES_S = 300e9
NETWORK_BYTES_S = 50e9
GPUS_PER_NODE = 8
MEMORY_BYTES_S = 3.35e12
OPTIMIZER_BYTES = 34        # per parameter the step reads and writes: fp32 weight, gradient, moments, bf16 copy


def all_reduce(g):          # share of B bytes one rank sends in a ring all-reduce of B over g ranks
    return 2 * (g - 1) / g


def gather(g):              # an all-gather, reduce-scatter or all-to-all
    return (g - 1) / g


def send(nbytes, count, span):
    """Seconds of `count` collectives sending `nbytes` in all, over a group spanning `span` consecutive ranks."""
    if not count:
        return 0.0
    return nbytes / (NVLINK_BYTES_S if span <= GPUS_PER_NODE else NETWORK_BYTES_S) + count * LATENCY_S


def host_seconds(cfg):
    """A sample's time outside the kernels of a module that handles it, by its image patches: fitted. The host's
    launches and syncs (bench/2026-11-27-step-profile.md: no kernel runs for 13-35 % of a 4-GPU 20l step)."""
    return sum(h * w * t for h, w, t in memory.vision_items(cfg)) * HOST_PATCH_S


def language_micro(cfg, lay):
    """Seconds of one language micro-batch on one rank: compute and its tp, ep and cp collectives."""
    tp, cp, ep, etp = lay.lm_tp, lay.lm_cp, lay.lm_ep, lay.lm_etp
    T, D, pattern = lay.micro_batch * cfg.seq_len // cp, cfg.hidden_size, cfg.hybrid_override_pattern
    passes, moe = (3 if cfg.activation_checkpointing else 2), pattern.count("E")
    flops = lay.micro_batch * cfg.seq_len * model.lm_flops_per_token(cfg, cfg.seq_len) * (passes + 1) / 3
    compute = flops / (tp * cp) / (PEAK_FLOPS * LM_EFFICIENCY) + lay.micro_batch * host_seconds(cfg)
    reduces = passes * len(pattern) + 2          # per layer pass (an MoE layer: its shared expert's), embedding, head
    activation = 2 * T * D
    tp_time = send((reduces * all_reduce(tp) + passes * moe * gather(tp)) * activation, (reduces + passes * moe)
                   * (tp > 1), tp)
    routed = 2 * T * cfg.num_experts_per_tok / tp * D     # a rank's routed rows of an MoE layer, both ways
    ep_time = send(passes * moe * 2 * (gather(ep) + etp - 1) * routed, passes * moe * 2 * (ep * etp > 1), ep * etp)
    kv = 2 * T * 2 * cfg.num_key_value_heads * cfg.head_dim / tp
    mamba = 2 * T * (3 * cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.n_groups * cfg.ssm_state_size
                     + cfg.mamba_num_heads) / tp
    attention, mambas = pattern.count("*"), pattern.count("M")
    cp_time = send(passes * (attention * (cp - 1) * kv + mambas * gather(cp) * mamba),
                   passes * (attention + 2 * mambas) * (cp > 1), tp * cp)
    return compute + tp_time + ep_time + cp_time


def vision_micro(cfg, lay):
    """Seconds of one vision micro-batch on one rank (forward, and backward where the tower trains): compute, tp
    all-reduces, and the bridge's rows and their gradient where they travel (not in place)."""
    trains, items = memory.tower_trains(cfg), memory.vision_items(cfg) * lay.vision_micro_batch
    flops = model.vision_flops(cfg, [(h, w) for h, w, _ in items], trains, [t for _, _, t in items])
    compute = flops / lay.vision_tp / (PEAK_FLOPS * VISION_EFFICIENCY)
    S, rows = memory.vision_tokens(cfg, lay)
    count = cfg.vit_depth * (4 if trains else 2) * (lay.vision_tp > 1)
    tp_time = send(count * all_reduce(lay.vision_tp) * 2 * S * cfg.vit_hidden, count, lay.vision_tp)
    bridge = 0.0 if lay.in_place else send(2 * 2 * rows * cfg.hidden_size / lay.vision_tp, 2, lay.world)
    return compute + tp_time + bridge + lay.vision_micro_batch * host_seconds(cfg)


def tail(cfg, lay, kind, cuda=True):
    """Seconds after the last micro-batch on a rank holding `kind` ("vision", "language"): the dp gradient
    reduce-scatter and weight all-gather, and the optimizer step over this rank's share of the state."""
    weight, size = (2 if cuda else 4), (lay.vision_size if kind == "vision" else lay.lm_size)
    nbytes = optimized = 0
    for k, _, trained, n, d in memory.local_parameters(cfg, lay):
        if k == kind and trained:
            nbytes += n * (gather(d) * (4 + weight) if cfg.distributed_optimizer else all_reduce(d) * 4)
            optimized += n / d if cfg.distributed_optimizer else n
    return send(nbytes, 2, size) + optimized * OPTIMIZER_BYTES / MEMORY_BYTES_S


def step_seconds(cfg, lay, cuda=True):
    """{"step", "vision", "language", "tail"}: the predicted seconds of a step, of one vision and one language
    micro-batch on a rank, and of the tail (the module docstring)."""
    V, L = vision_micro(cfg, lay), language_micro(cfg, lay)
    n = lay.num_microbatches
    if lay.colocated:
        end = tail(cfg, lay, "vision", cuda) + tail(cfg, lay, "language", cuda)
        step = n * (V + L) + end
    else:
        end = max(tail(cfg, lay, "vision", cuda), tail(cfg, lay, "language", cuda))
        step = n * max(V, L) + min(V, L) + end
    return {"step": step, "vision": V, "language": L, "tail": end}
