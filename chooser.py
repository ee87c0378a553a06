"""Which layout a run takes (docs/layouts.md §1): with no grid flag, of the candidates whose memory plan fits, the one
cost.py predicts the fastest step for, cp only where nothing without it fits. Fitting comes first because a layout
that does not fit does not run; among those that do, the step time is what a user wants. A layout the flags name
runs as named, with one warning line where its plan exceeds the memory.
"""
import dataclasses
import math

import cost
import memory
import model
from layout import Layout, named, reference, valid, given

MAX_WORLD = 1024    # the largest world size remedy() tries
MAX_PP = 8          # the most pipeline stages the chooser weighs: each more adds a micro-batch to fill and drain


def plan(cfg, world, capacity, cuda=True, say=lambda line: None, strict=True, load=None, stats=None):
    """The run's layout on `world` ranks of `capacity` bytes, before any collective: chosen (choose), or the one
    the flags name with its stages' layers moved where a stage would not fit (fit_split), run as named even where
    its plan exceeds `capacity` (the plan is an estimate; the run's peak is the fact). cuda: plan CUDA's bytes, else
    the CPU's. load: the data's tower load (memory.tower_load; None: the mock's); stats: what the predicted step
    reads of the data (cost.data_stats; None: the mock's samples)."""
    flags = given(cfg)
    if not flags:
        return choose(cfg, world, capacity, cuda, say, strict, load, stats)
    lay = fit_split(cfg, named(cfg, world, flags), capacity, cuda, load)
    shortfall = strict and memory.fits(memory.plan(cfg, lay, cuda, load), capacity)
    if shortfall:
        say(f"warning: this layout may not fit: {lay.describe()} needs {shortfall}. It runs as named; if it runs "
            "out of memory: more ranks (--lm-tp / --lm-ep / --vision-tp), --activation-checkpointing, or "
            "`--dry-run --world-size N` without grid flags for a layout that fits")
    return lay


def fit_split(cfg, lay, capacity, cuda=True, load=None):
    """`lay` with its pipeline stages' layers moved where the compute split leaves a stage short of `capacity` (the
    first stage keeps the most micro-batches in flight): the stage that needs the most gives an edge layer to the
    neighbour that lowers its need the most, until every stage fits; `lay` where no such moves make it fit."""
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


def candidates(cfg, world, apart=True):
    """The valid layouts the chooser weighs on `world` ranks: the reference layout; colocated in place; each module
    its own lanes on the shared ranks (at pp 1 to MAX_PP); hetero (the tower on the first V ranks, any V). tp stays
    within a node beyond in place; a micro-batch that does not split over the vision lanes is raised to the
    smallest that does. apart=False: the reference and in place only (remedy()'s search over world sizes)."""
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


def choose(cfg, world, capacity, cuda, say, strict, load=None, stats=None):
    """The layout the module docstring chooses; `say` gets which and why (not strict, the dry run: the table first).
    None fits: SystemExit naming what would (not strict: `say` that, and return the closest)."""
    plans = {lay: memory.plan(cfg, lay, cuda, load) for lay in map(lambda c: fit_split(cfg, c, capacity, cuda, load),
                                                                    candidates(cfg, world))}
    if not plans:       # nothing valid: the colocated dp layout's errors say why
        return named(cfg, world, {})
    fitting = [lay for lay, rows in plans.items() if memory.fits(rows, capacity) is None]
    fitting = [lay for lay in fitting if lay.lm_cp == 1] or fitting   # cp only where it is what fits
    if fitting:
        ranked = rank(cfg, fitting, cuda, stats)
        (lay, seconds), runner_up = ranked[0], ranked[1:2]
        why = (f"the fastest predicted of the {len(fitting)} layouts that fit ({memory.figure(seconds['step'])} s a "
               f"step for {cost.basis(cfg, stats)}" + "".join(f"; the next, {c.brief()}: {memory.figure(s['step'])} s"
                                                              for c, s in runner_up) + ")")
        if not strict:
            for line in table(ranked, plans):
                say(line)
    else:
        lay = min(plans, key=lambda c: memory.required(plans[c]))
        why = (f"no layout of preset {cfg.preset} on {world} rank{'s' * (world > 1)} fits "
               f"{memory.figure(capacity / memory.GIB, 1)} GiB per rank (the closest: {lay.describe()} needs "
               f"{memory.fits(plans[lay], capacity)}). "
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


def rank(cfg, layouts, cuda=True, stats=None):
    """[(layout, cost.step_seconds)] fastest first; a tie goes to in place, then own lanes, then fewer pipeline
    stages, then the smaller sizes."""
    kinds = ("in place", "own lanes", "hetero")
    seconds = {lay: cost.step_seconds(cfg, lay, cuda, stats) for lay in layouts}
    return sorted(seconds.items(), key=lambda it: (round(it[1]["step"], 6), kinds.index(it[0].kind), it[0].lm_pp,
                                                   it[0].lm_tp, it[0].lm_cp, it[0].lm_ep, it[0].lm_etp,
                                                   it[0].vision_tp, it[0].vision_size, it[0].micro_batch))


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
    """What would make some layout fit, checked by the same plan: --activation-checkpointing; else the smallest
    larger world size and --lora-rank 8. Sizes are searched in place first (a few dozen candidates each, where
    the others are hundreds), then with every candidate below the size found."""
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
