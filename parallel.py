"""Rank layout, process groups and the gradient step (spec: shared/spec/parallel.md; the bridge is bridge.py).

The vision encoder and the language model each live on a grid of ranks. Hetero: vision on [0, V), language on
[V, V+L). Colocated: both on every rank. Read top to bottom:

  1. Layout   sizes, validation and choosing the run's layout; pure, runs before init_process_group (D2).
  2. Grid     a rank tensor `arange(size).view(pp, dp, cp, tp) + offset`; every group is a slice of it (§2).
  3. Setup    every group of every grid, created in one fixed order on every rank (§4.1).
  4. Step     DP gradient reduction, global token count, global grad norm, clipping, step consensus (§7).
"""
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# ==================================================================================================================
# 1. Layout
# ==================================================================================================================

@dataclass(frozen=True)
class Layout:
    """Sizes of both grids. cp and pp are kept as dims of the language grid but must be 1 in this version."""
    world: int
    colocated: bool
    vision_tp: int
    vision_dp: int
    lm_tp: int
    lm_dp: int
    lm_ep: int = 1
    lm_etp: int = 1
    micro_batch: int = 1            # samples per language lane per microbatch (mbs)
    global_batch: int = 1           # samples per optimizer step
    lm_cp: int = 1
    lm_pp: int = 1

    @property
    def vision_size(self):
        return self.vision_tp * self.vision_dp

    @property
    def lm_size(self):
        return self.lm_tp * self.lm_cp * self.lm_dp * self.lm_pp

    @property
    def lm_offset(self):            # vision always starts at rank 0
        return 0 if self.colocated else self.vision_size

    @property
    def lm_edp(self):               # expert data parallel: what is left of the language grid after etp x ep x pp
        return self.lm_size // (self.lm_etp * self.lm_ep * self.lm_pp)

    @property
    def samples_per_microbatch(self):   # one global microbatch spans every language lane
        return self.micro_batch * self.lm_dp

    @property
    def vision_micro_batch(self):       # samples one vision lane encodes per microbatch (mbs*k fan-out, mbs/k fan-in)
        return self.samples_per_microbatch // self.vision_dp

    @property
    def num_microbatches(self):         # counted from language dp, identical on both grids (§6.2)
        return self.global_batch // self.samples_per_microbatch

    def describe(self):
        vision = f"vision {self.vision_size} (tp{self.vision_tp} x dp{self.vision_dp})"
        lm = (f"language {self.lm_size} (tp{self.lm_tp} x cp{self.lm_cp} x dp{self.lm_dp} x pp{self.lm_pp}; "
              f"experts etp{self.lm_etp} x ep{self.lm_ep} x edp{self.lm_edp})")
        if self.colocated:
            return f"colocated layout on {self.world} ranks: {vision}, {lm}"
        return f"hetero layout: {vision} on [0,{self.vision_size}) + {lm} on [{self.vision_size},{self.world})"


def check_layout(lay, cfg):
    """Every rule of spec D2 plus the model's divisibility needs. Raises one SystemExit listing all problems."""
    vision = f"vision {lay.vision_size} (tp{lay.vision_tp} x dp{lay.vision_dp})"
    lm = f"language {lay.lm_size} (tp{lay.lm_tp} x cp{lay.lm_cp} x dp{lay.lm_dp} x pp{lay.lm_pp})"
    errors = []
    if lay.colocated:
        if lay.vision_size != lay.world or lay.lm_size != lay.world:
            errors.append(f"colocated layout: {vision} and {lm} must both equal WORLD_SIZE {lay.world}")
        if (lay.vision_tp, lay.vision_dp) != (lay.lm_tp, lay.lm_dp):
            errors.append(f"colocated layout needs vision tp/dp == language tp/dp (vision tp{lay.vision_tp} dp"
                          f"{lay.vision_dp}, language tp{lay.lm_tp} dp{lay.lm_dp}): moving encoder rows between "
                          "different colocated shapes is not implemented; use a hetero layout")
    elif lay.vision_size + lay.lm_size != lay.world:
        errors.append(f"hetero layout: {vision} + {lm} = {lay.vision_size + lay.lm_size} != WORLD_SIZE {lay.world}")
    sizes = {k: getattr(lay, k) for k in ("vision_tp", "vision_dp", "lm_tp", "lm_dp", "lm_ep", "lm_etp",
                                          "micro_batch", "global_batch", "lm_cp", "lm_pp")}
    bad = [f"{k} {v}" for k, v in sizes.items() if not isinstance(v, int) or v < 1]
    if bad:  # the checks below divide by these
        raise SystemExit("bad parallel layout: sizes must be positive integers: " + ", ".join(bad)
                         + "".join(f"; {e}" for e in errors))
    if lay.lm_cp != 1 or lay.lm_pp != 1:
        errors.append(f"language cp{lay.lm_cp} pp{lay.lm_pp}: this version supports cp = pp = 1 only")
    # tp shards heads, Mamba heads and groups, MLP widths and the vocab-parallel embedding / cross-entropy
    for name in ("num_attention_heads", "num_key_value_heads", "mamba_num_heads", "n_groups", "vocab_size",
                 "intermediate_size", "moe_shared_expert_intermediate_size"):
        if getattr(cfg, name) % lay.lm_tp:
            errors.append(f"lm_tp {lay.lm_tp} does not divide {name} {getattr(cfg, name)}")
    for name in ("vit_heads", "vit_mlp"):
        if getattr(cfg, name) % lay.vision_tp:
            errors.append(f"vision_tp {lay.vision_tp} does not divide {name} {getattr(cfg, name)}")
    etp_ep_pp = lay.lm_etp * lay.lm_ep * lay.lm_pp
    if lay.lm_size % etp_ep_pp:
        errors.append(f"{lm} is not divisible by etp{lay.lm_etp} x ep{lay.lm_ep} x pp{lay.lm_pp} = {etp_ep_pp}, "
                      "so the expert data-parallel size is not whole")
    if cfg.n_routed_experts % lay.lm_ep:
        errors.append(f"lm_ep {lay.lm_ep} does not divide n_routed_experts {cfg.n_routed_experts}")
    if cfg.moe_intermediate_size % lay.lm_etp:
        errors.append(f"lm_etp {lay.lm_etp} does not divide moe_intermediate_size {cfg.moe_intermediate_size}")
    vdp, ldp = lay.vision_dp, lay.lm_dp
    if max(vdp, ldp) % min(vdp, ldp):
        errors.append(f"vision dp {vdp} and language dp {ldp} must divide one another (bridge fan-in / fan-out)")
    if lay.samples_per_microbatch % vdp:
        errors.append(f"micro_batch {lay.micro_batch} x language dp {ldp} = {lay.samples_per_microbatch} samples "
                      f"per microbatch do not split evenly over vision dp {vdp}")
    if lay.global_batch % lay.samples_per_microbatch:
        errors.append(f"global_batch {lay.global_batch} is not divisible by micro_batch {lay.micro_batch} x "
                      f"language dp {ldp} = {lay.samples_per_microbatch}")
    if errors:
        raise SystemExit("bad parallel layout: " + "; ".join(errors))
    return lay


def plan_layout(cfg, world, micro_batch, global_batch, *, vision_tp=None, vision_dp=None, lm_tp=None, lm_dp=None,
                lm_ep=None, lm_etp=None, colocated=None):
    """The run's layout from argparse values (None = flag not given); checked before any collective.

    - No grid flag: the preset's reference layout (cfg.vision_tp ...) when world == cfg.reference_world (hetero when
      its vision sizes are > 0, else colocated with the language sizes), otherwise colocated data parallel over all
      ranks (tp = ep = etp = 1, dp = world).
    - Any grid flag replaces the reference entirely: missing tp / ep / etp are 1 (colocated vision tp follows lm_tp),
      a missing dp is derived: colocated dp = world / tp; hetero takes the ranks the other grid leaves.
    - `colocated` defaults to: the reference's kind at the reference world, else hetero iff a vision flag is given.
    """
    flags = dict(vision_tp=vision_tp, vision_dp=vision_dp, lm_tp=lm_tp, lm_dp=lm_dp, lm_ep=lm_ep, lm_etp=lm_etp)
    given = {k: v for k, v in flags.items() if v is not None}
    ref_hetero = cfg.vision_tp > 0 and cfg.vision_dp > 0
    at_reference = world == cfg.reference_world and not given
    if colocated is None:
        colocated = (not ref_hetero) if at_reference else (vision_tp is None and vision_dp is None)
    if at_reference and colocated == (not ref_hetero):
        v = (cfg.vision_tp, cfg.vision_dp) if ref_hetero else (cfg.lm_tp, cfg.lm_dp)
        s = dict(vision_tp=v[0], vision_dp=v[1], lm_tp=cfg.lm_tp, lm_dp=cfg.lm_dp, lm_ep=cfg.lm_ep,
                 lm_etp=cfg.lm_etp)
    else:
        s = dict(vision_tp=1, vision_dp=None, lm_tp=1, lm_dp=None, lm_ep=1, lm_etp=1)
        s.update(given)
        if colocated:
            s["vision_tp"] = given.get("vision_tp", s["lm_tp"])
            s["lm_dp"] = s["lm_dp"] or world // s["lm_tp"]
            s["vision_dp"] = s["vision_dp"] or world // s["vision_tp"]
        elif s["vision_dp"] is None and s["lm_dp"] is None:
            raise SystemExit("bad parallel layout: a hetero layout needs --vision_dp or --lm_dp (the other is "
                             "derived from WORLD_SIZE)")
        elif s["vision_dp"] is None:
            s["vision_dp"] = (world - s["lm_tp"] * s["lm_dp"]) // s["vision_tp"]
        elif s["lm_dp"] is None:
            s["lm_dp"] = (world - s["vision_tp"] * s["vision_dp"]) // s["lm_tp"]
    lay = Layout(world=world, colocated=bool(colocated), micro_batch=micro_batch, global_batch=global_batch, **s)
    return check_layout(lay, cfg)


# ==================================================================================================================
# 2. Grid
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
# 3. Setup
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
# 4. Gradients and the step
# ==================================================================================================================
# Why not DDP: gradients accumulate over all microbatches and are reduced once, explicitly, after the last one
# (text-only encoder ranks would never fire DDP's grad-ready hooks, §5.7); dense and expert parameters of one module
# reduce over different groups; and the two modules sit on different grids. A flat bucketed all-reduce is all we need.

BUCKET_BYTES = 25 * 2**20


def shard_kinds(p):
    """{"tp", "ep", "etp"} subset from comm.mark_shard; empty for parameters replicated within the module's tp."""
    return {s[0] for s in getattr(p, "shards", ())}


def is_expert(p):
    return "ep" in shard_kinds(p)


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
        allreduce_grads([p for p in lm_params if not is_expert(p)], par.lm.dp_cp, bucket_bytes)
        allreduce_grads([p for p in lm_params if is_expert(p)], par.lm.edp, bucket_bytes)


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


def counted_in_replica(p, m):
    """Whether this rank's copy of p counts in the norm of one data-parallel replica: tp-sharded parameters on
    every tp rank, replicated ones on tp rank 0; experts on every ep rank, on etp rank 0 unless etp-sharded."""
    kinds = shard_kinds(p)
    if "ep" in kinds:
        return "etp" in kinds or m.etp_rank == 0
    return "tp" in kinds or m.tp_rank == 0


def _unique_here(p, m):
    """Whether this rank holds the copy of p's gradient that the global norm counts (each element exactly once):
    after the DP reduction every dp replica is identical, so only dp (and cp) rank 0 (edp 0 for experts) counts."""
    if is_expert(p):
        return m.edp_rank == 0 and counted_in_replica(p, m)
    return m.dp_rank == 0 and m.cp_rank == 0 and counted_in_replica(p, m)


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
