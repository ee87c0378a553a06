"""Where a data set's steps put their work, measured before a long run and without a GPU: over the first --steps
steps of --data under train.py's flags, how full the rows are, the tower's share of the FLOPs and, for each lane
layout asked, the lanes' imbalance with the samples in index order (before issue 55) and as train.py assigns them
(lanes.py), with the step the layout chooser predicts for it. Everything comes from the data's index (nothing is
decoded).

  python bench/data_stats.py --data PATH --preset nano --pack --overlong truncate [train.py's flags ...]
      [--steps 20] [--lanes 2,4,1:2]

--lanes: N is N lanes in place (both modules on each); V:L is V vision lanes beside L language lanes (hetero), one
GPU a lane (tp 1). Imbalance: per micro-batch the slowest lane's predicted work over the mean lane's, summed over
micro-batches (lanes.imbalance; 1.00 is even). The predicted step is the chooser's, the figure `train.py --dry-run
--data PATH` prints for that layout: cost.step_seconds of cost.data_stats (the run's first steps of at least
cost.DATA_SAMPLES samples, placed as the run places them; compute, collectives, the time outside the kernels, the
pipe's fill and the optimizer's tail). The last line is one JSON object.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cli  # noqa: E402
import cost  # noqa: E402
import data  # noqa: E402
import lanes  # noqa: E402
import layout  # noqa: E402
import memory  # noqa: E402

RATES = (cost.LM_EFFICIENCY, cost.VISION_EFFICIENCY)


def grid(spec, cfg):
    """A --lanes entry -> its Layout (tp 1), checked like train.py's."""
    v, _, lm = spec.partition(":")
    v, lm = int(v), int(lm or v)
    lay = layout.Layout(world=v if spec.isdigit() else v + lm, colocated=spec.isdigit(), vision_tp=1, vision_dp=v,
                        lm_tp=1, lm_dp=lm, micro_batch=cfg.micro_batch, global_batch=cfg.global_batch)
    return layout.check_layout(lay, cfg)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lanes", default="2,4")
    ours, rest = p.parse_known_args(argv)
    cfg = cli.config_of(rest)
    if cfg.data == "mock":
        raise SystemExit("--data PATH: the data set to measure")
    ds, _ = data.build(cfg, data.load_tokenizer(cfg.tokenizer, cfg), verbose=False)
    trains, n = memory.tower_trains(cfg), ours.steps * cfg.global_batch
    flops = lanes.costs(cfg, ds, range(n), trains, (1.0, 1.0))          # (language, vision) FLOPs a sample
    tokens = sum(data.sizes(ds, i)[0] for i in range(n))
    fill, tower = tokens / (n * cfg.seq_len), math.fsum(v for _, v in flops) / math.fsum(map(sum, flops))
    stats = cost.data_stats(cfg, ds)   # what the chooser predicts from (train.py's set-up and --dry-run)
    basis = cost.basis(cfg, stats)
    print(f"{cfg.data}: preset {cfg.preset}, seq_len {cfg.seq_len}{', packed' if cfg.pack else ''}, global batch "
          f"{cfg.global_batch}, micro-batch {cfg.micro_batch}: the first {ours.steps} steps ({n} rows)")
    print(f"fill {fill:.1%} (non-padding tokens over the rows' room) | tower {tower:.1%} of the FLOPs")
    print(f"predicted step: the chooser's on Hopper GPUs, as `train.py --dry-run` prints it (cost.py, for {basis})")
    print(f"{'lanes':>14} | {'vision imbalance':>16} | {'language':>12} | predicted step (s)")
    out = {"data": cfg.data, "steps": ours.steps, "fill": fill, "tower_share": tower,
           "predicted_for": basis, "layouts": {}}
    for spec in ours.lanes.split(","):
        lay = grid(spec, cfg)
        got = {"today": [], "balanced": []}
        for s in range(ours.steps):
            work = [(lm / RATES[0], v / RATES[1]) for lm, v in flops[s * cfg.global_batch:(s + 1) * cfg.global_batch]]
            for name, order in (("today", range(len(work))), ("balanced", lanes.assign(lay, work))):
                got[name].append(lanes.imbalance(lay, [work[o] for o in order]))
        mean = {k: [None if None in col else sum(col) / len(col) for col in zip(*v)] for k, v in got.items()}
        predicted = cost.step_seconds(cfg, lay, stats=stats)
        na = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        name = f"in place {spec}" if lay.in_place else f"hetero {spec}"
        (tv, tl), (bv, bl) = mean["today"], mean["balanced"]
        print(f"{name:>14} | {na(tv):>6} -> {na(bv):>6} | {na(tl)} -> {na(bl)} | {predicted['step']:.3f}")
        out["layouts"][spec] = {**{k: dict(zip(("vision", "lm"), v)) for k, v in mean.items()},
                                "predicted_s": {k: round(v, 4) for k, v in predicted.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
