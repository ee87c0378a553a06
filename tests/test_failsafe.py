"""failsafe.py and the failure paths of train.py / checkpoint.py / data.py / radio.py on CPU gloo: a real SIGTERM to
torchrun and Ctrl-C with a closed pipe stop at a micro-batch boundary, save the last completed step and resume
bit-exactly; failed saves end the run with `latest` intact; the requeue line; stage 1 with text-only micro-batches
(hetero and colocated); thin and truncated images; the non-finite abort; --clip-grad 0; one-line bad-input errors."""
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image

import checkpoint
import config
import data
import failsafe
import formats
import logs
import optim
import radio
import train
from tests.spawn import run_distributed, slow_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--preset", "tiny", "--global-batch", "4", "--lr-decay-iters", "6"]
HETERO2 = TINY + ["--vision-dp", "1", "--lm-dp", "1"]   # 2 ranks: vision on 0, language on 1; 4 micro-batches a step
HETERO4 = ["--vision-dp", "2", "--lm-dp", "2"]   # 4 ranks: vision on 0-1, language on 2-3 (tiny's reference)


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    torch.nn.utils.skip_init(torch.nn.Linear, 1, 1)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def _train(rank, world, argv):
    """train.main in a gloo child -> (history, {full name: tensor}), or the message of a SystemExit."""
    try:
        history, modules = train.main(list(argv))
    except SystemExit as e:
        return str(e)
    return history, {f"{k}.{n}": t.detach().clone() for k, m in modules.items() for n, t in m.state_dict().items()}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def latest(save):
    return open(os.path.join(save, "latest")).read().strip()


def _launch(tmp_path, argv, torchrun, **popen):
    marker = str(tmp_path / "midstep")
    script = slow_train(str(tmp_path / "slow_train.py"), marker, argv, at=7)   # 4 micro-batches a step: step 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script)] if torchrun else [sys.executable, str(script)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, **popen)
    deadline = time.monotonic() + 120
    wait_for = marker + ("1" if torchrun else "0")   # the language rank
    while not os.path.exists(wait_for) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(wait_for), "the run never reached step 2"
    return proc


@pytest.mark.slow
def test_sigterm_to_torchrun_mid_step_saves_the_last_step_and_resumes_exactly(tmp_path):
    """torchrun signals the whole process group of a rank: its DataLoader workers get the SIGTERM too."""
    save = str(tmp_path / "ckpt")
    argv = HETERO2 + ["--steps", "3", "--save", save, "--num-workers", "1"]
    proc = _launch(tmp_path, argv, torchrun=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    assert f"interrupted by SIGTERM: saved step 1 to {save}" in out, out
    assert latest(save) == "step_00000001" and sorted(os.listdir(save)) == ["latest", "run_config.json", "step_00000001"]
    meta = json.load(open(os.path.join(save, "step_00000001", "meta.json")))
    assert meta["counters"] == {"step": 1, "good_steps": 1, "consumed_samples": 4, "skipped": 0}
    straight = run_distributed(_train, 2, HETERO2 + ["--steps", "3"])
    resumed = run_distributed(_train, 2, argv + ["--load", save, "--num-workers", "0"])   # (forked children)
    for rank in range(2):
        assert len(resumed[rank][0]) == 2
        assert [h["loss"] for h in resumed[rank][0]] == [h["loss"] for h in straight[rank][0][1:]]
        assert_same(resumed[rank][1], straight[rank][1])


@pytest.mark.slow
def test_ctrl_c_with_a_closed_pipe_still_saves(tmp_path):
    """`python train.py | tee log` and Ctrl-C: tee is gone before the run's next print."""
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "metrics.jsonl")
    argv = TINY + ["--steps", "3", "--save", save, "--metrics-file", metrics]   # one process
    proc = _launch(tmp_path, argv, torchrun=False, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    proc.stderr.close()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 128 + signal.SIGINT
    assert latest(save) == "step_00000001"
    assert [json.loads(line)["step"] for line in open(metrics)] == [1]
    (straight,) = run_distributed(_train, 1, TINY + ["--steps", "3"])
    (resumed,) = run_distributed(_train, 1, TINY + ["--steps", "3", "--load", save])
    assert [h["loss"] for h in resumed[0]] == [h["loss"] for h in straight[0][1:]]
    assert_same(resumed[1], straight[1])


def _signal_mid_step(rank, world, argv):
    """Rank 2 (language, hetero on 4 ranks) sends itself SIGTERM during step 2's first of 2 micro-batches."""
    collate, calls = data.collate_text, []

    def collate_then_signal(samples):
        calls.append(1)
        if rank == 2 and len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return collate(samples)
    data.collate_text = collate_then_signal
    try:
        return _train(rank, world, argv)
    finally:
        data.collate_text = collate


@pytest.mark.slow
def test_signal_on_one_language_rank_stops_all_ranks_async_save(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = TINY + HETERO4 + ["--steps", "3", "--save", save, "--save-every", "1", "--async-save"]
    first = run_distributed(_signal_mid_step, 4, argv)
    assert [len(h) for h, _ in first] == [1] * 4
    assert latest(save) == "step_00000001" and sorted(os.listdir(save)) == ["latest", "run_config.json", "step_00000001"]
    straight = run_distributed(_train, 4, TINY + HETERO4 + ["--steps", "3"])
    resumed = run_distributed(_train, 4, argv + ["--load", save])
    for rank in range(4):
        assert_same(resumed[rank][1], straight[rank][1])


# ---------------------------------------------------------------- failed saves

def _failing_writer(rank, world, argv, fail_step):
    """Rank 1's writes of step `fail_step` raise as a full disk would."""
    write = checkpoint.write_atomic

    def write_or_fail(path, obj):
        if rank == 1 and f"step_{fail_step:08d}" in path:
            raise OSError(28, "No space left on device", path)
        return write(path, obj)
    checkpoint.write_atomic = write_or_fail
    try:
        return _train(rank, world, argv)
    finally:
        checkpoint.write_atomic = write


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.slow
def test_failed_save_ends_the_run_and_keeps_latest(tmp_path, mode):
    save = str(tmp_path / "ckpt")
    argv = TINY + ["--steps", "4", "--save", save, "--save-every", "1"] + (["--async-save"] if mode == "async" else [])
    results = run_distributed(_failing_writer, 2, argv, 2)
    for msg in results:
        assert isinstance(msg, str), msg
        assert msg.startswith(f"checkpoint {save}/step_00000002 FAILED (rank 1: OSError: [Errno 28] No space left "
                              f"on device: '{save}/step_00000002/") and "`latest` stays step_00000001" in msg, msg
    assert latest(save) == "step_00000001"
    assert not os.path.exists(os.path.join(save, "step_00000002"))   # nothing half-written left on the disk


def test_non_finite_abort_without_a_checkpoint_says_start_again():
    with pytest.raises(SystemExit) as e:
        failsafe.check_finite_run(3, 3, float("nan"), None)
    assert str(e.value) == "3 consecutive steps had non-finite gradients (grad norm nan); stopping, no checkpoint was " \
        "saved. Start again with a lower --lr or longer warmup"


def test_unwritable_save_directory_is_refused_before_step_1(tmp_path):
    (tmp_path / "file").write_text("x")
    save = str(tmp_path / "file" / "ckpt")   # below a regular file: nobody can write there, not even root
    (msg,) = run_distributed(_train, 1, TINY + ["--steps", "1", "--save", save])
    assert msg == f"--save {save}: rank 0 cannot write there (NotADirectoryError: Not a directory); give a " \
                  "writable directory (every rank writes into it)", msg


def _deep(root, size):
    """A path below directory `root` of `size` bytes (ASCII), in components of at most 101."""
    path = str(root)
    while size - len(path) > 102:
        path += "/" + "d" * 100
    rest = size - len(path)
    if rest == 1:   # no room for "/" and a name: one byte off the last component
        path, rest = path[:-1], 2
    return path + ("/" + "d" * (rest - 1) if rest else "")


def test_a_save_path_over_the_file_system_s_limit_is_refused_before_step_1(tmp_path):
    """A --save whose checkpoint paths would pass PATH_MAX: one line before step 1, naming the longest and the
    longest --save that fits, which does (it was a FAILED checkpoint after the first steps); nothing is left."""
    limit = os.pathconf(tmp_path, "PC_PATH_MAX") - 1
    save = _deep(tmp_path / "over", limit - 30)
    (msg,) = run_distributed(_train, 1, TINY + ["--steps", "1", "--save", save])
    said = re.fullmatch(rf"--save {re.escape(save)}: a checkpoint writes step_00000001/(\S+) there, a path of (\d+) "
                        rf"bytes, but its file system allows {limit}\. Choose a --save whose absolute path has at most "
                        r"(\d+) bytes", msg)
    assert said and int(said[2]) > limit and said[1] == "model.language.ep0-etp0.safetensors.tmp", msg
    assert os.listdir(tmp_path) == []   # the directories it made for --save: gone
    fit = int(said[3])
    (msg,) = run_distributed(_train, 1, TINY + ["--steps", "1", "--save", _deep(tmp_path / "over", fit + 1)])
    assert isinstance(msg, str) and msg.endswith(f"at most {fit} bytes"), msg
    (done,) = run_distributed(_train, 1, TINY + ["--steps", "1", "--save", _deep(tmp_path / "fits", fit)])
    assert [h["step"] for h in done[0]] == [1] and latest(_deep(tmp_path / "fits", fit)) == "step_00000001"


def _name_max_30(rank, world, argv):
    """_train on a file system whose names are at most 30 bytes (os.pathconf says so)."""
    pathconf = os.pathconf
    os.pathconf = lambda path, name: 30 if name == "PC_NAME_MAX" else pathconf(path, name)
    return _train(rank, world, argv)


def test_a_save_file_name_over_the_file_system_s_limit_is_refused_before_step_1(tmp_path):
    save = str(tmp_path / "ckpt")
    (msg,) = run_distributed(_name_max_30, 1, TINY + ["--steps", "1", "--save", save])
    assert msg == f"--save {save}: a checkpoint writes model.language.ep0-etp0.safetensors.tmp, a name of 39 bytes, " \
                  "but its file system allows 30. Choose a --save on another file system", msg


class _Tokenizer:
    def save(self, out):   # as transformers' save_pretrained: a directory of files, one in a subdirectory
        os.makedirs(os.path.join(out, "additional_chat_templates"))
        for name in ("tokenizer.json", "tokenizer_config.json", "additional_chat_templates/tool_use.jinja"):
            open(os.path.join(out, name), "w").write("{}")


def test_the_length_check_knows_the_run_files_a_save_writes(tmp_path):
    """resume.run_file_names, which the start-up check measures too, are the paths write_run_files writes in a step
    directory: the tokenizer's copy, the HF source's files but its weights, its carried tensors."""
    import resume
    from safetensors.torch import save_file
    source = tmp_path / "hf"
    source.mkdir()
    for name in ("config.json", "a_processor_config_of_a_long_name.json"):
        (source / name).write_text("{}")
    save_file({"language_model.w": torch.zeros(1)}, str(source / "model.safetensors"))
    names = resume.run_file_names(_Tokenizer(), str(source))
    resume.write_run_files(str(tmp_path / "step"), _Tokenizer(), str(source))
    written = {os.path.relpath(os.path.join(d, f), tmp_path / "step") for d, _, files in os.walk(tmp_path / "step")
               for f in files}
    assert {n.removesuffix(".tmp") for n in names} == written and "source/carried.safetensors.tmp" in names
    assert "source/a_processor_config_of_a_long_name.json" in written and "source/model.safetensors" not in written


# ---------------------------------------------------------------- requeue

@pytest.mark.slow
def test_requeue_line_runs_twice(tmp_path, capfd):
    save = str(tmp_path / "ckpt")
    line = TINY + ["--steps", "2", "--save", save, "--load", save]
    (first,) = run_distributed(_train, 1, line)
    assert len(first[0]) == 2 and latest(save) == "step_00000002"
    (again,) = run_distributed(_train, 1, line)
    assert again[0] == []
    out = capfd.readouterr().out
    assert f"--load {save}: no checkpoint there yet: starting fresh" in out
    assert f"nothing to train: {save}/step_00000002 is at step 2 and --steps is 2" in out
    (more,) = run_distributed(_train, 1, TINY + ["--steps", "3", "--save", save, "--load", save])
    (straight,) = run_distributed(_train, 1, TINY + ["--steps", "3"])
    assert_same(more[1], straight[1])


# ---------------------------------------------------------------- freezing

STAGE1 = TINY + ["--steps", "2", "--stage", "1", "--mock-text-only-frac", "0.5", "--lr", "1e-3",
                 "--lr-schedule", "constant"]


@pytest.mark.slow
def test_stage1_with_text_only_micro_batches_hetero_and_colocated():
    (ref,) = run_distributed(_train, 1, STAGE1)
    hetero = run_distributed(_train, 4, STAGE1 + HETERO4)
    colocated_ep = run_distributed(_train, 2, STAGE1 + ["--colocated", "--lm-ep", "2"])
    init = run_distributed(_train, 1, STAGE1 + ["--steps", "0"])[0][1]
    assert any(not torch.equal(ref[1][k], init[k]) for k in ref[1] if k.startswith("vision.mlp1."))
    assert all(torch.equal(ref[1][k], init[k]) for k in ref[1]   # frozen (the expert biases still balance load)
               if not k.startswith("vision.mlp1.") and not k.endswith("e_score_correction_bias"))
    for rank, (hist, state) in enumerate(hetero + colocated_ep):   # the same step as one process
        assert all(h["ok"] for h in hist) and [h["grad_norm"] for h in hist] == pytest.approx(
            [h["grad_norm"] for h in ref[0]], rel=1e-5)
        for k in (k for k in state if k.startswith("vision.mlp1.")):
            assert torch.allclose(state[k], ref[1][k], atol=1e-6), (rank, k)


@pytest.mark.slow
def test_stage1_resume_with_frozen_parameters_is_exact(tmp_path):
    save = str(tmp_path / "ckpt")
    run_distributed(_train, 2, STAGE1 + ["--steps", "1", "--save", save])
    resumed = run_distributed(_train, 2, STAGE1 + ["--load", save])
    straight = run_distributed(_train, 2, STAGE1)
    for rank in range(2):
        assert [h["loss"] for h in resumed[rank][0]] == [h["loss"] for h in straight[rank][0][1:]]
        assert_same(resumed[rank][1], straight[rank][1])


def test_train_layers_matching_nothing_is_refused():
    (msg,) = run_distributed(_train, 1, TINY + ["--train-layers", "^vision\\.nope"])
    assert msg.startswith("--train-layers '^vision\\\\.nope' matches no parameter, so nothing would train; "
                          "names look like vision."), msg


# ---------------------------------------------------------------- images

def test_thin_images_get_two_patches_a_side(tmp_path):
    """transformers floors 1 x 4000 px under a small budget to 0 rows; here a side has at least 2 patches."""
    for budget in (16, 64, 256, 1024, 13312):
        for H, W in ((1, 4000), (20, 5000), (4000, 1), (1, 1)):
            th, tw = radio.grid_for(H, W, budget, 16)
            assert th >= 2 and tw >= 2 and th % 2 == 0 and tw % 2 == 0, (H, W, budget, th, tw)
    assert radio.grid_for(1, 4000, 13312, 16) == (2, 250)            # transformers' grid where it has one
    assert radio.grid_for(1, 4000, 16, 16) == (2, 62)
    os.makedirs(tmp_path / "img")
    Image.new("RGB", (4000, 1), (0, 9, 0)).save(tmp_path / "img" / "line.png")
    Image.new("RGB", (5000, 20), (9, 0, 0)).save(tmp_path / "img" / "strip.png")
    cfg = config.resolve("tiny", {"seq_len": 256})
    lines = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"img/{n}.png"}]},
                           {"role": "assistant", "content": "thin"}]} for n in ("line", "strip")]
    path = _jsonl(tmp_path / "thin.jsonl", lines)
    ds, _ = _build(path, cfg, verbose=False)
    for i in range(2):
        s = ds[i]
        (img,) = s.images
        th, tw = img.shape[1] // 16, img.shape[2] // 16
        assert th == 2 and tw >= 2 and int((s.input_ids == cfg.image_token_id).sum()) == th * tw // 4


def test_truncated_jpeg_is_caught_at_indexing(tmp_path, capsys):
    Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "ok.jpg")
    raw = (tmp_path / "ok.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(raw[: len(raw) * 2 // 3])
    lines = [{"messages": [{"role": "user", "content": [{"type": "image", "image": n}]},
                           {"role": "assistant", "content": "a"}]} for n in ("ok.jpg", "cut.jpg", "ok.jpg")]
    path = _jsonl(tmp_path / "imgs.jsonl", lines)
    cfg = config.resolve("tiny")
    with pytest.raises(data.BadSample, match=f"^{path}:2: undecodable image .*cut.jpg: Truncated File Read"):
        _build(path, cfg)
    ds, _ = _build(path, cfg, skip_bad_samples=True)
    assert f"{path}: 2 documents, skipped 1 bad line(s)" in capsys.readouterr().out
    assert list(ds.sources[0][2]["lines"]) == [1, 3]


def test_image_damaged_after_indexing_is_skipped_on_every_rank(tmp_path, capfd):
    """The index (cached beside the file) says the image is fine; at load time only the vision rank decodes it."""
    for name in ("a", "b", "c"):
        Image.new("RGB", (64, 48), (9, 9, 9)).save(tmp_path / f"{name}.jpg")
    lines = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"{n}.jpg"}]},
                           {"role": "assistant", "content": f"{n}{n}"}]} for n in ("a", "b", "c")]
    path = _jsonl(tmp_path / "imgs.jsonl", lines)
    ds, _ = _build(path, config.resolve("tiny"), seed=1234, skip_bad_samples=True)   # index cache
    raw = (tmp_path / "b.jpg").read_bytes()
    (tmp_path / "b.jpg").write_bytes(raw[: len(raw) // 2])
    bad = [i for i in range(8) if ds.doc(0, i) == 1]   # samples of the 2 steps that draw b.jpg's line
    results = run_distributed(_train, 2, HETERO2 + ["--steps", "2", "--data", path, "--skip-bad-samples"])
    assert all(h["ok"] for h in results[1][0]) and len(results[0][0]) == 2
    # the step line's real tokens (fill, tok/s, MFU) are the other samples' only: a blank's padding is no one's work
    for s, h in enumerate(results[1][0]):
        assert h["tokens"] == sum(data.sizes(ds, i)[0] for i in range(4 * s, 4 * s + 4) if i not in bad)
    out = capfd.readouterr().out
    for n, i in enumerate(bad, 1):
        assert f"skipped sample {i} ({path}:2: undecodable image {tmp_path}/b.jpg: " in out
        assert f"{n} skipped at load time so far" in out
    assert out.count("skipped at load time so far") == len(bad) >= 1


@pytest.mark.slow
def test_an_evaluation_does_not_skip_a_bad_sample(tmp_path):
    """--eval-only on --data under --skip-bad-samples: only the vision rank decodes the damaged image, and an
    evaluation has no step to agree in, so the run ends with that sample's one line (it used to blank the sample on
    the vision rank alone, and the language rank waited for image rows that never came)."""
    for name in ("a", "b", "c"):
        Image.new("RGB", (64, 48), (9, 9, 9)).save(tmp_path / f"{name}.jpg")
    lines = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"{n}.jpg"}]},
                           {"role": "assistant", "content": f"{n}{n}"}]} for n in ("a", "b", "c")]
    path = _jsonl(tmp_path / "imgs.jsonl", lines)
    _build(path, config.resolve("tiny"), seed=1234, skip_bad_samples=True)   # the index, cached: the image was fine
    raw = (tmp_path / "b.jpg").read_bytes()
    (tmp_path / "b.jpg").write_bytes(raw[: len(raw) // 2])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          os.path.join(ROOT, "train.py"), *HETERO2, "--data", path, "--skip-bad-samples", "--eval-only",
                          "--collective-timeout", "30"], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=240)
    both = out.stdout + out.stderr
    errors = [line for line in both.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and len(errors) == 1, both
    assert errors[0].startswith(f"error: {path}:2: undecodable image {tmp_path}/b.jpg: ") and errors[0].endswith(
        "Fix the line or pass --skip-bad-samples (a training step's; an evaluation's samples must load)"), both


def test_a_blanked_sample_counts_no_real_tokens_and_survives_pinning(tmp_path):
    """A Blank runs as padding tokens (none masked off: the model sees what it saw) and counts as no real token;
    the loader's pinning (CUDA) keeps it a Blank with its reason, which skip_agreed reads."""
    lines = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]}]
    ds, _ = _build(_jsonl(tmp_path / "t.jsonl", lines), config.resolve("tiny"))
    real, blank = ds[0], failsafe.SkipBad(ds).blank(True, "t.jsonl:1: why")
    assert blank.n_pad == 0 and (blank.labels == -100).all() and blank.images == []
    pinned = blank.pin_memory()   # no images: nothing to pin, so this runs without CUDA
    assert isinstance(pinned, failsafe.Blank) and pinned.bad == "t.jsonl:1: why"
    n_real = len(real.input_ids) - real.n_pad
    assert train.lane_counts([real, blank]) == [int(real.labels.ne(-100).sum()), n_real]


def _jsonl(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _build(path, cfg, verbose=True, **kw):
    """data.build of `path` with the run fields kw (seed 7) and the byte tokenizer."""
    cfg = dataclasses.replace(cfg, **{"data": path, "seed": 7, **kw})
    return data.build(cfg, data.load_tokenizer(None, cfg), verbose)


# ---------------------------------------------------------------- numbers

def _inf_from_step(rank, world, argv, first_bad):
    """Every gradient is inf from optimizer step `first_bad` on."""
    finish, calls = optim.AdamW.finish, []

    def poisoned(opt, *a, **k):
        calls.append(1)
        if len(calls) >= first_bad:
            for p in opt.params():
                for g in (p.grad, getattr(p, "main_grad", None)):   # main_grad: optim.py's fp32 accumulator
                    if g is not None:
                        g.fill_(float("inf"))
        return finish(opt, *a, **k)
    optim.AdamW.finish = poisoned
    try:
        return _train(rank, world, argv)
    finally:
        optim.AdamW.finish = finish


@pytest.mark.slow
def test_non_finite_steps_abort_after_max_skipped_steps(tmp_path):
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    argv = TINY + ["--steps", "10", "--save", save, "--save-every", "2", "--max-skipped-steps", "3",
                   "--metrics-file", metrics]
    msgs = run_distributed(_inf_from_step, 2, argv, 3)
    assert msgs[0] == msgs[1] == ("3 consecutive steps had non-finite gradients (grad norm nan); stopping, `latest` "
                                  f"stays step_00000004 in {save}. Resume from it with a lower --lr or longer "
                                  "warmup, or raise --max-skipped-steps"), msgs
    recs = [json.loads(line) for line in open(metrics)]   # valid JSON: NaN written as null
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and [r["grad_norm"] for r in recs[2:]] == [None, None]
    assert all(math.isfinite(r["grad_norm"]) for r in recs[:2]) and [r["skipped"] for r in recs] == [0, 0, 1, 2]
    _, at_2 = checkpoint.load_model(os.path.join(save, "step_00000002"))
    _, at_4 = checkpoint.load_model(save)   # saved after two skipped steps: still the last good step's weights
    assert latest(save) == "step_00000004" and at_2.keys() == at_4.keys()
    assert all(torch.equal(at_2[k], at_4[k]) for k in at_2 if not k.endswith("e_score_correction_bias"))


def test_json_line_writes_non_finite_as_null():
    rec = {"a": float("nan"), "b": [1.5, float("inf")], "c": {"d": -float("inf")}, "e": 2}
    assert logs.json_line(rec) == '{"a": null, "b": [1.5, null], "c": {"d": null}, "e": 2}\n'


def test_clip_grad_zero_is_off_and_negative_is_refused():
    one = TINY + ["--steps", "1", "--lr", "1e-3"]
    (off,) = run_distributed(_train, 1, one + ["--clip-grad", "0"])
    (huge,) = run_distributed(_train, 1, one + ["--clip-grad", "1e30"])
    (clipped,) = run_distributed(_train, 1, one + ["--clip-grad", "1e-3"])
    assert off[0][0]["grad_norm"] > 1e-3                          # so 1e-3 clips, and 0 must not zero the update
    assert_same(off[1], huge[1])
    assert any(not torch.equal(off[1][k], clipped[1][k]) for k in off[1])
    (msg,) = run_distributed(_train, 1, one + ["--clip-grad", "-1"])
    assert msg == "--clip-grad -1.0: must be >= 0 (0 turns clipping off)"


# ---------------------------------------------------------------- bad input: one line naming the file

@pytest.mark.parametrize("entry, message", [
    ("-0.5:{a}", "bad data entry '-0.5:{a}': weight '-0.5' is not a finite number > 0"),
    ("x:{a}", "bad data entry 'x:{a}': weight 'x' is not a finite number > 0"),
    ("1e400:{a}", "bad data entry '1e400:{a}': weight '1e400' is not a finite number > 0"),
    ("{d}/empty", "directory {d}/empty holds no .jsonl/.json/.parquet files. Check the path"),
    ("0.5:{a},0.5:{d}/nope.jsonl", "data file {d}/nope.jsonl does not exist. Check the path"),
])
def test_bad_blend_and_paths(tmp_path, entry, message):
    a = _jsonl(tmp_path / "a.jsonl", [{"text": "hello"}])
    os.makedirs(tmp_path / "empty")
    spec, message = (s.format(a=a, d=str(tmp_path)) for s in (entry, message))
    with pytest.raises(SystemExit, match="^" + message.replace("(", r"\(").replace(".", r"\.").replace("+", r"\+")):
        _build(spec, config.resolve("tiny"))
    assert formats.parse_blend(f"0.25:{a},0.75:{a}") == [(0.25, a), (0.75, a)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("saved") / "ckpt")
    run_distributed(_train, 2, TINY + ["--steps", "1", "--save", save])
    return save


@pytest.mark.parametrize("damage", ["config", "rank_corrupt", "rank_deleted", "meta"])
def test_damaged_checkpoint_json_is_one_line(saved, tmp_path, damage):
    save = str(tmp_path / "ckpt")
    shutil.copytree(saved, save)
    step = os.path.join(save, "step_00000001")
    name = {"config": "config.json", "meta": "meta.json"}.get(damage, "rank_00001.json")
    path = os.path.join(step, name)
    if damage == "rank_deleted":
        os.remove(path)
    else:
        open(path, "w").write('{"truncated": ')
    msgs = run_distributed(_train, 2, TINY + ["--steps", "2", "--load", save])
    what = "missing" if damage == "rank_deleted" else "corrupt (Expecting value: line 1 column 15 (char 14))"
    fix = "resume with --no-load-rng" if name.startswith("rank") else f"--load an earlier step of {save}"
    for msg in msgs:
        assert isinstance(msg, str) and msg.startswith(f"{path}: {what}; restore it, or ") and fix in msg, msg
    if name.startswith("rank"):
        resumed = run_distributed(_train, 2, TINY + ["--steps", "2", "--load", save, "--no-load-rng"])
        assert all(len(h) == 1 for h, _ in resumed)


# ---------------------------------------------------------------- shared work, one line from one rank

def _index_on_a_full_disk(rank, world, path):
    """data.build on every rank; local rank 0's write of the index cache fails as on a full disk."""
    if rank == 0:
        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")
        formats.np.savez = full   # this forked child only
    cfg = dataclasses.replace(config.resolve("tiny"), data=path)
    try:
        data.build(cfg, data.load_tokenizer(None, cfg), verbose=False)
    except SystemExit as e:
        return str(e)


def test_failed_index_cache_write_ends_every_rank(tmp_path):
    """Local rank 0 indexes, the others wait for its cache: its failure is theirs, at once (no hang), and nothing
    is left behind."""
    path = _jsonl(tmp_path / "chat.jsonl", [{"text": "hello"}] * 3)
    start = time.monotonic()
    msgs = run_distributed(_index_on_a_full_disk, 2, path, timeout=30.0)
    assert time.monotonic() - start < 20
    cache = next(iter(glob.glob(str(tmp_path / ".chat.jsonl.*.idx.npz")) or [None]))
    assert cache is None and not glob.glob(str(tmp_path / "*.tmp")) and not glob.glob(str(tmp_path / ".*.tmp"))
    assert msgs[0] == msgs[1] and re.fullmatch(
        rf"{re.escape(path)}: cannot write its index cache \S+\.idx\.npz \(OSError: No space left on device\)\. "
        rf"Free space in {re.escape(str(tmp_path))}, or make it read-only \(every rank then indexes for itself\)",
        msgs[0]), msgs


def test_eval_only_with_skip_bad_samples_scores_the_data(tmp_path):
    """--eval-only without --eval-data scores --data, also wrapped by --skip-bad-samples (it has a length)."""
    path = _jsonl(tmp_path / "docs.jsonl", [{"text": "hello world"}, {"text": "a second document"}])
    (result,), _ = train.main(["--preset", "tiny", "--data", path, "--skip-bad-samples", "--eval-only"])
    assert result["eval_samples"] == 2 and result["eval_tokens"] == 11 + 17 + 2   # bytes and an EOS each
