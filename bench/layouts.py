"""Time train.py in several layouts of one model on this machine's GPUs against the chooser's, beside its predictions.

  python bench/layouts.py [--only NAME ...] [--steps 20] [--out DIR] [--real DIR] [--cap-gib GIB]

Each configuration (a layout at stage 2 and 3) runs `torchrun --standalone train.py ... --metrics-file` (with a `timeout`), and
`train.py ... --dry-run --world-size N --gpu-memory <this GPU's GiB>` for the plan. One JSON line per run: the
layout line the run printed, the step the chooser's cost model predicts (cost.py, the dry run's), the loss of the first and last step, and over the steps after the first two (warm:
compiled, tuned, the optimizer state made) the median step time, tok/s per GPU and MFU; per rank kind the largest
measured peak and the plan's. A run that fails or times out gives its last lines instead.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from memory_check import kinds_of_ranks  # noqa: E402

L20 = ["--preset", "20l"]   # 128 experts, seq 8192, one 2048 x 2048 mock image a sample, global batch 8
LAYOUTS = {   # name: train.py's grid flags (none: the chooser's)
    "chosen": [],
    "hetero-vtp2-ldp2ep2": ["--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "1", "--lm-dp", "2", "--lm-ep", "2"],
    "hetero-vtp2-ltp2ep2": ["--vision-tp", "2", "--vision-dp", "1", "--lm-tp", "2", "--lm-ep", "2", "--lm-dp", "1"],
    "hetero-vdp2-ldp2ep2": ["--vision-tp", "1", "--vision-dp", "2", "--lm-tp", "1", "--lm-dp", "2", "--lm-ep", "2"],
    # the 80 GB chooser's language layout (tp2 dp2 ep4) with the tower in place (tp2 dp2) or on its own lanes (dp4)
    "inplace-tp2ep4": ["--colocated", "--lm-tp", "2", "--lm-ep", "4"],
    # the chosen layout with both of a rank's samples in one micro-batch: half the exchanges, twice their rows
    "inplace-tp1ep4-mbs2": ["--colocated", "--lm-tp", "1", "--lm-dp", "4", "--lm-ep", "4", "--micro-batch", "2"],
    "shared-vdp4-ltp2ep4": ["--colocated", "--vision-tp", "1", "--vision-dp", "4", "--lm-tp", "2", "--lm-ep", "4",
                            "--micro-batch", "2"],
    # what else fits 80 GB at stage 2: experts over ep2 x etp2, the tower at tp4 on its own lanes, tp4 throughout
    "inplace-tp2ep2etp2": ["--colocated", "--lm-tp", "2", "--lm-ep", "2", "--lm-etp", "2"],
    "shared-vtp4-ltp2ep4": ["--colocated", "--vision-tp", "4", "--vision-dp", "1", "--lm-tp", "2", "--lm-ep", "4"],
    "inplace-tp4ep4": ["--colocated", "--lm-tp", "4", "--lm-ep", "4"],
    # pipeline stages (docs/pipeline.md): the tower on its own lanes at tp2, the language model in two stages of dp2
    # ep2, or four of ep1 (no all-to-all); the chooser's pick and pp2 again with 16 samples a step (the bubble)
    "shared-vtp2-pp2ep2": ["--colocated", "--vision-tp", "2", "--lm-pp", "2", "--lm-ep", "2"],
    "shared-vtp4-pp4": ["--colocated", "--vision-tp", "4", "--lm-pp", "4"],
    "chosen-gb16": ["--global-batch", "16"],
    "shared-vtp2-pp2ep2-gb16": ["--colocated", "--vision-tp", "2", "--lm-pp", "2", "--lm-ep", "2", "--global-batch",
                                "16"],
}
CONFIGS = {f"20l-stage{stage}-{name}": (4, L20 + flags + ["--stage", str(stage)])   # name: (GPUs, arguments)
           for stage in (2, 3) for name, flags in LAYOUTS.items()}
# Real-shaped data (bench/real_shaped.py, --real DIR): the 20l with 16 experts at stage 3 on one GPU, and on 2 GPUs
# in the chooser's pick and one layout of each other kind (bench/2026-11-28-real-shaped.md)
E16 = L20 + ["--n-routed-experts", "16", "--stage", "3", "--pack", "--overlong", "truncate", "--num-workers", "4"]
CONFIGS["20l16e-real-one"] = (1, E16)
CONFIGS.update({f"20l16e-real-{name}": (2, E16 + flags)
                for name, flags in {
                    "chosen": [],
                    "cp2": ["--colocated", "--lm-cp", "2"],
                    "hetero-v1-l1": ["--vision-tp", "1", "--vision-dp", "1", "--lm-tp", "1", "--lm-dp", "1"],
                    "own-vdp2-ltp2ep2": ["--colocated", "--vision-tp", "1", "--vision-dp", "2", "--lm-tp", "2",
                                         "--lm-ep", "2", "--micro-batch", "2"],
                    # the tower at tp2: at dp2 it keeps 3 micro-batches of the data's largest sample, over 139 GiB
                    "shared-vtp2-pp2": ["--colocated", "--vision-tp", "2", "--lm-pp", "2", "--micro-batch", "1"],
                }.items()})


def run(name, gpus, argv, steps, out, timeout, cap=None):
    """cap: GiB each rank is held to (bench/capped.py), planned for by the dry run too."""
    gib = cap or torch.cuda.get_device_properties(0).total_memory / 2**30
    dry = subprocess.run([sys.executable, "train.py", *argv, "--dry-run", "--world-size", str(gpus), "--gpu-memory",
                          f"{gib:.1f}"], cwd=ROOT, capture_output=True, text=True)
    plan = json.loads(dry.stdout.strip().splitlines()[-1]) if dry.returncode == 0 else {}
    metrics = os.path.join(out, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    script = ["bench/capped.py", str(cap)] if cap else ["train.py"]
    proc = subprocess.run(["timeout", "-s", "KILL", str(timeout), "torchrun", "--standalone",
                           f"--nproc_per_node={gpus}", *script, *argv, "--steps", str(steps), "--metrics-file",
                           metrics], cwd=ROOT, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    chosen = next((x for x in lines if x.startswith(("layout:", "hetero layout", "colocated layout"))), None)
    recs = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    if proc.returncode or len(recs) < steps:
        return {"name": name, "rc": proc.returncode, "steps": len(recs), "tail": (proc.stdout + proc.stderr)[-2000:]}
    warm = recs[2:]
    kinds = kinds_of_ranks(argv, gpus)
    peaks = {}
    for k, p in zip(kinds, recs[-1]["peak_mem_gib_per_rank"]):
        peaks[k] = max(peaks.get(k, 0.0), p)
    return {"name": name, "gpus": gpus, "device": torch.cuda.get_device_name(0), "layout": chosen,
            "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"],
            "step_s": statistics.median(r["step_time_s"] for r in warm),
            "tok_s_per_gpu": statistics.median(r["tokens_per_s_per_gpu"] for r in warm),
            "mfu": statistics.median(r["mfu"] or 0.0 for r in warm), "first_step_s": recs[0]["step_time_s"],
            "peak_gib": peaks, "plan_gib": {k: plan.get("peak_gib_per_rank", {}).get("language" if k == "both" else k) for k in peaks},
            "tower_load": plan.get("tower_load"), "predicted_s": plan.get("predicted_s"),
            "step_s_max_over_median": max(r["step_time_s"] for r in warm) / statistics.median(
                r["step_time_s"] for r in warm), "capped_gib": cap}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=int, default=240, help="seconds a run may take")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--real", metavar="DIR", default="/tmp/real-shaped", help="the real-shaped data set of the "
                   "20l16e-real-* configs: DIR/train.jsonl (bench/real_shaped.py writes it there if it is missing)")
    p.add_argument("--cap-gib", type=float, default=None, help="hold each rank to this many GiB (bench/capped.py)")
    a = p.parse_args()
    for name, (gpus, argv) in CONFIGS.items():
        if (a.only is None or name in a.only) and torch.cuda.device_count() >= gpus:
            if "-real-" in name:
                import real_shaped
                path = os.path.join(a.real, "train.jsonl")
                argv = argv + ["--data", path if os.path.exists(path) else real_shaped.write(a.real)]
            print(json.dumps(run(name, gpus, argv, a.steps, a.out, a.timeout, a.cap_gib)), flush=True)


if __name__ == "__main__":
    main()
