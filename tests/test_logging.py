"""The scalar sinks (logs.py, docs/logging.md §3): TensorBoard's event files and a W&B run get the metrics file's
numbers under stable names at the right steps; a sink that cannot start (package missing, W&B not logged in) is the
same one-line error on every rank, and `error: ...` with exit status 2 from the command line."""
import collections
import glob
import importlib.machinery
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import train
from tests.spawn import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                         "MASTER_ADDR", "MASTER_PORT")}
TINY = ["--preset", "tiny", "--steps", "2", "--global-batch", "2", "--eval-every", "2"]   # MoE stats at step 1
MISSING = {"tensorboard": "--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'",
           "wandb": "--wandb needs the wandb package: pip install -e '.[wandb]'"}


class WandbStub(types.ModuleType):
    """Stands in for the wandb package (sys.modules, inherited by the forked ranks): records init / log / finish;
    with `fail`, init raises it the way wandb does without a login."""

    def __init__(self, fail=None):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)   # what find_spec reports for a loaded module
        self.calls, self.fail = [], fail

    def init(self, **kwargs):
        if self.fail:
            raise RuntimeError(self.fail)
        self.calls.append(("init", kwargs))

    def log(self, scalars, step):
        self.calls.append(("log", dict(scalars), step))

    def finish(self):
        self.calls.append(("finish",))


def expected_scalars(metrics_file):
    """{scalar name: [(step, value)]} as the sinks must get them, from the metrics file, under docs/logging.md §3's
    names."""
    out = collections.defaultdict(list)
    for r in map(json.loads, open(metrics_file)):
        if "eval_loss" in r:
            scalars = {"eval/loss": r["eval_loss"], "eval/ppl": r["eval_ppl"]}
        else:
            scalars = {"train/loss": r["loss"], "train/lr": r["lr"], "train/grad_norm": r["grad_norm"],
                       "train/skipped_steps": r["skipped"], "train/step_time_s": r["step_time_s"],
                       "train/tokens_per_s": r["tokens_per_s"], "train/tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                       "train/peak_mem_gib": max(r["peak_mem_gib_per_rank"]), "train/fill": r["fill"],
                       "train/tower_share": r["tower_share"]}
            for k in ("mfu", "lane_imbalance_vision", "lane_imbalance_lm"):              # MFU: CUDA only
                if r[k] is not None:
                    scalars[f"train/{k}"] = r[k]
            for k in ("routing_entropy_mean", "max_expert_load_frac") if "moe" in r else ():
                scalars[f"moe/{k}"] = r["moe"][k]
        for name, value in scalars.items():
            out[name].append((r["step"], value))
    return dict(out)


def _train(rank, world, argv):
    train.main(list(argv))
    return sys.modules["wandb"].calls if isinstance(sys.modules.get("wandb"), WandbStub) else None


def _exit_message(rank, world, argv):
    with pytest.raises(SystemExit) as e:
        train.main(list(argv))
    return e.value.code


def sh(*argv, env=ENV):
    return subprocess.run(list(argv), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_tensorboard_gets_the_metrics_files_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb, metrics = str(tmp_path / "tb"), str(tmp_path / "metrics.jsonl")
    run_distributed(_train, 1, TINY + ["--tensorboard", tb, "--metrics-file", metrics])
    want = expected_scalars(metrics)
    assert [s for s, _ in want["train/loss"]] == [1, 2] and [s for s, _ in want["eval/loss"]] == [2]
    assert [s for s, _ in want["moe/routing_entropy_mean"]] == [1] and "train/mfu" not in want   # CPU: no MFU
    events = EventAccumulator(tb)
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(want)
    for name, points in want.items():   # event files hold float32
        assert [(e.step, e.value) for e in events.Scalars(name)] == [(s, float(np.float32(v))) for s, v in points], name


def test_wandb_gets_the_same_scalars(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", WandbStub())
    save, metrics = str(tmp_path / "run"), str(tmp_path / "metrics.jsonl")
    calls, = run_distributed(_train, 1, TINY + ["--wandb", "proj", "--save", save, "--metrics-file", metrics])
    (init, kwargs), *logged, finish = calls
    assert init == "init" and finish == ("finish",) and {c[0] for c in logged} == {"log"}
    assert kwargs["project"] == "proj" and kwargs["dir"] == save and kwargs["config"]["wandb"] == "proj"
    got = collections.defaultdict(list)
    for _, scalars, step in logged:
        for name, value in scalars.items():
            got[name].append((step, value))
    assert dict(got) == expected_scalars(metrics)


def wandb_history(path):
    """{name: [(step, value)]} from a W&B run file: a LevelDB log (a 7-byte file header, then chunks of crc32 (4),
    length (2, little endian), type (1 = a whole record: a tiny run's file is one 32 KiB block), a protobuf Record)."""
    from wandb.proto import wandb_internal_pb2
    data, pos, out = open(path, "rb").read(), 7, collections.defaultdict(list)
    assert data[:4] == b":W&B" and len(data) < 32768
    while pos < len(data):
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        record, pos = wandb_internal_pb2.Record.FromString(data[pos + 7:pos + 7 + n]), pos + 7 + n
        assert kind == 1
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                name = item.key or "/".join(item.nested_key)
                if not name.startswith("_"):   # W&B's own _step, _runtime, _timestamp
                    out[name].append((record.history.step.num, json.loads(item.value_json)))
    return dict(out)


def test_wandb_offline_for_real(tmp_path):
    """The real package (not in the dev extra: skipped without it), offline as on a machine without a network."""
    pytest.importorskip("wandb")
    save, metrics = str(tmp_path / "run"), str(tmp_path / "metrics.jsonl")
    out = sh(sys.executable, "train.py", *TINY, "--wandb", "proj", "--save", save, "--metrics-file", metrics,
             env={**ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr
    runs = glob.glob(os.path.join(save, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, os.listdir(save)
    assert wandb_history(runs[0]) == expected_scalars(metrics)


@pytest.mark.parametrize("sink, message", [
    ("tensorboard", MISSING["tensorboard"]),
    ("wandb", MISSING["wandb"]),
    ("wandb login", "--wandb could not start (No API key configured. Use `wandb login` to log in). Log in with "
                    "`wandb login`, or set WANDB_MODE=offline to log without a network"),
], ids=["tensorboard missing", "wandb missing", "wandb not logged in"])
def test_a_sink_that_cannot_start_stops_every_rank_with_one_line(sink, message, tmp_path, monkeypatch):
    """Two ranks (colocated dp2, rank 0 logs): both exit with the message, neither waits for the other."""
    if sink == "wandb login":
        monkeypatch.setitem(sys.modules, "wandb", WandbStub(fail="No API key configured. Use `wandb login` to log in."))
    else:
        monkeypatch.setitem(sys.modules, sink, None)   # find_spec answers None, as without the package
    flag = ["--tensorboard", str(tmp_path / "tb")] if sink == "tensorboard" else ["--wandb", "proj"]
    argv = TINY + ["--colocated", "--lm-dp", "2"] + flag
    assert run_distributed(_exit_message, 2, argv, timeout=30.0) == [message, message]


@pytest.mark.slow
def test_missing_tensorboard_from_the_command_line(tmp_path):
    hide = ("import runpy, sys; sys.modules['tensorboard'] = None; sys.argv[0] = 'train.py'; "
            "runpy.run_path('train.py', run_name='__main__')")
    out = sh(sys.executable, "-c", hide, *TINY, "--tensorboard", str(tmp_path / "tb"))
    assert (out.returncode, out.stderr) == (2, f"error: {MISSING['tensorboard']}\n")


def test_a_log_that_cannot_be_written_is_a_warning_never_the_end_of_a_run(tmp_path, capfd, monkeypatch):
    """A metrics file on a full disk (/dev/full) and a W&B run that fails mid-run are dropped, each with one warning,
    and the run trains and saves every step (they had ended it with an OSError traceback, two steps unsaved)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    stub = WandbStub()
    stub.log = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("the network is gone"))
    monkeypatch.setitem(sys.modules, "wandb", stub)
    save = str(tmp_path / "run")
    run_distributed(_train, 1, TINY + ["--steps", "3", "--metrics-file", "/dev/full", "--wandb", "p", "--save", save])
    out = capfd.readouterr().out
    assert out.count("warning: --metrics-file /dev/full: cannot write ([Errno 28] No space left on device); training "
                     "goes on without it from step 1") == 1, out
    assert out.count("warning: --wandb: cannot write (the network is gone)") == 1, out
    assert "done: 3 steps" in out and sorted(os.listdir(save))[-1] == "step_00000003"


def test_the_closing_lines_say_how_to_go_on(capsys):
    """A finished run's resume line needs more --steps; an unfinished one (a signal, a failure) goes on as printed."""
    import config
    import logs
    for step, want in ((5, "resume (add --steps N to train on): python train.py --load /r"),
                       (3, "resume: python train.py --load /r")):
        log = logs.Log(config.resolve("tiny", {"steps": "5"}), True, 0)
        log.close(step, "/r")
        assert want in capsys.readouterr().out.splitlines()


def test_the_config_line_names_what_differs_from_the_preset():
    """Issue 53, friction 9: the start-up's config line was the whole config as one JSON line (about 2,500
    characters for tiny); it names the preset and what differs from it."""
    import config
    cfg = config.resolve("tiny", {"steps": 2, "lr": 1e-3})
    assert config.summary(cfg) == "preset tiny, steps 2, lr 0.001"
    assert config.summary(config.resolve("20l")) == "preset 20l"
