"""The run's layout: the sizes of both grids (docs/parallel.md §1, §4) and their validation. Pure and planner-free
(config only): runs before init_process_group, and the grids (parallel.py) check a layout with it.

Hetero: vision on ranks [0, V), language on [V, V+L); colocated: both modules on every rank, with the same lanes
(in place) or each its own (parallel.py builds the grids and groups). Which layout a run takes when the command
line names none, and whether a named one fits a rank's memory: chooser.py.
"""
import dataclasses
from dataclasses import dataclass

import config


@dataclass(frozen=True)
class Layout:
    """Sizes of both grids. Colocated in place, the vision grid has the language grid's cp too: the cp ranks of a
    lane encode the same images (vision_cp). lm_pp: the language model's pipeline stages (stage_layers); colocated
    with pp > 1 each module has its own lanes (the tower on every rank, the language model's stages apart)."""
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
    lm_split: tuple = ()            # the first layer of each stage after the first; () the compute split (fit_split)

    @property
    def in_place(self):
        """Colocated with the same lanes on both modules (vision tp and dp those of the language model): the bridge
        hands the rows over in memory, and the cp ranks of a lane encode the same images (vision cp = lm cp).
        Colocated otherwise, each module has its own lanes on the shared ranks and rows travel between them."""
        return self.colocated and self.lm_pp == 1 and (self.vision_tp, self.vision_dp) == (self.lm_tp, self.lm_dp)

    @property
    def vision_cp(self):
        return self.lm_cp if self.in_place else 1

    @property
    def vision_size(self):
        return self.vision_tp * self.vision_cp * self.vision_dp

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
    def num_microbatches(self):         # counted from language dp, identical on both grids (docs/parallel.md §7)
        return self.global_batch // self.samples_per_microbatch

    @property
    def kind(self):
        return "in place" if self.in_place else "own lanes" if self.colocated else "hetero"

    def brief(self):
        """One short line: the kind, each grid's sizes, a micro-batch other than 1."""
        lm = f"tp{self.lm_tp}" + "".join(f" {k}{v}" for k, v in (("cp", self.lm_cp), ("dp", self.lm_dp),
                                                                  ("ep", self.lm_ep), ("etp", self.lm_etp),
                                                                  ("pp", self.lm_pp)) if v > 1)
        mbs = f", micro-batch {self.micro_batch}" if self.micro_batch > 1 else ""
        if self.in_place:
            return f"in place: {lm}{mbs}"
        vision = f"vision tp{self.vision_tp}" + (f" dp{self.vision_dp}" if self.vision_dp > 1 else "")
        if self.colocated:
            return f"own lanes: {vision} | language {lm}{mbs}"
        return f"hetero: {vision} on {self.vision_size} | language {lm} on {self.lm_size}{mbs}"

    def describe(self):
        cp = f" x cp{self.vision_cp}" if self.vision_cp > 1 else ""
        vision = f"vision {self.vision_size} (tp{self.vision_tp}{cp} x dp{self.vision_dp})"
        split = f" from layers 0, {', '.join(map(str, self.lm_split))}" if self.lm_split else ""
        lm = (f"language {self.lm_size} (tp{self.lm_tp} x cp{self.lm_cp} x dp{self.lm_dp} x pp{self.lm_pp}{split}; "
              f"experts etp{self.lm_etp} x ep{self.lm_ep} x edp{self.lm_edp})")
        if self.colocated:
            return f"colocated layout on {self.world} ranks: {vision}, {lm}"
        return f"hetero layout: {vision} on [0,{self.vision_size}) + {lm} on [{self.vision_size},{self.world})"


def check_layout(lay, cfg):
    """Every rule of docs/parallel.md §1 (decision D2) plus the model's divisibility needs. Raises one SystemExit
    listing all problems."""
    cp, vcp = lay.lm_cp, f" x cp{lay.vision_cp}" if lay.vision_cp > 1 else ""
    vision = f"vision {lay.vision_size} (tp{lay.vision_tp}{vcp} x dp{lay.vision_dp})"
    lm = f"language {lay.lm_size} (tp{lay.lm_tp} x cp{lay.lm_cp} x dp{lay.lm_dp} x pp{lay.lm_pp})"
    errors = []
    if lay.colocated:
        if lay.vision_size != lay.world or lay.lm_size != lay.world:
            errors.append(f"colocated layout: {vision} and {lm} must both equal WORLD_SIZE {lay.world}")
    elif lay.vision_size + lay.lm_size != lay.world:
        errors.append(f"hetero layout: {vision} + {lm} = {lay.vision_size + lay.lm_size} != WORLD_SIZE {lay.world}")
    sizes = {f.name: getattr(lay, f.name) for f in dataclasses.fields(lay)
             if f.name not in ("world", "colocated", "lm_split")}
    bad = [f"{k} {v}" for k, v in sizes.items() if not isinstance(v, int) or v < 1]
    if bad:  # the checks below divide by these
        raise SystemExit("bad parallel layout: sizes must be positive integers: " + ", ".join(bad)
                         + "".join(f"; {e}" for e in errors))
    layers = len(cfg.hybrid_override_pattern)
    if lay.lm_pp > layers:
        errors.append(f"language pp{lay.lm_pp}: more stages than the model's {layers} layers (--lm-pp {layers} at "
                      "most)")
    if cfg.seq_len % (2 * cp if cp > 1 else 1):   # cp.py's zigzag split
        errors.append(f"seq_len {cfg.seq_len} is not divisible by 2 x lm_cp = {2 * cp}: context parallelism cuts "
                      f"each row into 2 x cp equal chunks (--seq-len {cfg.seq_len // (2 * cp) * 2 * cp or 2 * cp} "
                      "would do)")
    tp_cp = lay.lm_tp * cp   # Mamba scans whole rows of 1 / (tp x cp) of its heads and groups (mamba.py)
    split = ("mamba_num_heads", "n_groups") if cp > 1 and "M" in cfg.hybrid_override_pattern else ()
    bad = [f"{name} {getattr(cfg, name)}" for name in split if getattr(cfg, name) % tp_cp]
    if bad:
        fits = max((c for c in range(1, cp) if all(getattr(cfg, n) % (lay.lm_tp * c) == 0 for n in split)), default=1)
        errors.append(f"lm_tp x lm_cp = {tp_cp} does not divide {' and '.join(bad)}: Mamba layers scan 1 / (tp x cp) "
                      f"of them a rank (--lm-cp {fits} would do)")
    tokens = lay.micro_batch * cfg.seq_len // cp   # MoE layers route each tp rank's slice of a rank's tokens
    if "E" in cfg.hybrid_override_pattern + cfg.mtp_pattern * bool(cfg.num_nextn_predict_layers) and tokens % lay.lm_tp:
        errors.append(f"micro_batch x seq_len / lm_cp = {tokens} tokens per rank are not divisible by lm_tp "
                      f"{lay.lm_tp} (MoE layers route 1 / tp of them on each tp rank)")
    # tp shards the vocab-parallel embedding / cross-entropy and what each layer kind of the model splits (heads,
    # Mamba heads and groups, MLP widths: config.LAYER_KINDS)
    layers = cfg.hybrid_override_pattern + cfg.mtp_pattern * bool(cfg.num_nextn_predict_layers)
    kinds = tuple(n for k, f in config.LAYER_KINDS.items() if k in layers for n in f["tp"])
    for kind, split in (("lm_tp", ("vocab_size", *dict.fromkeys(kinds))), ("vision_tp", ("vit_heads", "vit_mlp"))):
        tp = getattr(lay, kind)
        bad = [name for name in split if getattr(cfg, name) % tp]
        for name in bad:
            errors.append(f"{kind} {tp} does not divide {name} {getattr(cfg, name)}" + (
                f" (--vocab-size {-(-cfg.vocab_size // tp) * tp} would pad a new model's; a loaded model keeps its "
                "own)" if name == "vocab_size" else ""))
        if bad:
            fits = config.nearest_divisors(tuple(getattr(cfg, name) for name in split), tp, lay.world)
            errors.append(f"--{config.flag(kind)} {fits} would divide every size it splits")
    etp_ep_pp = lay.lm_etp * lay.lm_ep * lay.lm_pp
    if lay.lm_size % etp_ep_pp:
        errors.append(f"{lm} is not divisible by etp{lay.lm_etp} x ep{lay.lm_ep} x pp{lay.lm_pp} = {etp_ep_pp}, "
                      "so the expert data-parallel size is not whole")
    for kind, name in (("lm_ep", "n_routed_experts"), ("lm_etp", "moe_intermediate_size")):
        size, n = getattr(lay, kind), getattr(cfg, name)
        if n % size:
            errors.append(f"{kind} {size} does not divide {name} {n} (--{config.flag(kind)} "
                          f"{config.nearest_divisors((n,), size, lay.world)} would)")
    vdp, ldp, spm = lay.vision_dp, lay.lm_dp, lay.samples_per_microbatch
    if spm % vdp:
        fix = next(m for m in range(lay.micro_batch + 1, vdp * lay.micro_batch + 1) if m * ldp % vdp == 0)
        errors.append(f"micro_batch {lay.micro_batch} x language dp {ldp} = {spm} samples per microbatch do not "
                      f"split evenly over vision dp {vdp} (--micro-batch {fix} would)")
    if lay.global_batch % spm:
        near = sorted({max(lay.global_batch // spm, 1) * spm, -(-lay.global_batch // spm) * spm})
        errors.append(f"global_batch {lay.global_batch} is not divisible by micro_batch {lay.micro_batch} x "
                      f"language dp {ldp} = {spm} (--global-batch {' or '.join(map(str, near))} would be)")
    if errors:
        raise SystemExit("bad parallel layout: " + "; ".join(errors))
    return lay



def plan(cfg, world):
    """The layout cfg's layout fields (None: not given) name on `world` ranks, checked: missing tp / ep / etp are 1
    (colocated vision tp follows lm_tp), a missing dp is derived (colocated dp = world / tp; hetero takes the ranks
    the other grid leaves), `colocated` unset: hetero iff a vision size is given. None given: the preset's
    reference layout on its world size, otherwise colocated data parallelism (tp = ep = etp = 1)."""
    return named(cfg, world, given(cfg))


def given(cfg):
    """{field: value} of the layout fields cfg gives (not None)."""
    return {k: getattr(cfg, k) for k in config.LAYOUT_FIELDS if getattr(cfg, k) is not None}


def named(cfg, world, given):
    """The layout the `given` layout fields name (see plan()); none given: the reference or colocated dp."""
    ref = reference(cfg, world)
    if ref and given in ({}, {"colocated": ref.colocated}):
        return check_layout(ref, cfg)
    given = dict(given)
    colocated = given.pop("colocated", None)
    if colocated is None:
        colocated = "vision_tp" not in given and "vision_dp" not in given
    s = dict(vision_tp=1, vision_dp=None, lm_tp=1, lm_dp=None, lm_ep=1, lm_etp=1, lm_cp=1, lm_pp=1)
    s.update(given)
    lane = s["lm_tp"] * s["lm_cp"] * s["lm_pp"]   # the language ranks of one data lane
    if colocated:
        s["vision_tp"] = given.get("vision_tp", s["lm_tp"])
        s["lm_dp"] = s["lm_dp"] or world // lane
        s["vision_dp"] = s["vision_dp"] or (s["lm_dp"] if s["vision_tp"] == s["lm_tp"] and s["lm_pp"] == 1 else
                                            world // s["vision_tp"])
    elif s["vision_dp"] is None and s["lm_dp"] is None:
        raise SystemExit("bad parallel layout: a hetero layout needs --vision-dp or --lm-dp (the other is derived "
                         "from WORLD_SIZE)")
    elif s["vision_dp"] is None:
        s["vision_dp"] = (world - lane * s["lm_dp"]) // s["vision_tp"]
    elif s["lm_dp"] is None:
        s["lm_dp"] = (world - s["vision_tp"] * s["vision_dp"]) // lane
    return check_layout(Layout(world=world, colocated=bool(colocated), **s, micro_batch=cfg.micro_batch,
                               global_batch=cfg.global_batch), cfg)


def reference(cfg, world):
    """The preset's reference layout (config.REFERENCE_LAYOUTS, unchecked) if `world` is its world size, else None."""
    ref_world, ref = config.REFERENCE_LAYOUTS.get(cfg.preset, (None, None))
    return Layout(world=world, **ref, micro_batch=cfg.micro_batch, global_batch=cfg.global_batch) \
        if world == ref_world else None


def valid(lay, cfg):
    try:
        check_layout(lay, cfg)
    except SystemExit:
        return False
    return True
