"""bench.py on the CPU: its parts run on train.py's code paths and report figures that add up."""
import json
import subprocess
import sys

import pytest

from tests.test_run import ENV, ROOT


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
