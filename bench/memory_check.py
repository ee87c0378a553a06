"""Check the --dry-run memory plan (memory.py) against torch.cuda.max_memory_allocated of real training steps.

  python bench/memory_check.py [--only NAME ...] [--steps 3] [--out bench/memory_check.md]

Each configuration runs `torchrun train.py ... --metrics-file` on as many GPUs as it needs (skipped, and listed as
skipped, when this machine has fewer), and `train.py ... --dry-run --world-size N` for the plan. Per rank kind the
table holds the plan's peak, the largest measured peak of the ranks of that kind (after --steps steps, so with the
optimizer state), and measured / plan. The issue's bar: within 10 %.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import layout  # noqa: E402
import cli  # noqa: E402

E16 = ["--preset", "20l", "--n-routed-experts", "16"]
CONFIGS = {   # name: (GPUs, train.py arguments)
    "20l-16experts-1gpu": (1, E16 + ["--global-batch", "2"]),
    "20l-16experts-1gpu-ac": (1, E16 + ["--global-batch", "2", "--activation-checkpointing"]),
    "20l-16experts-1gpu-plain": (1, E16 + ["--global-batch", "2", "--no-distributed-optimizer"]),
    "20l-16experts-1gpu-stage3": (1, E16 + ["--global-batch", "2", "--stage", "3", "--activation-checkpointing"]),
    "nano-lora8-1gpu-ac": (1, ["--preset", "nano", "--lora-rank", "8", "--activation-checkpointing",
                               "--global-batch", "2"]),
    "20l-colocated-ep2-dp2": (2, ["--preset", "20l", "--colocated", "--lm-ep", "2", "--lm-dp", "2",
                                  "--global-batch", "4"]),
    "20l-colocated-ep2-dp2-plain": (2, ["--preset", "20l", "--colocated", "--lm-ep", "2", "--lm-dp", "2",
                                        "--global-batch", "4", "--no-distributed-optimizer"]),
    "20l-16experts-dp2": (2, E16 + ["--colocated", "--lm-dp", "2", "--global-batch", "4"]),
    "20l-16experts-hetero-v1-l1": (2, E16 + ["--vision-dp", "1", "--lm-dp", "1", "--global-batch", "2"]),
}


def kinds_of_ranks(argv, world):
    """The memory plan's row of each rank of this layout (memory.plan): "vision", "language" or with pipeline
    stages "language pp{s}"; colocated without stages "both" (either row)."""
    lay = layout.plan(cli.config_of(argv), world)
    stage = lay.lm_tp * lay.lm_cp * lay.lm_dp   # ranks a pipeline stage spans (parallel.lm_grid)
    return ["vision" if not lay.colocated and r < lay.vision_size else
            f"language pp{(r - lay.lm_offset) // stage}" if lay.lm_pp > 1 else "both" if lay.colocated else "language"
            for r in range(world)]


def check(name, gpus, argv, steps):
    dry = subprocess.run([sys.executable, "train.py", *argv, "--dry-run", "--world-size", str(gpus)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    plan = json.loads(dry.stdout.strip().splitlines()[-1])["peak_gib_per_rank"]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        run = subprocess.run(["torchrun", f"--nproc_per_node={gpus}", "train.py", *argv, "--steps", str(steps),
                              "--metrics-file", metrics], cwd=ROOT, capture_output=True, text=True)
        if run.returncode:
            return {"name": name, "error": (run.stdout + run.stderr)[-3000:]}
        recs = [json.loads(line) for line in open(metrics)]
    measured = recs[-1]["peak_mem_gib_per_rank"]
    rows = {}
    for kind, m in zip(kinds_of_ranks(argv, gpus), measured):
        key = "language" if kind == "both" else kind
        rows[key] = max(rows.get(key, 0.0), m)
    return {"name": name, "gpus": gpus, "argv": " ".join(argv), "loss": [r["loss"] for r in recs],
            "kinds": {k: {"plan_gib": plan[k], "measured_gib": v, "ratio": v / plan[k]} for k, v in rows.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=None, choices=sorted(CONFIGS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None, help="markdown report")
    a = p.parse_args()
    have = torch.cuda.device_count()
    results = []
    for name in a.only or CONFIGS:
        gpus, argv = CONFIGS[name]
        r = check(name, gpus, argv, a.steps) if gpus <= have else {"name": name, "skipped": f"needs {gpus} GPUs"}
        print(json.dumps(r), flush=True)
        results.append(r)
    device = torch.cuda.get_device_name(0) if have else "no GPU"
    lines = [f"# Memory plan vs measured peak ({datetime.date.today()}, {have} x {device})", "",
             "`python bench/memory_check.py` - plan: `train.py --dry-run --world-size N`; measured: "
             f"torch.cuda.max_memory_allocated after {a.steps} steps (largest rank of each kind).", "",
             "| configuration | GPUs | rank kind | plan GiB | measured GiB | measured / plan |", "|---|---|---|---|---|---|"]
    for r in results:
        if "kinds" not in r:
            lines.append(f"| {r['name']} | | | | | {r.get('skipped') or 'failed'} |")
            continue
        for kind, k in r["kinds"].items():
            lines.append(f"| {r['name']} | {r['gpus']} | {kind} | {k['plan_gib']:.2f} | {k['measured_gib']:.2f} | "
                         f"{k['ratio']:.3f} |")
    lines += ["", "Arguments:", ""] + [f"- {n}: `{' '.join(CONFIGS[n][1])}`" for n in a.only or CONFIGS]
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
