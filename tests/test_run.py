"""A user's first hour (issue 17): evaluations that report the same numbers in every layout, the mock task that
learns through the image, nothing compiled at import, one-line errors, the log lines, a two-node launch."""
import dataclasses
import json
import math
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

import config
import logs
import mock
import model
import radio
import train
import vlm
from tests.spawn import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                         "MASTER_ADDR", "MASTER_PORT")}


def text_docs(path, lengths):
    """A JSONL file of {"text"} documents of the given byte lengths: each scores len + 1 tokens (bytes + EOS)."""
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"text": "".join(chr(97 + (i + j) % 26) for j in range(n))}) + "\n")
    return str(path)


def sh(*argv, env=ENV, timeout=120):
    return subprocess.run(list(argv), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- 1. eval: the same numbers in every layout

EVAL_LAYOUTS = {  # name: (world, flags)
    "one process": (1, []),
    "one process, micro-batch 2": (1, ["--micro-batch", "2"]),
    "hetero v-dp2 + lm-dp2": (4, ["--vision-dp", "2", "--lm-dp", "2"]),
    "hetero v-dp1 + lm-tp2": (3, ["--vision-dp", "1", "--lm-tp", "2", "--lm-dp", "1"]),
    "colocated dp2, micro-batch 2": (2, ["--colocated", "--micro-batch", "2"]),
    "colocated dp2 ep2": (2, ["--colocated", "--lm-ep", "2"]),
}


def _eval(rank, world, argv):
    (result,), _ = train.main(list(argv))
    return result


@pytest.mark.parametrize("eval_data", ["mock", "jsonl"])
@pytest.mark.slow
def test_eval_is_the_same_in_every_layout(eval_data, tmp_path):
    """5 samples: a partial last micro-batch in every layout but one process at micro-batch 1. The model is the
    layout-independent init (seed 3), the data the mock task's held-out set or a JSONL file beside mock --data."""
    argv = ["--preset", "tiny", "--eval-only", "--seed", "3", "--global-batch", "4", "--stage", "3"]
    if eval_data == "mock":
        argv += ["--eval-samples", "5"]
    else:  # the whole file: 5 documents of 10..50 bytes
        argv += ["--eval-data", text_docs(tmp_path / "eval.jsonl", [10, 20, 30, 40, 50])]
    results = {name: run_distributed(_eval, world, argv + flags, timeout=90.0)
               for name, (world, flags) in EVAL_LAYOUTS.items()}
    ref = results["one process"][0]
    assert ref["eval_samples"] == 5
    if eval_data == "jsonl":
        assert ref["eval_tokens"] == 150 + 5                                # every byte and each EOS
    else:
        cfg = config.resolve("tiny")
        ds = mock.MockData(cfg, 3 + 1)                                       # the held-out seed
        assert ref["eval_tokens"] == sum(int((ds[i].labels != -100).sum()) for i in range(5))
    assert 5.0 < ref["eval_loss"] < 7.0 and ref["eval_ppl"] == pytest.approx(math.exp(ref["eval_loss"]), rel=1e-12)
    for name, per_rank in results.items():
        assert any(r["eval_loss"] for r in per_rank), name
        for r in per_rank:
            if r["eval_loss"]:                                               # language ranks know it
                assert r["eval_tokens"] == ref["eval_tokens"], (name, r, ref)
                assert abs(r["eval_loss"] - ref["eval_loss"]) <= 1e-5, (name, r, ref)


def test_eval_every_with_mock_data_scores_the_eval_file(tmp_path, capfd):
    argv = ["--preset", "tiny", "--steps", "2", "--global-batch", "4", "--eval-every", "1",
            "--eval-data", text_docs(tmp_path / "eval.jsonl", [7, 9, 11])]
    run_distributed(lambda rank, world: train.main(argv)[0], 1, timeout=60.0)
    out = capfd.readouterr().out
    evals = re.findall(r"eval step (\d): loss [0-9.]+ \| ppl [0-9.]+ \| (\d+) tokens of (\d) samples", out)
    assert evals == [("1", "30", "3"), ("2", "30", "3")]                                  # 7+9+11 bytes + 3 EOS


# ---------------------------------------------------------------- 2. the mock task learns, through the image

def answer_loss(modules, cfg, seed=99, n=32):
    """Mean loss of the label only the image predicts (the first count after the image), over the samples of
    n mock indices that have an image: training's loss (vlm.loss) of each with that label alone, its others -100;
    computed by one process holding both modules."""
    ds, losses = mock.MockData(cfg, seed), []
    at = ds.answer_position
    with torch.no_grad():
        for s in (ds[i] for i in range(n)):
            if s.images:
                labels = torch.full_like(s.labels, -100)
                labels[at] = s.labels[at]
                assert labels[at] >= 0
                losses.append(vlm.loss(modules["vision"], modules["language"],
                                       [dataclasses.replace(s, labels=labels)], cfg).item())
    return sum(losses) / len(losses)


def _learn(rank, world, argv, image_noise):
    if image_noise:   # the same task, the image replaced by noise: nothing in it tells the answer
        real = mock.MockData.image
        mock.MockData.image = lambda self, start, g: real(self, None, g)
    history, modules = train.main(list(argv))
    return [h["loss"] for h in history], answer_loss(modules, config.resolve("tiny"))


@pytest.mark.slow
def test_mock_task_learns_through_the_image():
    argv = ["--preset", "tiny", "--steps", "60", "--lr", "3e-3", "--lr-schedule", "constant"]
    chance = math.log(mock.COUNT // mock.STRIDE)                                # ln 8: the image's 8 colours
    (losses, answer), = run_distributed(_learn, 1, argv, False, timeout=180.0)
    assert losses[0] > 6.0 and losses[-1] < 0.8 * losses[0] and losses[-1] < 0.5, losses
    assert answer < 0.2 * chance, answer
    (losses, answer), = run_distributed(_learn, 1, argv, True, timeout=180.0)
    assert losses[-1] < 0.5, losses                                             # the text still learns
    assert answer > 0.8 * chance, answer                                        # the answer does not


def test_mock_text_random_is_unlearnable_noise():
    cfg = config.resolve("tiny", {"mock_text": "random"})
    s = mock.MockData(cfg, 0)[0]
    assert s.images[0].shape == (3, 64, 64) and abs(s.images[0].mean()) < 0.1 and s.images[0].std() > 0.9
    assert (s.labels[:4] == -100).all() and len(set(s.input_ids[4:].tolist())) > 50          # random ids


# ---------------------------------------------------------------- 3. nothing compiles at import

@pytest.mark.slow
def test_import_compiles_nothing():
    out = sh(sys.executable, "-c", "import sys, train; print(sorted(m for m in sys.modules if m.startswith("
             "('torch._dynamo', 'torch._inductor', 'triton'))))")
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


# ---------------------------------------------------------------- 4. one-line errors

@pytest.mark.parametrize("argv,message", [
    (["--stpes", "5"], "error: unknown flag --stpes. Did you mean --steps?"),
    (["--hiden-size", "64"], "error: unknown flag --hiden-size. Did you mean --hidden-size?"),
    (["--data", "nowhere.jsonl"], "error: data file nowhere.jsonl does not exist. Check the path"),
    (["--seq-len", "4"], "error: a mock image of 4 tokens leaves no room for text in seq_len 4. Raise --seq-len"),
    (["--eval-only", "--load", "no_such_dir"], "error: no_such_dir/meta.json: missing"),
    (["--lr", "fast"], "error: argument --lr: invalid float value: 'fast'. See --help"),
])
@pytest.mark.slow
def test_user_errors_are_one_line(argv, message):
    out = sh(sys.executable, "train.py", "--preset", "tiny", *argv)
    assert out.returncode == 2 and out.stderr.startswith(message) and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.parametrize("argv,message", [   # validated where parsed (config.check), before anything is built
    (["--min-lr=-3e-3"], "--min-lr -0.003: must be a finite number >= 0"),
    (["--lr-warmup-iters=-5"], "--lr-warmup-iters -5: must be a finite number >= 0"),
    (["--steps", "-3"], "--steps -3: must be a finite number >= 0"),
    (["--lr=-1e-3"], "--lr -0.001: must be a finite number >= 0"),
    (["--lr", "nan"], "--lr nan: must be a finite number >= 0"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr 0.001: must not exceed --lr 0.0001 (the schedule decays from --lr "
                                           "to it)"),
    (["--log-every", "0"], "--log-every 0: must be a finite number >= 1"),
    (["--eval-frac", "1.5", "--clip-grad", "-1"], "--clip-grad -1.0: must be >= 0 (0 turns clipping off); --eval-frac "
                                                  "1.5: must be below 1 (a fraction)"),
    (["--learning-rate", "1e-3"], "unknown flag --learning-rate. Use --lr"),
    (["--save_dir", "x"], "unknown flag --save-dir. Use --save"),
    (["--max-steps", "9"], "unknown flag --max-steps. Use --steps"),
    (["--per-device-train-batch-size", "2"], "unknown flag --per-device-train-batch-size. Use --micro-batch"),
    (["--gradient-accumulation-steps", "4"], "unknown flag --gradient-accumulation-steps. Use --global-batch (samples "
                                             "a step = micro-batch x data parallel x accumulation)"),
    (["--warmup-steps", "10"], "unknown flag --warmup-steps. Use --lr-warmup-iters"),
    (["--vision-dp", "2", "--lm-dp", "1", "--world-size", "3", "--dry-run"], "bad parallel layout: micro_batch 1 x "
     "language dp 1 = 1 samples per microbatch do not split evenly over vision dp 2 (--micro-batch 2 would)"),
    (["--colocated", "--lm-dp", "3", "--world-size", "3", "--dry-run"], "bad parallel layout: global_batch 8 is not "
     "divisible by micro_batch 1 x language dp 3 = 3 (--global-batch 6 or 9 would be)"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message):
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", *argv])
    assert str(e.value) == message


@pytest.mark.slow
def test_ctrl_c_before_training_is_one_line(tmp_path):
    """SIGINT during set-up, before failsafe.Stop takes signals: one line, exit 130, no traceback from any rank."""
    script = tmp_path / "interrupted.py"
    script.write_text(f"""import os, runpy, signal, sys
sys.path.insert(0, {ROOT!r})
import mock
real = mock.MockData.__init__
def interrupt(self, *a, **k):   # Ctrl-C while the data is set up
    os.kill(os.getpid(), signal.SIGINT)
    real(self, *a, **k)
mock.MockData.__init__ = interrupt
sys.argv = ["train.py", "--preset", "tiny", "--steps", "2"]
runpy.run_path(os.path.join({ROOT!r}, "train.py"), run_name="__main__")
""")
    out = sh(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script))
    assert out.returncode != 0 and 'train.py", line' not in out.stderr, out.stderr   # torchrun's own report only
    assert out.stderr.count("interrupted by SIGINT before training started: nothing to save") == 1, out.stderr
    single = sh(sys.executable, str(script))
    assert single.returncode == 130 and single.stderr == "interrupted by SIGINT before training started: nothing " \
        "to save\n", single.stderr


@pytest.mark.slow
def test_an_error_once_training_runs_is_printed_once(tmp_path):
    """A failed save after step 1 (every rank fails alike, failsafe.Stop holds SIGTERM by then): rank 0's line only,
    the other rank ended by torchrun during its grace."""
    script = tmp_path / "full_disk.py"
    script.write_text(f"""import os, runpy, sys
sys.path.insert(0, {ROOT!r})
import checkpoint
real = checkpoint.write_atomic
def full(path, obj):
    if "step_00000002" in path:
        raise OSError(28, "No space left on device", path)
    return real(path, obj)
checkpoint.write_atomic = full
sys.argv = ["train.py", "--preset", "tiny", "--steps", "3", "--global-batch", "2", "--save-every", "1",
            "--save", {str(tmp_path / "ckpt")!r}]
runpy.run_path(os.path.join({ROOT!r}, "train.py"), run_name="__main__")
""")
    out = sh(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script))
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and len(lines) == 1 and "step_00000002 FAILED" in lines[0], out.stderr
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "run_config.json", "step_00000001"]   # nothing left


@pytest.mark.slow
def test_one_line_error_from_two_ranks_printed_once():
    out = sh(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "train.py", "--preset", "tiny",
             "--global-batch", "3", "--colocated", "--lm-dp", "2")
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and 'train.py", line' not in out.stderr, out.stderr    # torchrun's own report only
    assert len(lines) == 1 and lines[0].startswith("error: bad parallel layout") and "global_batch 3" in lines[0], lines
    debug = sh(sys.executable, "train.py", "--preset", "tiny", "--seq-len", "4", "--debug")
    assert "Traceback (most recent call last)" in debug.stderr and "leaves no room" in debug.stderr


# ---------------------------------------------------------------- 5. what the log says

@pytest.mark.slow
def test_log_lines(tmp_path):
    """JSONL documents of 30 bytes (32 tokens with BOS / EOS, 64 of padding): tok/s counts the 32."""
    docs = text_docs(tmp_path / "docs.jsonl", [30] * 8)
    save, metrics = str(tmp_path / "run"), str(tmp_path / "metrics.jsonl")
    argv = ["--preset", "tiny", "--steps", "3", "--global-batch", "2", "--data", docs, "--eval-frac", "0.25",
            "--eval-every", "2", "--save", save, "--metrics-file", metrics]
    out = sh(sys.executable, "train.py", *argv)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("config: preset ") and line.endswith(f"(all of it: {save}/run_config.json)")
               for line in lines), lines
    saved = open(os.path.join(save, "run_config.json")).read()
    assert saved.startswith('{\n  "preset": "tiny"') and json.loads(saved)["seq_len"] == 96
    assert f"train data: {docs} (100%): 6 documents, 192 tokens" in lines                  # 6 x 32
    assert f"eval data: {docs} (100%): 2 documents, 64 tokens (scores 2 samples)" in lines
    counts = logs.param_counts(config.resolve("tiny"))                                         # stage 2
    assert "parameters (trainable / frozen): " + ", ".join(f"{k} {t:,} / {f:,}" for k, (t, f) in counts.items()) in lines
    steps = [line for line in lines if line.startswith("step ")]
    work = r"tok/s/GPU \d+ \| MFU N/A \| fill 33% \| tower 0% \| lanes 1.00/1.00"   # one lane, in place
    pattern = (r"step (\d)/3 \| loss [0-9.]+ \| lr [0-9.e+-]+ \| grad norm [0-9.]+ \| skipped 0 \| " + work +
               r" \| peak mem [0-9.]+ GiB \| \d+ ms \| elapsed \d:\d\d:\d\d \| ETA \d:\d\d:\d\d")
    assert [re.fullmatch(pattern, line).group(1) for line in steps] == ["1", "2", "3"], steps
    assert any(re.fullmatch(r"eval step 2: loss [0-9.]+ \| ppl [0-9.]+ \| 62 tokens of 2 samples", x) for x in lines)
    assert re.fullmatch("mean of 2 logged steps after the first: " + work, lines[-5]), lines[-5]
    assert lines[-4].startswith("done: 3 steps (to step 3) in 0:00:") and "last eval loss" in lines[-4]
    assert lines[-3:] == [f"checkpoint: {save}", f"resume (add --steps N to train on): python train.py --load {save}",
                          f"export: python hf_interop.py export-hf --load {save} --out HF_DIR"]
    recs = [json.loads(x) for x in open(metrics)]
    step_recs = [r for r in recs if "tokens" in r]
    assert [r["tokens"] for r in step_recs] == [64, 64, 64]                                 # not 2 x 96
    assert all(r["tokens_per_s"] == pytest.approx(64 / r["step_time_s"]) and r["steps"] == 3 for r in step_recs)
    assert {"elapsed_s", "eta_s", "peak_mem_gib_per_rank", "mfu", "lr", "grad_norm"} <= set(step_recs[0])
    assert all(r["fill"] == 64 / 192 and r["tower_share"] == 0 and r["lane_imbalance_vision"] == 1.0 and
               r["lane_imbalance_lm"] == 1.0 for r in step_recs)
    assert [r["eval_tokens"] for r in recs if "eval_loss" in r] == [62]                     # 2 x 31 targets


def test_param_counts_by_part_and_stage():
    cfg = config.resolve("tiny")
    total_lm, _ = model.count_language_params(cfg)
    with torch.device("meta"):
        projector = sum(p.numel() for p in radio.VisionModel(cfg).mlp1.parameters())
        tower = sum(p.numel() for p in radio.VisionModel(cfg).parameters()) - projector
    assert logs.param_counts(dataclasses.replace(cfg, stage=1)) == {"vision tower": [0, tower], "projector": [projector, 0],
                                               "language": [0, total_lm]}
    assert logs.param_counts(cfg) == {"vision tower": [0, tower], "projector": [projector, 0],
                                               "language": [total_lm, 0]}
    assert logs.param_counts(dataclasses.replace(cfg, stage=3))["vision tower"] == [tower, 0]
    # LoRA rank 4: every base weight frozen, the adapters train: r x (in + out) per targeted Linear, two pairs per
    # routed expert
    with torch.device("meta"):
        lm = model.LanguageModel(cfg)
    adapters = sum(4 * (m.in_features + m.out_features) for n, m in lm.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in
                   ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "up_proj", "down_proj"))
    adapters += sum(2 * 4 * m.up_proj.shape[0] * (m.up_proj.shape[1] + m.up_proj.shape[2])
                    for m in lm.modules() if type(m).__name__ == "Experts")
    assert logs.param_counts(dataclasses.replace(cfg, lora_rank=4, lora_alpha=8.0)) == {"vision tower": [0, tower], "projector": [0, projector],
                                                          "language": [adapters, total_lm]}


# ---------------------------------------------------------------- 6. two nodes

@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes_match_one_process(tmp_path):
    """Two torchrun agents on localhost, 2 ranks each, c10d rendezvous: the tiny reference layout (vision dp2 on
    node 0, language dp2 on node 1) trains the losses of one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--preset", "tiny", "--steps", "3", "--global-batch", "4", "--lr", "1e-3"]
    metrics = str(tmp_path / "metrics.jsonl")
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=t17",
                                "train.py", *argv, "--vision-dp", "2", "--lm-dp", "2", "--metrics-file", metrics],
                               cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    two_nodes = [json.loads(x)["loss"] for x in open(metrics)]
    ref = run_distributed(lambda rank, world: [h["loss"] for h in train.main(argv)[0]], 1, timeout=60.0)[0]
    assert len(two_nodes) == 3 and all(abs(a - b) <= 1e-5 for a, b in zip(two_nodes, ref)), (two_nodes, ref)


@pytest.mark.slow
@pytest.mark.parametrize("world, flags", [(3, ["--vision-dp", "1", "--lm-pp", "2"]), (2, ["--colocated", "--lm-cp", "2"])],
                         ids=["pipeline", "cp"])
def test_every_run_ends_with_status_0_after_done(world, flags):
    """The README's pipeline and cp commands, again and again beside a process that keeps a core busy: each ends 0
    after `done`, no rank aborted. The interpreter's exit aborted a stage in 1 of 9 pipeline runs (std::terminate in
    a destructor); train.py now ends its process itself once its files are closed (cli.end)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(4):
            out = sh("torchrun", "--standalone", f"--nproc_per_node={world}", "train.py", "--preset", "tiny", "--steps",
                     "3", *flags)
            assert out.returncode == 0 and "done: 3 steps" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
            assert "terminate called" not in out.stderr and "SIGABRT" not in out.stderr, out.stderr[-3000:]
    finally:
        hog.kill()
        hog.wait()


# ---------------------------------------------------------------- 7. launch.py: the run's own last word last

AT_STEP_3 = """import os, runpy, signal, sys
sys.path.insert(0, {root!r})
import watchdog
real = watchdog.mark
def mark(where, first=False):   # rank {rank} sends {sig} to {whom} as it starts step 3
    if os.environ["RANK"] == "{rank}" and where == "step 3":
        os.kill({whom}(), signal.{sig})
    real(where, first)
watchdog.mark = mark
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path(os.path.join({root!r}, "train.py"), run_name="__main__")
"""


def _launch(tmp_path, *argv, env=None):
    return sh(sys.executable, "launch.py", "--standalone", "--nproc_per_node=2", "--log-dir", str(tmp_path / "logs"),
              "--shutdown-timeout", "2", *argv, env=env or {**ENV, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_launch_ends_with_the_ranks_line_and_status(tmp_path):
    """A user error: the rank's line is the last on stderr and its status (2) the launcher's, where torchrun's
    ChildFailedError traceback and failure table follow it and torchrun exits 1; they are in --log-dir's
    torchrun.log, with torchrun's warning of a missing OMP_NUM_THREADS (logged before torchrun makes the directory)."""
    out = _launch(tmp_path, "train.py", "--preset", "tiny", "--steps", "3", "--lr", "-1",
                  env={k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"})
    assert out.returncode == 2 and out.stderr.splitlines() == ["error: --lr -1.0: must be a finite number >= 0"], \
        out.stderr
    report = (tmp_path / "logs" / "torchrun.log").read_text()
    assert "train.py FAILED" in report and "exitcode  : 2" in report and "OMP_NUM_THREADS" in report


@pytest.mark.slow
@pytest.mark.parametrize("rank, sig, whom, status", [("0", "SIGTERM", "os.getppid", 143),
                                                     ("1", "SIGSTOP", "os.getpid", 3),
                                                     ("1", "SIGKILL", "os.getpid", 137)],
                         ids=["launcher-sigterm", "rank-stopped", "rank-killed"])
def test_launch_signals(tmp_path, rank, sig, whom, status):
    """SIGTERM to the launcher: forwarded, the step saved, 128 + 15 (torchrun: its SignalException and 1). A
    stopped rank: the watchdog's line and 3, although torchrun SIGKILLs that rank --shutdown-timeout after its
    SIGTERM. A rank killed from outside (the out-of-memory killer) says nothing: the launcher names it, 128 + 9."""
    script = tmp_path / "at_step_3.py"
    script.write_text(AT_STEP_3.format(root=ROOT, rank=rank, sig=sig, whom=whom))
    save = str(tmp_path / "run")
    out = _launch(tmp_path, str(script), "--preset", "tiny", "--steps", "20", "--save", save,
                  "--collective-timeout", "2")
    lines = out.stderr.splitlines()
    assert out.returncode == status and "Traceback" not in out.stderr, out.stderr
    report = (tmp_path / "logs" / "torchrun.log").read_text()
    if sig == "SIGTERM":
        assert re.search(rf"interrupted by SIGTERM: saved step [23] to {re.escape(save)}\n", out.stdout), out.stdout
        assert lines == [] and "Received 15 death signal" in report
    elif sig == "SIGSTOP":
        assert lines[-1].startswith("error: ") and "(rank 1 is not answering?)" in lines[-1], lines
        assert "forcefully exiting via 9" in report
    else:
        assert re.fullmatch(r"error: rank 1 \(pid \d+\) was ended by SIGKILL without a word\. See the kernel's log "
                            r"\(dmesg: an out-of-memory kill, a segfault\) and torchrun's report, "
                            + re.escape(str(tmp_path / "logs" / "torchrun.log")), lines[-1]), lines
