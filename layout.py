"""The run's layout: the sizes of both grids (docs/parallel.md §1, §4), their validation and the choice
of a layout when the command line names none. Pure: runs before init_process_group, and for --dry-run without it.

Hetero: vision on ranks [0, V), language on [V, V+L); colocated: both modules on every rank, with the same lanes
(in place) or each its own (parallel.py builds the grids and groups).

The choice (plan() given a rank's memory, no grid flag given): of the candidates (candidates(): in place,
each module its own lanes, hetero; the latter two also in pipeline stages) whose plan fits (memory.required), the
one cost.py predicts the fastest step for, cp only where nothing without it fits. Fitting comes first because a
layout that does not fit does not run; among those that do, the step time is what a user wants. The model and how
far it holds: docs/layouts.md §1.
"""
import dataclasses
import math
from dataclasses import dataclass

import config
import cost
import memory
import model

MAX_WORLD = 1024    # the largest world size remedy() tries
MAX_PP = 8          # the most pipeline stages the chooser weighs: each more adds a micro-batch to fill and drain


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
    # tp shards heads, Mamba heads and groups, MLP widths and the vocab-parallel embedding / cross-entropy
    for kind, split in (("lm_tp", ("num_attention_heads", "num_key_value_heads", "mamba_num_heads", "n_groups",
                                   "vocab_size", "intermediate_size", "moe_shared_expert_intermediate_size")),
                        ("vision_tp", ("vit_heads", "vit_mlp"))):
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


def plan(cfg, world, capacity=None, cuda=True, say=lambda line: None, strict=True, load=None):
    """The run's layout on `world` ranks from cfg's layout fields (None: not given), checked before any collective.

    - No layout field given: with `capacity` (bytes of memory per rank) the chosen layout (the module docstring;
      `say` gets one line: which and why), or a SystemExit naming what would fit when none does; without, the
      preset's reference layout on its world size, otherwise colocated data parallelism (tp = ep = etp = 1).
    - Any given: missing tp / ep / etp are 1 (colocated vision tp follows lm_tp), a missing dp is derived:
      colocated dp = world / tp; hetero takes the ranks the other grid leaves. `colocated` unset: hetero iff a
      vision size is given. With `capacity`, a layout that does not fit it is refused.
    cuda: plan CUDA's bytes (bf16 weights), else the CPU's (fp32). strict=False (the dry run, to show the plan):
    refuse nothing; when no layout fits, `say` what would and return the closest. load: the data's tower load
    (data.tower_load; None: the mock's), what the memory plan counts for the tower.
    """
    given = {k: getattr(cfg, k) for k in config.LAYOUT_FIELDS if getattr(cfg, k) is not None}
    if capacity is not None and not given:
        return choose(cfg, world, capacity, cuda, say, strict, load)
    lay = named(cfg, world, given) if capacity is None else fit_split(cfg, named(cfg, world, given), capacity, cuda,
                                                                      load)
    shortfall = capacity is not None and strict and memory.fits(memory.plan(cfg, lay, cuda, load), capacity)
    if shortfall:
        raise SystemExit(f"this layout does not fit: {lay.describe()} needs {shortfall}. Use more ranks (--lm-tp / "
                         "--lm-ep / --vision-tp), --activation-checkpointing, a smaller preset (tiny, small), or see "
                         "`--dry-run --world-size N` for the per-rank plan.")
    return lay


def fit_split(cfg, lay, capacity, cuda=True, load=None):
    """`lay` with its pipeline stages' layers moved where the compute split (model.stage_layers) leaves a stage
    short of `capacity` bytes (the first stage keeps the most micro-batches in flight): the stage that needs the
    most gives an edge layer to a neighbour, the move that lowers the most-needing stage's need the most, until
    every stage fits -> that layout, or `lay` where it fits already or no such moves make it fit. Fitting comes
    before speed (the module docstring): the moved layers slow the stage that takes them, and cost.py says by
    how much."""
    if lay.lm_pp == 1 or memory.fits(memory.plan(cfg, lay, cuda, load), capacity) is None:
        return lay

    def need(c):   # the most a stage of c needs (a hetero tower's row does not change)
        return max(memory.required({k: r}) for k, r in memory.plan(cfg, c, cuda, load).items() if k != "vision")
    n, moved = len(cfg.hybrid_override_pattern), lay
    while True:
        rows = memory.plan(cfg, moved, cuda, load)
        needs = [memory.required({"stage": rows[f"language pp{s}"]}) for s in range(lay.lm_pp)]
        worst, split = needs.index(max(needs)), [r.start for r in model.stage_layers(cfg, lay.lm_pp, moved.lm_split)]
        tries = []
        for i, step in ((worst, 1), (worst + 1, -1)):   # its first layer to the stage before, its last to the next
            if 0 < i < lay.lm_pp:
                starts = split[:i] + [split[i] + step] + split[i + 1:]
                if all(a < b for a, b in zip(starts, starts[1:] + [n])):
                    tries.append(dataclasses.replace(moved, lm_split=tuple(starts[1:])))
        best = min(tries, key=need, default=None)
        if best is None or need(best) >= max(needs):
            return lay
        moved = best
        if memory.fits(memory.plan(cfg, moved, cuda, load), capacity) is None:
            return moved


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


def candidates(cfg, world, apart=True):
    """The valid layouts the chooser weighs on `world` ranks: the reference layout where there is one; colocated in
    place (one tp and cp for both modules, ep x etp over all ranks, dp the rest); each module its own lanes on the
    shared ranks (the tower's own tp beside each language grid without cp, at pp 1 or in 2 to 8 pipeline stages);
    hetero (the tower on the first V ranks, any V, the language model on the rest, its tp, pp and ep). tp stays
    within a node beyond in place, and a micro-batch that does not split over the vision lanes is raised to the
    smallest that does. apart=False: the reference and in place only (remedy()'s search over world sizes: thousands
    of splits at each)."""
    def divisors(n, most=None):
        return [d for d in range(1, min(n, most or n) + 1) if n % d == 0]

    def split(colocated, vision_tp, vision_dp, lm_tp, lm_dp, lm_ep=1, lm_etp=1, lm_cp=1, lm_pp=1):
        mbs = cfg.micro_batch
        if mbs * lm_dp % vision_dp:   # the smallest multiple of `step` that also divides the batch, if one does
            step = vision_dp // math.gcd(lm_dp, vision_dp)
            mbs = next((m for m in range(-(-mbs // step) * step, cfg.global_batch // lm_dp + 1, step)
                        if cfg.global_batch % (m * lm_dp) == 0), mbs)
        return Layout(world, colocated, vision_tp, vision_dp, lm_tp, lm_dp, lm_ep, lm_etp, mbs, cfg.global_batch, lm_cp,
                      lm_pp)

    node, sizes = cost.GPUS_PER_NODE, divisors(world)
    stages = [pp for pp in range(1, MAX_PP + 1) if pp <= len(cfg.hybrid_override_pattern)]
    language = [(tp, cp, ep, etp) for tp in sizes for cp in sizes for ep in sizes for etp in sizes
                if world % (tp * cp) == 0 and world % (ep * etp) == 0]
    in_place = [split(True, tp, world // (tp * cp), tp, world // (tp * cp), ep, etp, cp)
                for tp, cp, ep, etp in language]
    own = [split(True, vtp, world // vtp, tp, world // (tp * pp), ep, etp, 1, pp) for tp, cp, ep, etp in language
           if cp == 1 for pp in stages if world % (tp * pp) == 0 for vtp in divisors(world, node)
           if (vtp != tp or pp > 1) and apart]
    hetero = [split(False, vtp, v // vtp, tp, (world - v) // (tp * pp), ep, 1, 1, pp) for v in range(1, world) if apart
              for vtp in divisors(v, node) for tp in divisors(world - v, node) for pp in stages
              if (world - v) % (tp * pp) == 0 for ep in divisors(world - v)
              if cfg.global_batch % ((world - v) // (tp * pp)) == 0]        # language dp divides the batch
    return [lay for lay in [reference(cfg, world)] + in_place + own + hetero if lay and valid(lay, cfg)]


def valid(lay, cfg):
    try:
        check_layout(lay, cfg)
    except SystemExit:
        return False
    return True


def choose(cfg, world, capacity, cuda, say, strict, load=None):
    """The layout the module docstring chooses for `capacity` bytes per rank; `say` gets which and why (not strict,
    the dry run: the table of candidates first). None fits: SystemExit naming what would (not strict: `say` that,
    and return the closest)."""
    plans = {lay: memory.plan(cfg, lay, cuda, load) for lay in map(lambda c: fit_split(cfg, c, capacity, cuda, load),
                                                                    candidates(cfg, world))}
    if not plans:       # nothing valid: the colocated dp layout's errors say why
        return named(cfg, world, {})
    fitting = [lay for lay, rows in plans.items() if memory.fits(rows, capacity) is None]
    fitting = [lay for lay in fitting if lay.lm_cp == 1] or fitting   # cp only where it is what fits
    if fitting:
        ranked = rank(cfg, fitting, cuda)
        (lay, seconds), runner_up = ranked[0], ranked[1:2]
        why = (f"the fastest predicted of the {len(fitting)} layouts that fit ({memory.figure(seconds['step'])} s a "
               "step" + "".join(f"; the next, {c.brief()}: {memory.figure(s['step'])} s" for c, s in runner_up) + ")")
        if not strict:
            for line in table(ranked, plans):
                say(line)
    else:
        lay = min(plans, key=lambda c: memory.required(plans[c]))
        why = (f"no layout of preset {cfg.preset} on {world} rank{'s' * (world > 1)} fits "
               f"{memory.figure(capacity / memory.GIB, 1)} GiB per rank (the closest: {lay.describe()} needs {memory.fits(plans[lay], capacity)}). "
               f"{remedy(cfg, world, capacity, cuda, load)}; `--dry-run --world-size N` shows the plan")
        if strict:
            raise SystemExit(why)
        say(why)
        return lay
    peak = max(r["peak"] for r in plans[lay].values())
    raised = (f"; micro-batch {lay.micro_batch}, not {cfg.micro_batch}, so that a micro-batch's samples split over "
              f"the {lay.vision_dp} vision lanes" if lay.micro_batch != cfg.micro_batch else "")
    say(f"layout: {lay.describe()}; planned peak {memory.figure(peak / memory.GIB, 1)} GiB per rank of "
        f"{memory.figure(capacity / memory.GIB, 1)} GiB, the tower at {memory.load_source(cfg, load)}; {why}{raised}")
    return lay


def rank(cfg, layouts, cuda=True):
    """[(layout, cost.step_seconds)] fastest first; a tie goes to in place, then own lanes, then fewer pipeline
    stages, then the smaller sizes."""
    kinds = ("in place", "own lanes", "hetero")
    seconds = {lay: cost.step_seconds(cfg, lay, cuda) for lay in layouts}
    return sorted(seconds.items(), key=lambda it: (round(it[1]["step"], 6), kinds.index(it[0].kind), it[0].lm_pp,
                                                   it[0].lm_tp,
                                                   it[0].lm_cp, it[0].lm_ep, it[0].lm_etp, it[0].vision_tp,
                                                   it[0].vision_size, it[0].micro_batch))


def table(ranked, plans, rows=8):
    """Lines of the dry run's table: the `rows` fastest candidates that fit and the fastest of each other kind."""
    kinds = {}
    for lay, s in ranked:
        kinds.setdefault(lay.kind, (lay, s))
    shown = ranked[:rows] + [it for it in kinds.values() if it not in ranked[:rows]]
    out = [f"layouts that fit, by predicted step time on Hopper GPUs (cost.py; {len(ranked)} fit; the {rows} fastest "
           "and the fastest of each kind), seconds:",
           "   step  vision  language  tail  bubble  peak GiB  layout"]
    for lay, s in shown:
        peak = max(r["peak"] for r in plans[lay].values()) / memory.GIB
        f = memory.figure
        out.append(f"  {f(s['step']):>5s}  {f(s['vision'], 3):>6s}  {f(s['language'], 3):>8s}  {f(s['tail']):>4s}  "
                   f"{100 * s['bubble']:5.0f}%  {f(peak, 1):>8s}  {lay.brief()}")
    return out


def remedy(cfg, world, capacity, cuda, load=None):
    """What would make some layout fit, checked by the same plan: --activation-checkpointing if it is off and
    enough; else the smallest larger world size (up to MAX_WORLD) and --lora-rank 8, where they would. Larger
    sizes are searched in place first (a few dozen candidates each, where the others are hundreds), then with
    every candidate (pipelines among them) at the sizes below the one found."""
    def fits_somewhere(c, w, apart=True):
        return any(memory.fits(memory.plan(c, lay, cuda, load), capacity) is None for lay in candidates(c, w, apart))

    if cuda and memory.BLAS_WORKSPACES > memory.TRAIN_SHARE * capacity:   # every layout's floor: no search can help
        return (f"Nor would any number of ranks: cuBLAS' workspaces alone take {memory.BLAS_WORKSPACES / 2 ** 20:.0f} "
                f"MiB a rank; --gpu-memory is in GiB")
    if not cfg.activation_checkpointing and fits_somewhere(dataclasses.replace(cfg, activation_checkpointing=True),
                                                           world):
        return "--activation-checkpointing would fit"
    fixes = []
    sizes = [w for w in sorted({world * 2 ** k for k in range(1, 11)} | set(range(8, MAX_WORLD + 1, 8)))
             if world < w <= MAX_WORLD]
    in_place = next((w for w in sizes if fits_somewhere(cfg, w, apart=False)), None)
    more = next((w for w in sizes if in_place and w < in_place and fits_somewhere(cfg, w)), in_place)
    if more:
        fixes.append(f"{more} such ranks would fit")
    if not cfg.lora_rank and fits_somewhere(dataclasses.replace(cfg, lora_rank=8), world):
        fixes.append(f"--lora-rank 8 (trains adapters only) would on these {world}")
    return ", or ".join(fixes) if fixes else (f"Nor would any world size up to {MAX_WORLD}: try a smaller preset, "
                                              "--micro-batch or --seq-len")
