"""Writes tuned.json, tuned.py's table: the config mamba_ssm's autotuner picks for each of its SSD kernels at the presets'
Mamba shapes, on this GPU. One process runs a Mamba2Mixer forward and backward (bf16 autocast, as training does)
for each shape family and each per-rank head count (heads / (tp x cp)), with the autotuner free to try every
config, then reads what it chose. Run it on an H100 (tuned.py applies the table on compute capability 9.0 only):

  python bench/tune_mamba.py     # rewrites tuned.json, the table tuned.py loads; review its diff and commit it

The autotuner's key is the kernel's shape arguments (chunk size, head dim, state size, heads, ...) plus the dtypes
of its tensors; the table keeps the shape part, so one entry serves fp32 and bf16 weights alike.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import tuned  # noqa: E402
from mamba import Mamba2Mixer  # noqa: E402

# (preset whose Mamba shape it is, heads per rank to tune, row length): the 20l / 54l / nano / super presets share
# head dim 64, state 128, chunk 128 and differ in heads (64 or 128) and in how tp x cp splits them
FAMILIES = [("tiny", (8, 4, 2), 96), ("small", (8, 4, 2), 1024), ("20l", (128, 64, 32, 16, 8), 8192)]


def run_mixer(preset, heads, seq_len):
    cfg = config.resolve(preset)
    groups = max(1, cfg.n_groups * heads // cfg.mamba_num_heads)
    cfg = config.resolve(preset, dict(mamba_num_heads=heads, n_groups=min(groups, heads)))
    mixer = Mamba2Mixer(cfg).cuda()
    with torch.no_grad():
        mixer.dt_bias.uniform_(-4, -2)
        mixer.A_log.uniform_(0, 2.7)
        mixer.D.fill_(1.0)
        mixer.norm.weight.fill_(1.0)
    u = torch.randn(1, seq_len, cfg.hidden_size, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        mixer(u).float().square().mean().backward()
    torch.cuda.synchronize()


def main():
    assert torch.cuda.is_available(), "tune_mamba needs a GPU"
    for preset, heads, seq_len in FAMILIES:
        for h in heads:
            run_mixer(preset, h, seq_len)
    table = {}
    for (name, shape), text in tuned.chosen().items():
        table.setdefault(name, {})[shape] = text
    path = os.path.join(os.path.dirname(os.path.abspath(tuned.__file__)), "tuned.json")
    with open(path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    print(f"{path}: {sum(map(len, table.values()))} configs, {torch.cuda.get_device_name()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
