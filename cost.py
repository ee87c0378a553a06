"""The layout chooser's cost model: the predicted seconds of one training step of a layout on Hopper GPUs
(docs/layouts.md §1: how it is built and how far it holds).

Per micro-batch, on a rank of each module:
- compute: the module's FLOPs (model.py's and radio.py's counts) over its share of them (/ tp; the language
  model's / cp too) at a calibrated fraction of the bf16 peak;
- collectives: tp all-reduces of activations, ep all-to-alls of the routed rows, cp exchanges, a pipeline stage's
  residual stream to the next and its gradient back, and the bridge's rows and their gradient where they travel:
  the bytes a rank sends at its link's bandwidth (NVLink inside a node, the network between nodes) plus a fixed
  latency each;
per step: the dp gradient reduce-scatter and weight all-gather (plain AdamW: an all-reduce), and the optimizer's
pass over its state at memory bandwidth (the tail).
Hetero, the grids run 1F1B over the bridge and the language model's pipeline stages (schedule.py): the slowest
part sets the pace and each other one's micro-batch fills and drains the pipe: step = n max(V, L_0 .. L_p-1) + the
sum of the others + tail, at p = 1 n max(V, L) + min(V, L) + tail. Colocated, a rank runs both modules one after
the other: step = n max_s(V + L_s) + the sum of the other stages' L_s + tail, at p = 1 n (V + L) + tail. Each rank's
tower runs while the other stages work on their micro-batches, so only the language stages fill and drain the pipe
(1F1B's (p - 1) L), not whole rounds of V + L (docs/layouts.md §1: measured). n: micro-batches per step; V, L_s: a
vision micro-batch, a language one of stage s; tail: the slowest rank's.
With --data (DataStats) a vision micro-batch is the data's mean sample's, and each micro-batch's tower takes its
slowest vision lane's share of that, the samples where lanes.assign places them; the mock's: its one image. A
language row costs seq_len positions either way, however full: packed or padded, every layer runs every position
(padding is routed through the experts too, moe.py), and its launches do not depend on its images.
"""
import dataclasses
import math

import data
import lanes
import model
import memory
import radio

PEAK_FLOPS = 989e12         # dense bf16 of an H100 / H200 SXM (logs.PEAK_TFLOPS)
# Measured: the language model's fwd + bwd on one H100, 20l (bench/2026-11-25-speed-h100.md: 44.5 % MFU).
LM_EFFICIENCY = 0.445
# Fitted (least squares of the relative error) to the step times of the full 20l (128 experts, seq 8192, one
# 2048² image a sample) in 7 layouts on 4 x H200 (bench/2026-11-26-hetero-nccl.md, bench/2026-11-27-shared-ranks.md;
# stage 3 in place tp1: the mean of 1.718 and 1.788 s): within 10 % of each.
VISION_EFFICIENCY = 0.40    # the tower's and projector's FLOPs (attention over 16k-token images: flash kernels)
LATENCY_S = 190e-6          # per collective: launch, and waiting for the group's slowest rank
HOST_PATCH_S = 0.05 / 128 ** 2   # per sample a module handles, time outside its kernels: 0.05 s a 2048² image
# Refit to real-shaped data (several images a sample; docs/layouts.md §1), which the mock's one image a sample cannot
# tell from patches: of that 0.05 s, 0.04 s is per image (each image's own attention calls in every block), the rest
# by its patches. Only the data's predictions read it: the mock's are as fitted.
HOST_IMAGE_S = 0.04
DATA_SAMPLES = 256          # DataStats reads the first steps that hold at least this many samples
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


@dataclasses.dataclass(frozen=True, eq=False)
class DataStats:
    """What the cost model reads of --data in place of the mock's image (data_stats): over the first `samples`
    samples, the means a sample of images, patches, non-padding tokens, tower and projector FLOPs, tower tokens,
    image rows and the tower's seconds outside its kernels (HOST_IMAGE_S); each sample's tower seconds at tp 1
    (`seconds`) and lanes.costs' work, by which a run places it; per lane shape, its slowest lanes (slowest())."""
    what: str
    samples: int
    images: float
    patches: float
    tokens: float
    flops: float
    tower: float
    rows: float
    host: float
    seconds: tuple
    work: list
    slow: dict = dataclasses.field(default_factory=dict)


def data_stats(cfg, ds):
    """DataStats of training data `ds` from its index (data.sizes: no pixels), or None for the mock. Its first
    steps of at least DATA_SAMPLES samples: the run's own first steps, a fixed sample whatever the data's size."""
    if not isinstance(ds, data.RealData):
        return None
    trains, n = memory.tower_trains(cfg), -(-DATA_SAMPLES // cfg.global_batch) * cfg.global_batch
    sizes = [data.sizes(ds, i) for i in range(n)]
    raw = lanes.costs(cfg, ds, range(n), trains, (1.0, 1.0))   # (language, vision) FLOPs a sample
    flops = [v for _, v in raw]
    patches = [sum(p) for _, p in sizes]
    host = [len(p) * HOST_IMAGE_S + q * (HOST_PATCH_S - HOST_IMAGE_S / 128 ** 2) for (_, p), q in zip(sizes, patches)]

    def mean(xs):
        return math.fsum(xs) / n
    return DataStats(f"--data {cfg.data}", n, mean(len(p) for _, p in sizes), mean(patches), mean(t for t, _ in sizes),
                     mean(flops), mean(sum(q + cfg.class_token_len for q in p) for _, p in sizes),
                     mean(sum(q // 4 for q in p) for _, p in sizes), mean(host),
                     tuple(f / (PEAK_FLOPS * VISION_EFFICIENCY) + h for f, h in zip(flops, host)),
                     [(lm / LM_EFFICIENCY, v / VISION_EFFICIENCY) for lm, v in raw])


def basis(cfg, stats=None):
    """What a prediction's tower reads, in words (the dry run's and the layout line's)."""
    if stats is None:
        return memory.mock_load(cfg)[2]
    return (f"{stats.what}: {stats.samples} samples read, a sample {stats.images:.2f} images, {stats.patches:.0f} "
            f"patches, {stats.tokens:.0f} tokens (means)")


def slowest(stats, lay):
    """Per micro-batch of the sampled steps, its slowest vision lane's tower seconds over the mean lane's (over all
    of them), the samples where lanes.assign places them (vision lane e holds positions [e vmb, (e+1) vmb) of a
    micro-batch). Kept per lane shape: the chooser weighs many layouts of few shapes."""
    vmb, spm, gb = lay.vision_micro_batch, lay.samples_per_microbatch, lay.global_batch
    key = (lay.in_place, lay.vision_dp, lay.lm_dp, lay.micro_batch)
    if key not in stats.slow:
        mean, out = vmb * math.fsum(stats.seconds) / stats.samples, []
        for base in range(0, stats.samples, gb) if mean else ():
            at = [stats.seconds[base + o] for o in lanes.assign(lay, stats.work[base:base + gb])]
            out += [max(math.fsum(at[e:e + vmb]) for e in range(k, k + spm, vmb)) / mean for k in range(0, gb, spm)]
        stats.slow[key] = out or [0.0]   # no images: the tower never runs
    return stats.slow[key]


def language_micro(cfg, lay, stage=0):
    """Seconds of one language micro-batch on one rank of pipeline stage `stage`: compute and the tp, ep and cp
    collectives of its layers (the embedding's on the first stage, the head's on the last), and its transfers to
    the stages beside it: the residual stream forward (with MTP the decoder input too) and its gradient back."""
    tp, cp, ep, etp, p = lay.lm_tp, lay.lm_cp, lay.lm_ep, lay.lm_etp, lay.lm_pp
    T, D = lay.micro_batch * cfg.seq_len // cp, cfg.hidden_size
    r, first, last = model.stage_layers(cfg, p, lay.lm_split)[stage], stage == 0, stage == p - 1
    pattern = cfg.hybrid_override_pattern[r.start:r.stop]
    passes = 3 if cfg.activation_checkpointing else 2
    layers, rest = model.layer_flops_per_token(cfg, cfg.seq_len)
    per_token = sum(layers[r.start:r.stop]) + rest * last   # the head and MTP on the last stage
    flops = lay.micro_batch * cfg.seq_len * per_token * (passes + 1) / 3
    host = lay.micro_batch * host_seconds(cfg) * (len(r) / len(cfg.hybrid_override_pattern))   # launches: per layer
    compute = flops / (tp * cp) / (PEAK_FLOPS * LM_EFFICIENCY) + host
    # each layer pass's collectives (model.kind_facts), and the embedding's and the head's tp all-reduces
    sends = [model.kind_facts(cfg, k, cfg.seq_len, T, tp, cp, ep, etp)["sends"] for k in pattern]
    nbytes, count = ({g: passes * sum(s.get(g, (0, 0))[i] for s in sends) for g in ("tp", "ep", "cp")} for i in (0, 1))
    activation = 2 * T * D
    tp_time = send(nbytes["tp"] + (first + last) * all_reduce(tp) * activation, (count["tp"] + first + last)
                   * (tp > 1), tp)
    ep_time = send(nbytes["ep"], count["ep"], ep * etp)
    cp_time = send(nbytes["cp"], count["cp"] * (cp > 1), tp * cp)
    # the stages beside this one: to each, one batch a micro-batch (outputs down, or their gradient up)
    peers = (not first) + (not last)
    pipe_time = send(peers * activation * (1 + (model.mtp_depths(cfg) > 0)), peers, lay.lm_size)
    return compute + tp_time + ep_time + cp_time + pipe_time


def vision_micro(cfg, lay, stats=None):
    """Seconds of one vision micro-batch on one rank (forward, and backward where the tower trains) of the mock's
    samples, or of the data's mean sample (stats: DataStats): compute, tp all-reduces, the bridge's rows and their
    gradient where they travel (not in place), and the time outside the kernels (the mock's by its patches)."""
    trains, vmb = memory.tower_trains(cfg), lay.vision_micro_batch
    if stats is None:
        items = memory.vision_items(cfg) * vmb
        flops = radio.flops(cfg, [(h, w) for h, w, _ in items], trains, [t for _, _, t in items])
        (S, rows), host = memory.vision_tokens(cfg, lay), vmb * host_seconds(cfg)
    else:
        flops, S, rows, host = (vmb * x for x in (stats.flops, stats.tower, stats.rows, stats.host))
    compute = flops / lay.vision_tp / (PEAK_FLOPS * VISION_EFFICIENCY)
    tp_time = send(*radio.facts(cfg, S, rows, lay.vision_tp, trains)["sends"]["tp"], lay.vision_tp)
    bridge = 0.0 if lay.in_place else send(2 * 2 * rows * cfg.hidden_size / lay.vision_tp, 2, lay.world)
    return compute + tp_time + bridge + host


def tail(cfg, lay, kind, cuda=True, stage=0):
    """Seconds after the last micro-batch on a rank holding `kind` ("vision", "language"; of pipeline stage
    `stage`): the dp gradient reduce-scatter and weight all-gather over the module's (stage's) ranks, and the
    optimizer step over this rank's share of the state."""
    weight, size = (2 if cuda else 4), (lay.vision_size if kind == "vision" else lay.lm_size // lay.lm_pp)
    nbytes = optimized = 0
    for k, _, trained, n, d in memory.local_parameters(cfg, lay, stage):
        if k == kind and trained:
            nbytes += n * (gather(d) * (4 + weight) if cfg.distributed_optimizer else all_reduce(d) * 4)
            optimized += n / d if cfg.distributed_optimizer else n
    return send(nbytes, 2, size) + optimized * OPTIMIZER_BYTES / MEMORY_BYTES_S


def step_seconds(cfg, lay, cuda=True, stats=None):
    """{"step", "vision", "language", "tail", "bubble"}: the predicted seconds of a step, of one vision and one
    language micro-batch on a rank (the slowest pipeline stage's), of the tail (the slowest rank's), and the share
    of the step less the tail that the slowest rank waits (the module docstring). stats: the data's (DataStats;
    None: the mock's samples), each micro-batch's tower its slowest lane's (slowest())."""
    n, p = lay.num_microbatches, lay.lm_pp
    V, L = vision_micro(cfg, lay, stats), [language_micro(cfg, lay, s) for s in range(p)]
    shares = [1.0] if stats is None else slowest(stats, lay)
    ends = [tail(cfg, lay, "language", cuda, s) for s in range(p)]
    if lay.colocated:   # every rank both: the tower and its stage
        end = tail(cfg, lay, "vision", cuda) + max(ends)
        pace = math.fsum(max(V * a + lm for lm in L) for a in shares) / len(shares)
        fill = sum(sorted(L)[:-1])   # towers overlap the pipe: only the other stages' micro-batch fills it
    else:
        end = max(tail(cfg, lay, "vision", cuda), *ends)
        pace = math.fsum(max(V * a, *L) for a in shares) / len(shares)
        fill = sum(sorted([V, *L])[:-1])   # the pipe's fill and drain: each other part once
    step = n * pace + fill + end
    return {"step": step, "vision": V, "language": max(L), "tail": end,
            "bubble": fill / (n * pace + fill) if fill else 0.0}
