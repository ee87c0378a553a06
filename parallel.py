"""Rank grids, process groups and the gradient step (spec: shared/spec/parallel.md; the layout is layout.py, the
bridge bridge.py).

The vision encoder and the language model each live on a grid of ranks. Hetero: vision on [0, V), language on
[V, V+L). Colocated: both on every rank. Read top to bottom:

  1. Grid     a rank tensor `arange(size).view(pp, dp, cp, tp) + offset`; every group is a slice of it (§2).
  2. Setup    every group of every grid, created in one fixed order on every rank (§4.1).
  3. Step     DP gradient reduction, global token count, global grad norm, clipping, step consensus (§7).
"""
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import comm
from layout import Layout, check_layout


# ==================================================================================================================
# 1. Grid
# ==================================================================================================================

class Grid:
    """Ranks [offset, offset+size) as a tensor. `dims` maps names to sizes, FASTEST first (tp, cp, dp, pp).

    Megatron's HyperCommGrid rank algebra: rank = offset + tp_i + tp*(cp_i + cp*(dp_i + dp*pp_i)). The expert view is
    a second Grid over the same ranks with dims (etp, ep, edp, pp).
    """

    def __init__(self, dims, offset=0):
        self.names = list(dims)
        self.shape = [dims[n] for n in self.names]
        self.size = math.prod(self.shape)
        self.offset = offset
        # tensor axes are slowest first, so names[0] ends up with stride 1
        self.ranks = torch.arange(self.size).view(*reversed(self.shape)) + offset

    def _axis(self, name):
        if name not in self.names:
            raise ValueError(f"{name!r} is not a dim of grid {self.names}")
        return len(self.names) - 1 - self.names.index(name)

    def groups(self, dims):
        """Rank lists of the groups spanning `dims` ("tp-dp" or a list), in canonical order (§2.1).

        Requested axes go last (slowest first), the others first; each row of the reshape is one group. So inside a
        group the dim earliest in `names` varies fastest, and groups follow the other dims, latest name outermost.
        The order in which `dims` is written does not matter.
        """
        dims = dims.split("-") if isinstance(dims, str) else list(dims)
        keep = sorted({self._axis(d) for d in dims})
        rest = [a for a in range(len(self.names)) if a not in keep]
        group_size = math.prod(self.ranks.shape[a] for a in keep)
        return self.ranks.permute(rest + keep).reshape(-1, group_size).tolist()

    def __contains__(self, rank):
        return self.offset <= rank < self.offset + self.size

    def coords(self, rank):
        """{dim: index} of a rank of this grid."""
        assert rank in self, f"rank {rank} is not in grid [{self.offset}, {self.offset + self.size})"
        i, out = rank - self.offset, {}
        for name, n in zip(self.names, self.shape):
            out[name], i = i % n, i // n
        return out


def vision_grid(lay):
    return Grid({"tp": lay.vision_tp, "cp": 1, "dp": lay.vision_dp, "pp": 1}, offset=0)


def lm_grid(lay):
    return Grid({"tp": lay.lm_tp, "cp": lay.lm_cp, "dp": lay.lm_dp, "pp": lay.lm_pp}, offset=lay.lm_offset)


def expert_grid(lay):
    return Grid({"etp": lay.lm_etp, "ep": lay.lm_ep, "edp": lay.lm_edp, "pp": lay.lm_pp}, offset=lay.lm_offset)


def lanes(grid):
    """One rank list per data lane (dp coordinate), in lane order: all tp/cp/pp ranks that see the same samples."""
    return grid.groups([d for d in grid.names if d != "dp"])


def lane_samples(lay, side, lane):
    """Sample indices of the global microbatch owned by data lane `lane` of `side` ("vision" or "lm")."""
    n = lay.micro_batch if side == "lm" else lay.vision_micro_batch
    return range(lane * n, (lane + 1) * n)



# ==================================================================================================================
# 2. Setup
# ==================================================================================================================

@dataclass
class ModuleGroups:
    """One module's groups and coordinates as seen from this rank. A group is None where it does not apply."""
    name: str                                   # "vision" or "lm"
    tp: object = None
    cp: object = None
    dp: object = None
    pp: object = None
    dp_cp: object = None                        # dense gradient reduction domain
    tp_cp: object = None
    tp_pp: object = None                        # Megatron's "mp"
    tp_dp: object = None
    tp_dp_cp: object = None                     # MoE expert-bias token counts
    whole: object = None                        # the whole module grid
    ep: object = None                           # expert view (language only)
    etp: object = None
    edp: object = None                          # expert gradient reduction domain
    etp_ep: object = None                       # token dispatcher domain
    etp_ep_pp: object = None
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    edp_rank: int = 0
    edp_size: int = 1

    def identity(self):
        s = f"{self.name} tp{self.tp_rank}/{self.tp_size} dp{self.dp_rank}/{self.dp_size}"
        if self.name == "lm":
            s += (f" ep{self.ep_rank}/{self.ep_size} etp{self.etp_rank}/{self.etp_size}"
                  f" edp{self.edp_rank}/{self.edp_size}")
        return s


@dataclass
class Parallel:
    """What setup() hands back to every rank: its roles, its groups per module, the bridge group."""
    rank: int
    layout: Layout
    vision: ModuleGroups = None                 # None on language-only ranks
    lm: ModuleGroups = None                     # None on vision-only ranks
    bridge: object = None                       # leaders of both sides (hetero); None elsewhere
    created: list = field(default_factory=list)  # (label, rank lists) in creation order, identical on all ranks

    @property
    def in_vision(self):
        return self.vision is not None

    @property
    def in_lm(self):
        return self.lm is not None

    def __str__(self):
        parts = [m.identity() for m in (self.vision, self.lm) if m is not None]
        return " | ".join(parts) + f" rank{self.rank}"


VISION_GROUPS = ["tp", "dp", "tp-dp"]
LM_GROUPS = ["tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp", "tp-dp-cp", "tp-cp-dp-pp"]
EXPERT_GROUPS = ["ep", "etp", "edp", "etp-ep", "etp-ep-pp"]
FIELD = {"dp-cp": "dp_cp", "tp-cp": "tp_cp", "tp-pp": "tp_pp", "tp-dp": "tp_dp", "tp-dp-cp": "tp_dp_cp",
         "tp-cp-dp-pp": "whole", "etp-ep": "etp_ep", "etp-ep-pp": "etp_ep_pp"}


def setup(lay, cfg=None):
    """Build both grids and create every group of every grid on EVERY rank (new_group is collective over WORLD).

    Call after init_process_group. Creation order is fixed (§4.1): vision tp, dp, tp-dp; language tp, cp, dp, pp,
    dp-cp, tp-cp, tp-pp, tp-dp, tp-dp-cp, whole; expert ep, etp, edp, etp-ep, etp-ep-pp (pp is the base group);
    the bridge group (no embedding groups: with pp = 1 they would be singletons). Identical rank lists share one
    group object (colocated grids, size-1 dims): every rank computes the same lists, so the sequence of new_group
    calls is still identical everywhere.
    """
    if cfg is not None:
        check_layout(lay, cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == lay.world, f"layout is for {lay.world} ranks, WORLD_SIZE is {world}"
    vgrid, lgrid, egrid = vision_grid(lay), lm_grid(lay), expert_grid(lay)
    # both views share pp with the same stride; checked, then the base pp group is reused
    assert egrid.groups("pp") == lgrid.groups("pp"), "expert view must share the pp groups"
    par = Parallel(rank=rank, layout=lay)
    made = {}

    def create(label, rank_lists):
        par.created.append((label, rank_lists))
        mine = None
        for ranks in rank_lists:
            if tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks)
            if rank in ranks:
                mine = made[tuple(ranks)]
        return mine

    def fill(m, label, grid, dims_list):
        for dims in dims_list:
            g = create(f"{label} {dims}", grid.groups(dims))
            if m is not None:
                setattr(m, FIELD.get(dims, dims), g)
        if m is not None:
            for d, i in grid.coords(rank).items():
                setattr(m, f"{d}_rank", i)
                setattr(m, f"{d}_size", grid.shape[grid.names.index(d)])

    par.vision = ModuleGroups("vision") if rank in vgrid else None
    par.lm = ModuleGroups("lm") if rank in lgrid else None
    fill(par.vision, "vision", vgrid, VISION_GROUPS)
    if par.vision is not None:          # cp = pp = 1: tp-dp is the whole grid, dp-cp = dp, tp-cp = tp-pp = tp
        v = par.vision
        v.whole, v.dp_cp, v.tp_cp, v.tp_pp = v.tp_dp, v.dp, v.tp, v.tp
    fill(par.lm, "lm", lgrid, LM_GROUPS)
    fill(par.lm, "lm", egrid, EXPERT_GROUPS)       # same ranks, expert coordinates; pp agrees with the base view
    if not lay.colocated:
        # the lane broadcast groups of §5.2 are the grids' tp groups here (cp = pp = 1), already created above
        leaders = sorted({lane[-1] for lane in lanes(vgrid)} | {lane[0] for lane in lanes(lgrid)})
        par.bridge = create("bridge", [leaders])
    return par


def print_ranks(par):
    """Rank 0 prints the layout and one identity line per rank, in rank order (collective over WORLD)."""
    lines = [None] * par.layout.world
    dist.all_gather_object(lines, str(par))
    if par.rank == 0:
        print(par.layout.describe(), *lines, sep="\n  ", flush=True)


# ==================================================================================================================
# 3. Gradients and the step
# ==================================================================================================================
# Why not DDP: gradients accumulate over all microbatches and are reduced once, explicitly, after the last one
# (text-only encoder ranks would never fire DDP's grad-ready hooks, §5.7); dense and expert parameters of one module
# reduce over different groups; and the two modules sit on different grids. A flat bucketed all-reduce is all we need.

BUCKET_BYTES = 25 * 2**20


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def allreduce_grads(params, group, bucket_bytes=BUCKET_BYTES):
    """SUM all-reduce the gradients of `params` over `group` in fp32 buckets of about `bucket_bytes`.

    Every rank of the group must pass the same parameters in the same order. A missing .grad becomes zeros, also
    without a group: all ranks post identical buckets (an expert no token reached, an encoder that saw only text
    still takes part), and every trainable parameter steps alike on any layout (AdamW's decay included, as with
    Megatron's gradient buffers). A parameter's fp32 `main_grad` (optim.py), where it has one, is the gradient.
    """
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None and getattr(p, "main_grad", None) is None:
            p.grad = torch.zeros_like(p)
    if group is None or dist.get_world_size(group) == 1 or not params:
        return
    grads = [p.grad if getattr(p, "main_grad", None) is None else p.main_grad for p in params]
    bucket, size = [], 0
    for i, g in enumerate(grads):
        bucket.append(g)
        size += g.numel() * 4
        if size >= bucket_bytes or i == len(grads) - 1:
            flat = torch.cat([t.reshape(-1).float() for t in bucket])
            dist.all_reduce(flat, group=group)
            for t, r in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(r.view_as(t))
            bucket, size = [], 0


def reduce_gradients(par, vision_params=(), lm_params=(), bucket_bytes=BUCKET_BYTES):
    """Each module SUMs over its own data-parallel groups: vision over vision dp, language dense parameters over
    dp-cp, language expert parameters over edp (§7.1). Pass the parameters of the modules this rank holds."""
    if par.vision is not None:
        allreduce_grads(vision_params, par.vision.dp_cp, bucket_bytes)
    if par.lm is not None:
        lm_params = list(lm_params)
        allreduce_grads([p for p in lm_params if not comm.is_expert(p)], par.lm.dp_cp, bucket_bytes)
        allreduce_grads([p for p in lm_params if comm.is_expert(p)], par.lm.edp, bucket_bytes)


def global_token_count(par, local_tokens):
    """N_global: loss-mask tokens over all language lanes and microbatches of the step, known on every rank.

    `local_tokens` is this language lane's count over its microbatches (anything on vision-only ranks). Each lane
    counts once: only its tp-0 / cp-0 / last-pp rank contributes, all others add 0, and one SUM over WORLD makes
    the total known on both grids (colocated too). This single all-reduce replaces "sum over lm dp, then
    broadcast to WORLD".
    """
    m = par.lm
    lead = m is not None and m.tp_rank == 0 and m.cp_rank == 0 and m.pp_rank == m.pp_size - 1
    t = torch.tensor([int(local_tokens) if lead else 0], dtype=torch.int64, device=_device())
    dist.all_reduce(t)
    return int(t.item())


def on_every_rank(fn, *args, **kwargs):
    """fn(...) on every rank; a one-line error (SystemExit) on any rank ends every rank with it, rather than one
    rank exiting and the others waiting in their next collective (a corrupt rank json is read by its rank only)."""
    try:
        out, error = fn(*args, **kwargs), None
    except SystemExit as e:
        out, error = None, str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise SystemExit(first)
    return out


def _unique_here(p, m):
    """Whether this rank holds the copy of p's gradient that the global norm counts (each element exactly once):
    after the DP reduction every dp replica is identical, so only dp (and cp) rank 0 (edp 0 for experts) counts."""
    if comm.is_expert(p):
        return m.edp_rank == 0 and comm.counted_in_replica(p, m)
    return m.dp_rank == 0 and m.cp_rank == 0 and comm.counted_in_replica(p, m)


def grad_lists(par, vision_params=(), lm_params=()):
    """(counted, copies): the local gradients the global norm counts (_unique_here), and all the other ones."""
    counted, copies = [], []
    for m, params in ((par.vision, vision_params), (par.lm, lm_params)):
        if m is not None:
            for p in params:
                if p.grad is not None:
                    (counted if _unique_here(p, m) else copies).append(p.grad.detach())
    return counted, copies


def global_grad_norm(par, vision_params=(), lm_params=(), lists=None):
    """sqrt(sum over modules of norm_m^2), identical on every rank (one SUM all-reduce over WORLD, all ranks call).
    `lists`: (counted, copies) gradient tensors instead of grad_lists(par, vision_params, lm_params).

    The same all-reduce carries a second number, the sum of squares of EVERY local gradient: if any rank holds an
    inf/nan, even in a copy the norm does not count, the result is nan on every rank, so all ranks skip together.
    """
    counted, copies = lists or grad_lists(par, vision_params, lm_params)
    local = torch.zeros(2, dtype=torch.float64, device=_device())
    if counted or copies:                  # counted first, so the norm is a prefix of one batched norm
        sq = torch.stack(torch._foreach_norm(counted + copies, dtype=torch.float64)) ** 2  # fp64: the same
        # value however the gradients are cut into pieces (the distributed optimizer's shards)
        local[0] = sq[:len(counted)].sum()
        local[1] = sq.sum()
    dist.all_reduce(local)
    total, check = local.tolist()
    return math.sqrt(total) if math.isfinite(total) and math.isfinite(check) else float("nan")


def finalize_gradients(par, vision_params, lm_params, n_global, max_norm, opt=None):
    """The whole post-backward sequence, same WORLD collectives in the same order on every rank (§7.3):
    DP-reduce each module, global norm, then one pass that divides by N_global (from global_token_count at the start
    of the step) and clips to max_norm (0: no clipping), or skip. Returns (norm of the divided gradients, ok).
    With optim.DistributedAdamW (`opt`) the reduction is its reduce-scatter and the rest runs on its fp32 shards.

    ok is False on EVERY rank when any rank saw inf/nan: grads are then dropped and the caller skips the step.
    """
    sharded = hasattr(opt, "reduce_scatter_grads")
    vision_params = list(vision_params) if par.vision is not None else []
    lm_params = list(lm_params) if par.lm is not None else []
    for m, params in ((par.vision, vision_params), (par.lm, lm_params)):
        if m is not None and m.tp_size > 1:   # LoRA adapters whose gradient is a partial sum per tp rank (lora.py)
            allreduce_grads([p for p in params if getattr(p, "tp_partial", False)], m.tp)
    if sharded:
        lists = opt.reduce_scatter_grads()
        grads = opt.shard_grads()
    else:
        reduce_gradients(par, vision_params, lm_params)
        lists = grad_lists(par, vision_params, lm_params)
        grads = lists[0] + lists[1]
    n = max(n_global, 1)
    norm = global_grad_norm(par, lists=lists) / n   # the norm scales with the gradients
    ok = math.isfinite(norm)                   # the same value on every rank: all step or all skip
    if ok:
        factor = (min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0) / n   # max_norm 0: no clipping
        if grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)
    elif sharded:
        opt.zero_grad()
    else:
        for p in vision_params + lm_params:
            p.grad = None
    return norm, ok
