"""bench.py on the CPU: its parts run on train.py's code paths and report figures that add up."""
import json
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
