"""A fork's new layer kind, added as docs/forking.md §2 lists: a gated MLP mixer (pattern character G) defined here,
one row in config.LAYER_KINDS and one in model.KINDS. It trains the same in one process and at tp2 over 2 ranks,
and the memory plan and the cost model count it by its own facts."""
import dataclasses
import json

import pytest
import torch.nn as nn
import torch.nn.functional as F

import cli
import comm
import config
import cost
import layout
import memory
import model
import train
from tests.spawn import run_distributed


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): gate and up column-parallel over tp, down row-parallel."""

    def __init__(self, cfg, tp_group=None):
        super().__init__()
        self.tp_group, local = tp_group, cfg.intermediate_size // comm.group_size(tp_group)
        self.gate_proj = nn.Linear(cfg.hidden_size, local, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, local, bias=False)
        self.down_proj = nn.Linear(local, cfg.hidden_size, bias=False)
        for lin in (self.gate_proj, self.up_proj):
            comm.mark_shard(lin.weight, ("tp", 0, None))
        comm.mark_shard(self.down_proj.weight, ("tp", 1, None))

    def forward(self, x, seq_idx=None, valid_BL=None):
        x = comm.copy_to(x, self.tp_group)
        return comm.reduce_from(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.tp_group)


def gated_facts(cfg, seq_len, T=0, tp=1, cp=1, ep=1, etp=1):
    """Saved: the input, gate's and up's outputs, down's input (bf16); one tp all-reduce a pass."""
    D, F_ = cfg.hidden_size, cfg.intermediate_size
    return {"flops": 0, "idle": 0, "saved": 2 * T * D + 3 * 2 * T * F_ / tp, "exchange": 0,
            "sends": {"tp": (2 * (tp - 1) / tp * 2 * T * D, 1)}}


@pytest.fixture
def gated(monkeypatch):
    monkeypatch.setitem(config.LAYER_KINDS, "G", dict(sizes=("intermediate_size",), tp=("intermediate_size",)))
    monkeypatch.setitem(model.KINDS, "G", (lambda cfg, g, d: GatedMLP(cfg, g.get("tp")), gated_facts))


ARGV = ["--preset", "tiny", "--hybrid-override-pattern", "MG*E", "--steps", "3", "--global-batch", "4",
        "--mock-num-samples", "4", "--lr", "3e-3", "--lr-schedule", "constant"]


@pytest.mark.slow
def test_a_new_kind_trains_alike_in_two_layouts(gated):
    (one,) = run_distributed(lambda rank, world: [h["loss"] for h in train.main(ARGV)[0]], 1, timeout=60.0)
    tp2 = run_distributed(lambda rank, world: [h["loss"] for h in train.main(ARGV + ["--lm-tp", "2"])[0]], 2,
                          timeout=60.0)
    assert one[-1] < one[0], one                                    # it learns
    for losses in tp2:
        assert max(abs(a - b) for a, b in zip(losses, one)) <= 1e-5, (losses, one)


def test_a_new_kind_is_planned_by_its_facts(gated, capsys):
    cfg = cli.config_of(ARGV)
    lay = layout.Layout(world=1, colocated=True, vision_tp=1, vision_dp=1, lm_tp=1, lm_dp=1, lm_ep=1, lm_etp=1,
                        micro_batch=1, global_batch=4)
    T, D, F_ = cfg.seq_len, cfg.hidden_size, cfg.intermediate_size
    mlp = memory.plan(dataclasses.replace(cfg, hybrid_override_pattern="M-*E"), lay)["language"]
    new = memory.plan(cfg, lay)["language"]
    # the MLP saves one bf16 T x F tensor (up's output: moe.relu2_down), the gated one three; it holds D x F more
    # weights
    assert new["activations"] - mlp["activations"] == 2 * 2 * T * F_ == 24576
    assert new["weights"] - mlp["weights"] == 2 * D * F_
    assert cost.step_seconds(cfg, lay)["step"] > cost.step_seconds(dataclasses.replace(
        cfg, hybrid_override_pattern="M-*E"), lay)["step"]          # its third matmul's FLOPs
    memory.dry_run(cfg, lay, 80 * memory.GIB, cost.step_seconds(cfg, lay))
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["fits"] == {"vision": True, "language": True} and last["params_language"] == model.count_language_params(cfg)[0]
