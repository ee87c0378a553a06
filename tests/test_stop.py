"""Every stop saves, and says so once (failsafe.py, cli.run): a signal during an evaluation saves the step before
it, SIGHUP as SIGTERM, a signal before training is one line, an interrupted --eval-only is one line, and a rank whose
peer ended with an error stays silent. With pipeline stages too: a signal mid-step or mid-evaluation, and a
non-finite gradient on one stage (every rank skips the step)."""
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

import cli
import data
import failsafe
import mock
import train
from tests.spawn import run_distributed
from tests.test_failsafe import HETERO2, TINY, warm_imports  # noqa: F401 (warm_imports: an autouse fixture)
from tests.test_train import train_with_inf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _signal_at(rank, world, argv, sig, at):
    """train.main, the last rank sending itself `sig` at its collate_text call number `at` -> (history, weights,
    the exit status the process would have)."""
    collate, calls = data.collate_text, []

    def collate_then_signal(samples):
        calls.append(1)
        if rank == world - 1 and len(calls) == at:
            os.kill(os.getpid(), sig)
        return collate(samples)
    data.collate_text = collate_then_signal
    try:
        history, modules = train.main(list(argv))
    finally:
        data.collate_text = collate
    state = {f"{k}.{n}": t.detach().clone() for k, m in modules.items() for n, t in m.state_dict().items()}
    return history, state, failsafe.exit_status()


def _latest(save):
    return open(os.path.join(save, "latest")).read().strip()


@pytest.mark.slow
def test_sighup_mid_evaluation_saves_the_step_and_resumes_exactly(tmp_path, capfd):
    """The language rank's 5th micro-batch is the evaluation's first after step 1: both ranks stop before the
    evaluation's second, the step before it is saved, nothing is logged as its result."""
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "metrics.jsonl")
    argv = HETERO2 + ["--steps", "3", "--save", save, "--eval-every", "1", "--eval-samples", "4"]
    first = run_distributed(_signal_at, 2, argv + ["--metrics-file", metrics], signal.SIGHUP, 5)
    assert [(len(h), status) for h, _, status in first] == [(1, 128 + signal.SIGHUP)] * 2
    out = capfd.readouterr().out
    assert out.count(f"interrupted by SIGHUP during the evaluation after step 1 (not scored): saved step 1 to "
                     f"{save}\n") == 1, out
    assert "eval step" not in out and all("eval_loss" not in line for line in open(metrics))
    assert _latest(save) == "step_00000001"
    resumed = run_distributed(_signal_at, 2, argv + ["--load", save], signal.SIGHUP, 0)   # (no signal)
    straight = run_distributed(_signal_at, 2, HETERO2 + ["--steps", "3"], signal.SIGHUP, 0)
    assert "the learning rate at step" not in capfd.readouterr().out   # the schedule did not change
    for (h, state, status), (h_ref, ref, _) in zip(resumed, straight):
        assert status == 0 and [x["loss"] for x in h] == [x["loss"] for x in h_ref[1:]]
        assert sorted(state) == sorted(ref) and all(torch.equal(state[k], ref[k]) for k in ref)


# 3 ranks: vision on 0, the language model's stages on 1 and 2; 4 micro-batches a step
PP2_HETERO = TINY + ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"]
# 2 shared ranks: the tower dp2 beside language stages 0 (rank 0) and 1 (rank 1); 2 micro-batches of 2 a step
PP2_SHARED = TINY + ["--colocated", "--vision-tp", "1", "--lm-pp", "2", "--micro-batch", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("world, argv, at", [(3, PP2_HETERO, 6), (2, PP2_SHARED, 3)], ids=["hetero", "shared"])
def test_sigterm_mid_step_in_a_pipeline_resumes_exactly(tmp_path, world, argv, at):
    """SIGTERM on the last stage at step 2's micro-batch `at` (its 2nd hetero, 1st shared), with micro-batches in
    flight between the stages and over the bridge: every rank stops at the next boundary, step 1 is saved, and the
    resumed run equals the straight one."""
    save, argv = str(tmp_path / "ckpt"), argv + ["--steps", "3"]
    first = run_distributed(_signal_at, world, argv + ["--save", save], signal.SIGTERM, at)
    assert [(len(h), status) for h, _, status in first] == [(1, 128 + signal.SIGTERM)] * world
    assert _latest(save) == "step_00000001"
    resumed = run_distributed(_signal_at, world, argv + ["--load", save], signal.SIGTERM, 0)
    straight = run_distributed(_signal_at, world, argv, signal.SIGTERM, 0)
    for (h, state, status), (h_ref, ref, _) in zip(resumed, straight):
        assert status == 0 and [x["loss"] for x in h] == [x["loss"] for x in h_ref[1:]]
        assert sorted(state) == sorted(ref) and all(torch.equal(state[k], ref[k]) for k in ref)
    assert all(x["loss"] is not None for x in straight[-1][0])   # the last stage knows the loss


@pytest.mark.slow
def test_sigterm_mid_evaluation_in_a_pipeline_saves_the_step(tmp_path, capfd):
    """The last stage's 5th micro-batch is the evaluation's first after step 1: every rank stops before its
    second, step 1 is saved (said once), nothing is scored, and the run resumes from it exactly."""
    save = str(tmp_path / "ckpt")
    argv = PP2_HETERO + ["--steps", "2", "--save", save, "--eval-every", "1", "--eval-samples", "4"]
    first = run_distributed(_signal_at, 3, argv, signal.SIGTERM, 5)
    assert [(len(h), status) for h, _, status in first] == [(1, 128 + signal.SIGTERM)] * 3
    out = capfd.readouterr().out
    assert out.count(f"interrupted by SIGTERM during the evaluation after step 1 (not scored): saved step 1 to "
                     f"{save}\n") == 1, out
    assert "eval step" not in out and _latest(save) == "step_00000001"
    resumed = run_distributed(_signal_at, 3, argv + ["--load", save], signal.SIGTERM, 0)
    straight = run_distributed(_signal_at, 3, PP2_HETERO + ["--steps", "2"], signal.SIGTERM, 0)
    for (h, state, status), (h_ref, ref, _) in zip(resumed, straight):
        assert status == 0 and [x["loss"] for x in h] == [x["loss"] for x in h_ref[1:]]
        assert sorted(state) == sorted(ref) and all(torch.equal(state[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_inf_on_one_stage_skips_the_step_everywhere():
    """A non-finite gradient on the first stage only: the vision rank and both stages skip that step alike, the
    others step (the grad norm's all-reduce spans every rank)."""
    # the first stage (rank 1) turns its embedding's gradient into inf at its 6th backward (step 2's 2nd micro-batch)
    results = run_distributed(train_with_inf, 3, PP2_HETERO + ["--steps", "3", "--lr-schedule", "constant"], 1,
                              lambda vision, lm: lm.backbone.embeddings.weight, (6,))
    assert [n for _, n in results] == [0, 12, 0]   # the hook ran on the first stage only, 4 backwards a step
    for rank, (history, _) in enumerate(results):
        assert [h["ok"] for h in history] == [True, False, True], rank
        assert math.isnan(history[1]["grad_norm"]) and math.isfinite(history[2]["grad_norm"]), rank
        assert history[2]["grad_norm"] == results[0][0][2]["grad_norm"]
    assert all(math.isfinite(h["loss"]) for h in results[2][0])   # the forward was fine: only the update skipped


@pytest.mark.slow
def test_sigterm_mid_step_on_shared_ranks_resumes_exactly(tmp_path):
    """Both modules on 2 ranks, each its own lanes (vision tp2 | language dp2; rank 1 leads the vision lane and
    language lane 1): SIGTERM at step 2's first micro-batch stops both ranks before its second, the rows and
    gradient in flight are matched (schedule.py), step 1 is saved, and the resumed run equals the straight one."""
    save = str(tmp_path / "ckpt")
    shared = TINY + ["--colocated", "--vision-tp", "2", "--vision-dp", "1", "--lm-dp", "2", "--steps", "3"]
    first = run_distributed(_signal_at, 2, shared + ["--save", save], signal.SIGTERM, 3)
    assert [(len(h), status) for h, _, status in first] == [(1, 128 + signal.SIGTERM)] * 2
    assert _latest(save) == "step_00000001"
    resumed = run_distributed(_signal_at, 2, shared + ["--load", save], signal.SIGTERM, 0)
    straight = run_distributed(_signal_at, 2, shared, signal.SIGTERM, 0)
    for (h, state, status), (h_ref, ref, _) in zip(resumed, straight):
        assert status == 0 and [x["loss"] for x in h] == [x["loss"] for x in h_ref[1:]]
        assert sorted(state) == sorted(ref) and all(torch.equal(state[k], ref[k]) for k in ref)


def test_interrupted_eval_only_is_one_line_and_names_its_data(tmp_path, capfd):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(4)))
    argv = ["--preset", "tiny", "--eval-only", "--data", str(docs)]
    ((history, _, status),) = run_distributed(_signal_at, 1, argv, signal.SIGTERM, 1)
    assert history == [] and status == 128 + signal.SIGTERM
    out, err = capfd.readouterr()
    assert f"--eval-only: scoring 4 samples of --data {docs} (no --eval-data given)\n" in out
    assert "eval_loss" not in out
    assert err == "interrupted by SIGTERM during the evaluation: nothing scored, nothing saved\n", err


def _cli_signalled_in_set_up(rank, world, argv, sig):
    """cli.run with `sig` arriving while the mock data is set up -> its exit status."""
    real = mock.MockData.__init__

    def interrupt(self, *a, **k):
        os.kill(os.getpid(), sig)
        real(self, *a, **k)
    mock.MockData.__init__ = interrupt
    try:
        cli.run(train.main, list(argv))
    except SystemExit as e:
        return e.code
    finally:
        mock.MockData.__init__ = real


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_before_training_is_one_line(sig, capfd):
    (status,) = run_distributed(_cli_signalled_in_set_up, 1, TINY + ["--steps", "2"], sig)
    assert status == 128 + sig
    assert capfd.readouterr().err == f"interrupted by {sig.name} before training started: nothing to save\n"


@pytest.mark.slow
def test_a_rank_whose_peer_ended_with_an_error_stays_silent(tmp_path):
    """Rank 0 (vision) cannot load its images at step 1 while rank 1 (language) waits for their rows over gloo:
    rank 0's line is the only one, rank 1 (its connection closed) ends quietly within torchrun's shutdown."""
    script = tmp_path / "bad_image.py"
    script.write_text(f"""import os, runpy, sys
sys.path.insert(0, {ROOT!r})
import data
def damaged(*a, **k):
    raise data.BadSample("imgs.jsonl:2: undecodable image b.jpg: Truncated File Read")
if os.environ["RANK"] == "0":
    data.collate_images = damaged
sys.argv = ["train.py"] + {HETERO2 + ["--steps", "2"]!r}
runpy.run_path(os.path.join({ROOT!r}, "train.py"), run_name="__main__")
""")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=180)
    both = out.stdout + out.stderr
    errors = [line for line in both.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and errors == ["error: imgs.jsonl:2: undecodable image b.jpg: Truncated File Read. "
                                              "Fix the line or pass --skip-bad-samples (a training step's; an evaluation's "
                                              "samples must load)"], both
    assert "Connection closed" not in both and f'File "{ROOT}' not in both, both   # torchrun's own report only
