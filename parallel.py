"""Rank grids and process groups (docs/parallel.md; the layout is layout.py, the bridge bridge.py, what happens to
gradients after backward optim.py). Each module lives on a grid, a rank tensor
`arange(size).view(pp, dp, cp, tp) + offset` (docs/parallel.md §2, §3); every group the code reads is a slice of one,
created in one fixed order on every rank (§5).
"""
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import watchdog
from layout import Layout, check_layout


# ---------------------------------------------------------------- grid

class Grid:
    """Ranks [offset, offset+size) as a tensor. `dims` maps names to sizes, FASTEST first (tp, cp, dp, pp).
    Megatron's HyperCommGrid rank algebra: rank = offset + tp_i + tp*(cp_i + cp*(dp_i + dp*pp_i)). The expert view is
    a second Grid over the same ranks with dims (etp, ep, edp, pp)."""

    def __init__(self, dims, offset=0):
        self.names = list(dims)
        self.shape = [dims[n] for n in self.names]
        self.size = math.prod(self.shape)
        self.offset = offset
        # tensor axes are slowest first, so names[0] ends up with stride 1
        self.ranks = torch.arange(self.size).view(*reversed(self.shape)) + offset

    def groups(self, dims):
        """Rank lists of the groups spanning `dims` ("tp-dp" or a list), in canonical order (docs/parallel.md §3).
        Requested axes go last (slowest first), the others first; each row of the reshape is one group. So inside a
        group the dim earliest in `names` varies fastest, and groups follow the other dims, latest name outermost.
        The order in which `dims` is written does not matter."""
        dims = dims.split("-") if isinstance(dims, str) else list(dims)
        for d in dims:
            if d not in self.names:
                raise ValueError(f"{d!r} is not a dim of grid {self.names}")
        keep = sorted({len(self.names) - 1 - self.names.index(d) for d in dims})   # tensor axes: slowest first
        rest = [a for a in range(len(self.names)) if a not in keep]
        group_size = math.prod(self.ranks.shape[a] for a in keep)
        return self.ranks.permute(rest + keep).reshape(-1, group_size).tolist()

    def __contains__(self, rank):
        return self.offset <= rank < self.offset + self.size

    def coords(self, rank):
        assert rank in self, f"rank {rank} is not in grid [{self.offset}, {self.offset + self.size})"
        i, out = rank - self.offset, {}
        for name, n in zip(self.names, self.shape):
            out[name], i = i % n, i // n
        return out


def vision_grid(lay):
    """In place (Layout.in_place), the language grid's cp too: the cp ranks of a lane encode the same images, so
    each holds the rows its positions need and the tower's gradient is summed over dp-cp like the language model's."""
    return Grid({"tp": lay.vision_tp, "cp": lay.vision_cp, "dp": lay.vision_dp, "pp": 1}, offset=0)


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


# ---------------------------------------------------------------- setup

@dataclass
class ModuleGroups:
    """One module's groups and coordinates as seen from this rank. A group is None where the module uses none."""
    name: str                                   # "vision" or "lm"
    tp: object = None
    cp: object = None                           # language only
    dp_cp: object = None                        # dense gradient reduction domain
    tp_cp: object = None                        # language only: a lane's bridge broadcast
    tp_dp_cp: object = None                     # language only: MoE expert-bias token counts (a stage's)
    pp: object = None                           # language only: a rank and its peers in the other stages
    ep: object = None                           # expert view (language only)
    etp: object = None
    edp: object = None                          # expert gradient reduction domain
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

    def shards(self):
        """({kind: rank}, {kind: size}) over the kinds this module's tensors are sliced by (comm.mark_shard): tp,
        and for the language model's experts ep and etp."""
        kinds = ("tp",) if self.name == "vision" else ("tp", "ep", "etp")
        return {k: getattr(self, f"{k}_rank") for k in kinds}, {k: getattr(self, f"{k}_size") for k in kinds}

    @property
    def lane_lead(self):
        """The rank that counts its data lane's values once (tokens, FLOPs): tp 0, cp 0, the last pp stage."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp_size - 1

    def identity(self):
        cp = f" cp{self.cp_rank}/{self.cp_size}" if self.cp_size > 1 else ""
        pp = f" pp{self.pp_rank}/{self.pp_size}" if self.pp_size > 1 else ""
        s = f"{self.name} tp{self.tp_rank}/{self.tp_size}{cp} dp{self.dp_rank}/{self.dp_size}{pp}"
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
        return " | ".join(m.identity() for m in (self.vision, self.lm) if m is not None) + f" rank{self.rank}"


def one_device():
    """Both modules in one process without process groups: init.build, vlm.loss, bench.py on one device."""
    return Parallel(0, None, ModuleGroups("vision"), ModuleGroups("lm"))


VISION_GROUPS = ["tp", "dp-cp"]
LM_GROUPS = ["tp", "cp", "dp-cp", "tp-cp", "tp-dp-cp", "pp"]
EXPERT_GROUPS = ["ep", "etp", "edp"]


def setup(lay, cfg=None):
    """Build both grids and create the groups the code uses on EVERY rank (new_group is collective over WORLD),
    after init_process_group. Creation order is fixed (docs/parallel.md §5): VISION_GROUPS, LM_GROUPS, EXPERT_GROUPS,
    the bridge group (no embedding groups: the head is untied, and MTP gets the decoder input from the first
    stage). Identical rank lists share one group object (colocated grids, size-1 dims): every rank computes the
    same lists, so the sequence of new_group calls is still identical everywhere. With cfg every group gets torch's
    timeout watchdog.backstop(cfg.collective_timeout); each group is named for watchdog's messages."""
    timeout = None
    if cfg is not None:
        check_layout(lay, cfg)
        timeout = watchdog.backstop(cfg.collective_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == lay.world, f"layout is for {lay.world} ranks, WORLD_SIZE is {world}"
    vgrid, lgrid, egrid = vision_grid(lay), lm_grid(lay), expert_grid(lay)
    par = Parallel(rank=rank, layout=lay)
    made = {}

    def create(label, rank_lists):
        par.created.append((label, rank_lists))
        mine = None
        for ranks in rank_lists:
            if tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    watchdog.name(made[tuple(ranks)], label)
            if rank in ranks:
                mine = made[tuple(ranks)]
        return mine

    def fill(m, label, grid, dims_list):
        for dims in dims_list:
            g = create(f"{label} {dims}", grid.groups(dims))
            if m is not None:
                setattr(m, dims.replace("-", "_"), g)
        if m is not None:
            for d, i in grid.coords(rank).items():
                setattr(m, f"{d}_rank", i)
                setattr(m, f"{d}_size", grid.shape[grid.names.index(d)])

    par.vision = ModuleGroups("vision") if rank in vgrid else None
    par.lm = ModuleGroups("lm") if rank in lgrid else None
    fill(par.vision, "vision", vgrid, VISION_GROUPS)
    fill(par.lm, "lm", lgrid, LM_GROUPS)
    fill(par.lm, "lm", egrid, EXPERT_GROUPS)       # same ranks, expert coordinates
    if not lay.in_place:
        # the lane broadcast groups (docs/parallel.md §6) are vision tp (vision cp = 1 here) and the first stage's
        # language tp-cp, created above: the rows go to the first stage (lanes(lgrid)[j][0] is its tp 0 cp 0)
        leaders = sorted({lane[-1] for lane in lanes(vgrid)} | {lane[0] for lane in lanes(lgrid)})
        par.bridge = create("bridge", [leaders])
    return par


def print_ranks(par):
    """Rank 0 prints the layout and one identity line per rank, in rank order (collective over WORLD)."""
    lines = [None] * par.layout.world
    dist.all_gather_object(lines, str(par))
    if par.rank == 0:
        print(par.layout.describe(), *lines, sep="\n  ", flush=True)
