"""bench.py on the CPU: its parts run on train.py's code paths and report figures that add up."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.test_run import ENV, ROOT


@pytest.mark.slow
def test_bench_parts_and_train_figures():
    """lm and train (a lone process: a group of one), tiny preset, seq 96: tokens/s is tokens over the time, the
    train part's two runs (router as trained, forced balance) both report; the last line is the JSON record."""
    out = subprocess.run([sys.executable, "bench.py", "--preset", "tiny", "--parts", "lm,moe,train", "--iters", "2",
                          "--warmup", "1", "--train-args", "--global-batch 2"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["lm"]["tokens_per_s"] == pytest.approx(96 / (res["lm"]["ms"] / 1e3))
    assert res["moe"]["tokens_per_s"] == pytest.approx(96 / (res["moe"]["ms"] / 1e3))
    tr = res["train"]
    assert tr["world"] == 1
    for run in ("real", "balanced"):   # 2 samples x 96 tokens a step, one process
        assert tr[f"{run}_tokens_per_s_per_gpu"] == pytest.approx(2 * 96 / (tr[f"{run}_ms"] / 1e3))
    assert res["preset"] == "tiny" and res["seq_len"] == 96


@pytest.mark.slow
def test_startup_profile_sees_the_backward(tmp_path):
    """bench/startup.py: the profile holds train.py's step and the backward pass's Python (on CUDA autograd runs it
    on another thread unless startup.py turns that off; on the CPU it is this one), and its stats load with pstats."""
    import pstats
    stats = tmp_path / "startup.prof"
    out = subprocess.run([sys.executable, "bench/startup.py", "--stats", str(stats), "--preset", "tiny", "--steps", "1",
                          "--global-batch", "2"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "import torch " in out.stdout and " main() " in out.stdout
    calls = {(k[0].rsplit("/", 1)[-1], k[2]): v[0] for k, v in pstats.Stats(str(stats)).stats.items()}
    assert calls["train.py", "train_step"] == 1
    assert calls["moe.py", "backward"] >= 2   # the MoE layers' autograd Functions, called from the backward pass


def test_data_stats_predicts_the_dry_runs_step(tmp_path, capsys):
    """bench/data_stats.py on bench/real_shaped.py's small form: fill, tower share and each layout's imbalance in
    index order and as placed, and as its predicted step the very figure `train.py --dry-run --data` prints for that
    layout (the chooser's: cost.step_seconds of cost.data_stats)."""
    import train
    data_stats, real_shaped = (_bench_module(name) for name in ("data_stats", "real_shaped"))
    path = real_shaped.write(str(tmp_path), seed=0, small=True, processes=1)
    flags = ["--preset", "tiny", "--seq-len", "256", "--pack", "--overlong", "truncate", "--global-batch", "8",
             "--data", path]
    data_stats.main(flags + ["--steps", "2", "--lanes", "2,1:1"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < res["fill"] <= 1 and 0 < res["tower_share"] < 1 and res["predicted_for"].startswith(f"--data {path}: ")
    for spec, grid in (("2", ["--lm-dp", "2"]), ("1:1", ["--vision-dp", "1", "--lm-dp", "1"])):
        got = res["layouts"][spec]
        assert got["balanced"]["vision"] <= got["today"]["vision"] and got["balanced"]["vision"] >= 1
        train.main(flags + grid + ["--dry-run", "--world-size", "2"])
        dry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert got["predicted_s"] == dry["predicted_s"] and res["predicted_for"] == dry["predicted_for"], spec


def _bench_module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
