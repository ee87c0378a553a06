"""Which position of its micro-batch each sample of a step takes (docs/data.md §9). A step's samples are the same in
every layout (data.py), and which lane trains which of them is free: the loss is a sum over all the step's tokens
over their global count, so any partition gives it up to float order. In index order one lane may get a document
page and its neighbour a text-only chat, and each micro-batch waits for its slowest lane; here every rank computes,
from the step's sample indices and the data's index alone, the same order by predicted cost (assign).

A micro-batch's positions stay where they are (parallel.lane_samples: vision lane e holds [e*vmb, (e+1)*vmb),
language lane j [j*mb, (j+1)*mb); the bridge's links are their overlaps), so an assignment is an order: which
sample sits at each position. A position's vision lane and language lane come with it: where both grids have the
same lanes, a vision lane's samples are its language lane's, and one order balances both costs at once (each
side's work over its mean lane's). In place a lane runs both modules: its cost is their sum.
"""
import math

import numpy as np

import data
import model
import parallel
import radio


def costs(cfg, ds, indices, tower_trains, rates):
    """[(language, vision)] predicted work of samples `indices` of `ds` (data.sizes: its index, no pixels): FLOPs
    over the cost model's efficiency of each module (`rates`, cost.py's LM_EFFICIENCY and VISION_EFFICIENCY)."""
    per_token, out = model.lm_flops_per_token(cfg, cfg.seq_len), []
    for i in indices:
        tokens, patches = data.sizes(ds, i)
        vision = radio.flops(cfg, [(1, p) for p in patches], tower_trains) if patches else 0
        out.append((tokens * per_token / rates[0], vision / rates[1]))
    return out


def _bins(lay, n_micro):
    """(vision lane, language lane, room) of each bin, in position order: a micro-batch's runs of positions of one
    vision lane and one language lane (the bridge's links), micro-batch after micro-batch. Lanes are numbered over
    the step (micro-batch k's lane e is k * dp + e)."""
    spm, vmb, mb = lay.samples_per_microbatch, lay.vision_micro_batch, lay.micro_batch
    cuts = sorted(set(range(0, spm + 1, vmb)) | set(range(0, spm + 1, mb)))
    runs = [(a // vmb, a // mb, b - a) for a, b in zip(cuts, cuts[1:])]
    return [(k * lay.vision_dp + e, k * lay.lm_dp + j, n) for k in range(n_micro) for e, j, n in runs]


def _sides(lay, work):
    """(language, vision) work arrays; in place both are a lane's whole work."""
    lm, vision = (np.array([w[s] for w in work], dtype=np.float64) for s in (0, 1))
    return (lm + vision, lm + vision) if lay.in_place else (lm, vision)


def assign(lay, work):
    """`work`: [(language, vision)] of a group of whole micro-batches' samples, in index order -> the order: the
    group's offset at each position. Each micro-batch waits for its slowest lane on either side (imbalance), so
    a sample, longest first, goes where it raises those least, then where the lanes are emptiest, then to the
    first such bin. Deterministic on every rank: exact sums (math.fsum), elementwise IEEE arithmetic."""
    n_micro = len(work) // lay.samples_per_microbatch
    bins = _bins(lay, n_micro)
    vl, ll, room = (np.array(c) for c in zip(*bins))
    k = np.repeat(np.arange(n_micro), len(bins) // n_micro)
    lm, vision = _sides(lay, work)
    # each side's work over its mean lane's: the two sides become comparable (a side with no work weighs nothing)
    means = [math.fsum(x) / (n_micro * dp) for x, dp in ((vision, lay.vision_dp), (lm, lay.lm_dp))]
    v, l = (x / m if m else np.zeros_like(x) for x, m in zip((vision, lm), means))
    V, L, top = np.zeros(n_micro * lay.vision_dp), np.zeros(n_micro * lay.lm_dp), np.zeros((2, n_micro))
    held = [[] for _ in bins]
    for i in sorted(range(len(work)), key=lambda i: (-(v[i] + l[i]), i)):
        nv, nl = V[vl] + v[i], L[ll] + l[i]
        rise = np.maximum(nv - top[0, k], 0.0) + np.maximum(nl - top[1, k], 0.0)
        rise[room == 0] = np.inf
        b = int(np.argmin(np.where(rise == rise.min(), nv + nl, np.inf)))
        held[b].append(i)
        room[b] -= 1
        top[:, k[b]] = np.maximum(top[:, k[b]], (nv[b], nl[b]))
        V[vl[b]], L[ll[b]] = nv[b], nl[b]
    return [i for h in held for i in sorted(h)]


def imbalance(lay, work):
    """(vision, language) lane imbalance of `work` in position order: each micro-batch waits for its slowest lane
    (the bridge, the experts' all-to-alls), so the sum over micro-batches of the slowest lane's work over the sum of
    the mean lane's; 1.0 is even, None for a side with no work."""
    n_micro = len(work) // lay.samples_per_microbatch
    lm, vision = _sides(lay, work)
    out = []
    for x, lane, dp in ((vision, 0, lay.vision_dp), (lm, 1, lay.lm_dp)):
        loads = np.zeros(n_micro * dp)
        at = 0
        for b in _bins(lay, n_micro):
            loads[b[lane]] += math.fsum(x[at:at + b[2]])
            at += b[2]
        total = math.fsum(loads)
        out.append(float(loads.reshape(n_micro, dp).max(1).sum() * dp / total) if total else None)
    return tuple(out)


class Lanes:
    """A loader's order (data.Loader): slots(first) -> the global indices of the samples at each position of the
    micro-batch starting at sample `first`, assigned over groups of `group` samples (a step's global batch; an
    evaluation's micro-batch). The caller passes the cost model's rates: the core imports no planner."""

    def __init__(self, cfg, ds, lay, group, tower_trains, rates):
        self.cfg, self.ds, self.lay, self.group, self.trains, self.rates = cfg, ds, lay, group, tower_trains, rates
        self.cache = {}

    def step(self, base):
        """(the global indices in position order, their work) of the group starting at sample `base`."""
        if base not in self.cache:
            work = costs(self.cfg, self.ds, range(base, base + self.group), self.trains, self.rates)
            order = assign(self.lay, work)
            self.cache = {base: ([base + o for o in order], [work[o] for o in order])}
        return self.cache[base]

    def __call__(self, first):
        base = first - first % self.group
        spm = self.lay.samples_per_microbatch
        return self.step(base)[0][first - base:first - base + spm]


def rank_offsets(lay, par):
    """(positions inside a global micro-batch this rank builds, whether it needs pixels): its vision lane's and/or
    language lane's samples (parallel.lane_samples). Only vision ranks decode images."""
    own = set()
    if par.in_vision:
        own |= set(parallel.lane_samples(lay, "vision", par.vision.dp_rank))
    if par.in_lm:
        own |= set(parallel.lane_samples(lay, "lm", par.lm.dp_rank))
    return sorted(own), par.in_vision
