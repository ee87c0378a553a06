"""No command destroys a checkpoint: export-hf never writes into a checkpoint nor over files it does not write; one
run at a time holds a --save directory (a lock that a killed run does not leave behind); a branch from an older step
never replaces a newer one; a line of another model or run is refused, never resumed; a Saver never deletes a
complete step. The command lines' one-line errors, export-hf's exit status and what it says it exported."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import checkpoint
import hf_interop
import locks
import radio
from tests.spawn import run_distributed
from tests.test_failsafe import _train, latest
from tests.test_hf import build_lm, full

TINY = ["--preset", "tiny", "--global-batch", "2", "--lr-decay-iters", "6"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree(root):
    """{relative path: (inode, mtime, size)} of every file under root but run_config.json (logs.py rewrites it each
    run): equal before and after = nothing touched."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), root)] = (st.st_ino, st.st_mtime_ns, st.st_size)
    out.pop("run_config.json", None)
    return out


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """A tiny run saved at every one of its 4 steps (fresh: empty lineage); tests copy it before they run on it."""
    save = str(tmp_path_factory.mktemp("run4") / "D")
    (result,) = run_distributed(_train, 1, TINY + ["--steps", "4", "--save", save, "--save-every", "1"])
    assert [h["step"] for h in result[0]] == [1, 2, 3, 4]
    return save


def contents(root):
    return {f: open(os.path.join(root, f), "rb").read() for f in tree(root)}


def copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


# ---------------------------------------------------------------- export-hf

def test_export_never_writes_into_a_checkpoint(run4, tmp_path):
    before = tree(run4)
    step = os.path.join(run4, "step_00000004")
    for out, how in ((run4, "is a checkpoint directory"), (step, "is a checkpoint directory"),
                     (os.path.join(run4, "hf"), f"lies in the checkpoint directory {run4}"),
                     (os.path.join(step, "a", "b"), f"lies in the checkpoint directory {step}")):
        for extra in ([], ["--overwrite"]):
            with pytest.raises(SystemExit) as e:
                hf_interop.main(["export-hf", "--load", run4, "--out", out, *extra])
            assert str(e.value) == f"error: --out {out} {how}: export-hf never writes into one. Choose a new " \
                                   "directory outside it"
    assert tree(run4) == before and not os.path.exists(os.path.join(run4, "hf"))
    # a save directory polluted by an earlier export (config.json with a model_type) is still no HF directory: a
    # requeue resumes the run rather than starting from the exported weights
    polluted = copy(run4, tmp_path / "polluted")
    hf_interop.main(["export-hf", "--load", run4, "--out", str(tmp_path / "hf")])
    shutil.copy(tmp_path / "hf" / "config.json", os.path.join(polluted, "config.json"))
    assert hf_interop.is_hf_dir(str(tmp_path / "hf")) and not hf_interop.is_hf_dir(polluted)


def test_export_says_which_step(run4, tmp_path, capsys):
    hf_interop.main(["export-hf", "--load", run4, "--out", str(tmp_path / "newest")])
    hf_interop.main(["export-hf", "--load", os.path.join(run4, "step_00000002"), "--out", str(tmp_path / "two")])
    said = capsys.readouterr().out.splitlines()
    assert said == [f"wrote {tmp_path / 'newest'} from step 4 ({run4}/step_00000004)",
                    f"wrote {tmp_path / 'two'} from step 2 ({run4}/step_00000002)"]


@pytest.fixture
def small(tmp_path):
    """A full-tensor checkpoint of the tiny VLM (save_model): the cheapest thing export-hf reads."""
    cfg, lm = build_lm()
    sd = {**full(lm.state_dict()), **{"vision." + k: v for k, v in radio.VisionModel(cfg).state_dict().items()}}
    checkpoint.save_model(tmp_path / "ckpt", cfg, sd)
    return str(tmp_path / "ckpt")


def test_export_into_a_non_empty_directory(small, tmp_path):
    out = tmp_path / "out"
    hf_interop.main(["export-hf", "--load", small, "--out", str(out), "--max-shard-bytes", "50000"])   # sharded
    shards = sorted(f for f in os.listdir(out) if f.startswith("model-"))
    assert len(shards) > 1 and (out / hf_interop.INDEX_NAME).exists()
    (out / "notes.txt").write_text("mine")
    (out / "model_notes.safetensors").write_text("mine too")
    before = tree(out)
    with pytest.raises(SystemExit) as e:
        hf_interop.main(["export-hf", "--load", small, "--out", str(out)])
    assert str(e.value) == f"error: --out {out} is not empty ({len(before)} entries, e.g. config.json). Choose a new " \
                           "or empty directory, or pass --overwrite to replace the files export-hf writes there " \
                           "(the others stay)"
    assert tree(out) == before
    hf_interop.main(["export-hf", "--load", small, "--out", str(out), "--overwrite"])   # one shard now
    after = sorted(os.listdir(out))
    assert "model.safetensors" in after and not set(shards) & set(after) and hf_interop.INDEX_NAME not in after
    assert (out / "notes.txt").read_text() == "mine" and (out / "model_notes.safetensors").read_text() == "mine too"
    assert not [f for f in after if f.startswith(".")]   # its staging directory is gone
    cfg, sd = hf_interop.import_hf(str(out), preset="tiny")
    assert torch.equal(sd["language.lm_head.weight"], checkpoint.load_model(small)[1]["language.lm_head.weight"])


def test_export_over_the_hf_directory_a_run_came_from_keeps_the_checkpoint(small, tmp_path):
    """The checkpoint's source/ hard-links the HF directory's files (copy_source): an export back into that
    directory replaces its entries, never writes into the files the checkpoint shares."""
    hf = tmp_path / "hf"
    hf_interop.main(["export-hf", "--load", small, "--out", str(hf)])
    (hf / "processor_config.json").write_text('{"processor_class": "P"}')
    hf_interop.copy_source(str(hf), os.path.join(small, checkpoint.SOURCE_DIR))
    source = os.path.join(small, checkpoint.SOURCE_DIR, "processor_config.json")
    assert os.path.samefile(source, hf / "processor_config.json")
    before = tree(small)
    hf_interop.main(["export-hf", "--load", small, "--out", str(hf), "--overwrite"])
    assert tree(small) == before and open(source).read() == '{"processor_class": "P"}'
    assert json.loads((hf / "processor_config.json").read_text()) == {"processor_class": "P"}


def test_a_failed_export_leaves_no_out_directory_it_made(tmp_path):
    """Issue 53, friction 10: an export that fails while writing removes the --out it created; one that was there
    stays, with what it held."""
    def failing(stage):
        open(os.path.join(stage, "model.safetensors"), "w").write("part")
        raise OSError("No space left on device")
    out = tmp_path / "new" / "hf"
    with pytest.raises(OSError):
        hf_interop._staged(str(out), failing)
    assert not out.exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "README.md").write_text("kept")
    with pytest.raises(OSError):
        hf_interop._staged(str(tmp_path / "old"), failing)
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["README.md"]


def test_export_errors_are_one_line_exit_2(small, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = str(tmp_path / "file" / "hf")   # below a regular file: nobody can write there, not even root
    with pytest.raises(SystemExit) as e:
        hf_interop.cli(["export-hf", "--load", small, "--out", out])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: --out {out}: cannot write there (NotADirectoryError: Not a " \
                                      "directory). Choose a writable directory\n"
    with pytest.raises(SystemExit) as e:
        hf_interop.cli(["export-hf", "--load", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {tmp_path / 'nowhere' / 'meta.json'}: missing") and \
        err.count("\n") == 1, err


def test_import_refuses_a_checkpoint_and_a_non_empty_out(small, run4, tmp_path):
    hf = tmp_path / "hf"
    hf_interop.main(["export-hf", "--load", small, "--out", str(hf)])
    before = tree(run4)
    for out in (run4, os.path.join(run4, "step_00000001")):
        with pytest.raises(SystemExit, match=r"^error: --out .* is a checkpoint directory: import-hf never writes "
                                             r"into one\. Choose a new directory outside it$"):
            hf_interop.main(["import-hf", "--hf", str(hf), "--out", out, "--preset", "tiny"])
    assert tree(run4) == before
    with pytest.raises(SystemExit, match=rf"^error: --out {hf} is not empty \("):
        hf_interop.main(["import-hf", "--hf", str(hf), "--out", str(hf), "--preset", "tiny"])


# ---------------------------------------------------------------- one run per --save

def test_hold_refuses_a_second_holder_and_releases(tmp_path):
    save = str(tmp_path / "run")
    held = locks.hold(save, "train.py --save run")
    with pytest.raises(SystemExit) as e:
        locks.hold(save, "train.py --other")
    assert re.fullmatch(rf"--save {save} is in use by another run \(pid {os.getpid()} on host "
                        rf"{re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d: train\.py --save "
                        r"run\)\. Wait for it to end, or choose another --save", str(e.value)), str(e.value)
    held.release()
    assert not os.path.exists(save)   # a run that ends leaves nothing behind: nor the directory it created for nothing
    locks.hold(save, "again").release()


def test_a_killed_holder_leaves_no_lock(tmp_path):
    save = str(tmp_path / "run")
    ready, go = os.pipe()
    pid = os.fork()
    if pid == 0:   # the first run: holds the directory, then is killed with SIGKILL (no clean-up runs)
        try:
            locks.hold(save, "first")
            os.write(go, b"1")
            signal.pause()
        finally:
            os._exit(0)   # never back into pytest
    os.close(go)
    assert os.read(ready, 1) == b"1"
    with pytest.raises(SystemExit, match=rf"in use by another run \(pid {pid} on host .*: first\)"):
        locks.hold(save, "second")
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    locks.hold(save, "second").release()


def test_a_second_run_on_one_save_is_refused(tmp_path):
    """train.main takes the hold (rank 0, before it reads --save): here another holder is this test process."""
    save = str(tmp_path / "run")
    held = locks.hold(save, "the other run")
    try:
        (msg,) = run_distributed(_train, 1, TINY + ["--steps", "1", "--save", save])
        assert os.listdir(save) == [".lock"]   # the holder's: the refused run wrote nothing
    finally:
        held.release()
    assert isinstance(msg, str) and msg.startswith(f"--save {save} is in use by another run (pid {os.getpid()} "), msg
    (done,) = run_distributed(_train, 1, TINY + ["--steps", "1", "--save", save])
    assert len(done[0]) == 1 and ".lock" not in os.listdir(save)


def test_a_refused_run_leaves_no_save_directory_behind(tmp_path):
    """A run refused by a user error, or failing before it writes into --save, removes the directories it created
    for it (they were left empty); a directory that was there stays, and so does what is in one."""
    new = str(tmp_path / "runs" / "a" / "b")
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for save in (new, str(kept), str(kept / "new")):
        for bad in (["--load", str(tmp_path / "nowhere")], ["--data", str(tmp_path / "none.jsonl")],
                    ["--lm-tp", "3"]):
            (msg,) = run_distributed(_train, 1, TINY + ["--steps", "1", "--save", save, *bad])
            assert isinstance(msg, str), msg
            assert sorted(os.listdir(tmp_path)) == ["kept"] and os.listdir(kept) == ["notes.txt"], (save, bad)


# ---------------------------------------------------------------- readers of a run that is still saving

def _after_the_choice(then):
    """checkpoint.saved_config calls then() once, before its first read: the reader has chosen its step (resume.py
    reads the run record of the step it chose first). In this forked child only."""
    read, calls = checkpoint.saved_config, []

    def first_then(path, *args, **kwargs):
        if not calls:
            calls.append(path)
            then()
        return read(path, *args, **kwargs)
    checkpoint.saved_config = first_then


def _read_while_the_run_prunes(rank, world, argv, save):
    """train.main(argv) reading --load `save` while the run that saves there goes on: between this reader's choice
    of the newest step and its reads, that run (`python train.py`) saves its next step and prunes (--keep-last 1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                              "MASTER_ADDR", "MASTER_PORT")}
    _after_the_choice(lambda: subprocess.run([sys.executable, "train.py", "--load", save, "--steps", "5",
                                              "--keep-last", "1"], cwd=ROOT, env=env, check=True,
                                             stdout=subprocess.DEVNULL))
    return _train(rank, world, argv)


@pytest.mark.parametrize("line", ["eval", "branch"])
def test_a_reader_of_a_run_that_prunes_reads_the_step_it_chose(run4, tmp_path, capfd, line):
    """--eval-only --load D, or a branch --load D --save B, while D's run saves with --keep-last 1: the step the
    reader chose is pinned, so that run's pruning leaves it for a later save (it failed: `step_00000004/meta.json:
    missing`, or a safetensors file missing, read half deleted)."""
    d = copy(run4, tmp_path / "D")
    argv = {"eval": ["--eval-only", "--load", d], "branch": ["--load", d, "--steps", "5", "--save",
                                                            str(tmp_path / "B")]}[line]
    (result,) = run_distributed(_read_while_the_run_prunes, 1, argv, d)
    assert not isinstance(result, str), result
    assert f"checkpoint: loaded {d}/step_00000004 (step 4)" in capfd.readouterr().out
    assert len(result[0]) == 1 and ("eval_loss" in result[0][0] if line == "eval" else result[0][0]["step"] == 5)
    # its run pruned steps 1-3, kept the pinned one, and leaves nothing aside; with the reader gone, it goes
    assert sorted(os.listdir(d)) == ["latest", "run_config.json", "step_00000004", "step_00000005"]
    locks.prune(d, ["step_00000004"])
    assert sorted(os.listdir(d)) == ["latest", "run_config.json", "step_00000005"]


def _ranks_meet_a_new_step(rank, world, argv, step4, save, marker):
    """Rank 0 chooses step 3, the newest; then the run saving into `save` commits step 4 (`step4`, kept aside),
    and only then does rank 1 choose."""
    if rank == 0:
        _after_the_choice(lambda: open(marker, "w").close())
    else:
        while not os.path.exists(marker):
            time.sleep(0.05)
        os.rename(step4, os.path.join(save, "step_00000004"))
        checkpoint.write_atomic(os.path.join(save, "latest"), "step_00000004\n")
    out = _train(rank, world, argv)
    return out if isinstance(out, str) else out[1]


def test_every_rank_loads_rank_0s_step(run4, tmp_path):
    """Ranks that chose different steps of a run still saving (one committed between their choices) all load rank
    0's (rank 1 loaded step 4, rank 0 step 3)."""
    d = copy(run4, tmp_path / "D")
    step4 = str(tmp_path / "step4")
    os.rename(os.path.join(d, "step_00000004"), step4)
    checkpoint.write_atomic(os.path.join(d, "latest"), "step_00000003\n")
    ranks = run_distributed(_ranks_meet_a_new_step, 2, ["--eval-only", "--load", d], step4, d,
                            str(tmp_path / "chosen"))
    three, four = (checkpoint.load_model(os.path.join(d, s))[1] for s in ("step_00000003", "step_00000004"))
    for weights in ranks:
        assert not isinstance(weights, str), weights
        assert weights and all(torch.equal(t, three[k]) for k, t in weights.items())
    assert any(not torch.equal(t, four[k]) for weights in ranks for k, t in weights.items())


# ---------------------------------------------------------------- branches

def test_a_branch_from_an_older_step_never_replaces_a_newer_one(run4, tmp_path, capfd):
    d = copy(run4, tmp_path / "D")
    before, step2, new = tree(d), os.path.join(d, "step_00000002"), str(tmp_path / "branch")
    refusal = f"--load {step2} would continue in {d}, which holds later steps (step_00000003, step_00000004) that " \
              f"it would replace. Pass --save NEW_DIR to branch into a new directory, or --load {d} to continue " \
              "from the newest step"
    for extra in ([], ["--save", d]):
        (msg,) = run_distributed(_train, 1, TINY + ["--load", step2, "--steps", "4", "--lr", "1e-2", *extra])
        assert msg == refusal
    assert tree(d) == before
    line = TINY + ["--load", step2, "--steps", "4", "--lr", "1e-2", "--save", new]
    (branch,) = run_distributed(_train, 1, line)
    assert [h["step"] for h in branch[0]] == [3, 4] and latest(new) == "step_00000004" and tree(d) == before
    capfd.readouterr()
    (again,) = run_distributed(_train, 1, line)   # the same line again: resumes the branch, from its directory
    assert again[0] == [] and f"--save {new} holds step 4 of this run: resuming from it, not from --load {step2}" \
        in capfd.readouterr().out
    # a fresh line (no --load) is not that branch's: it started from D's step 2
    (msg,) = run_distributed(_train, 1, TINY + ["--steps", "5", "--save", new])
    assert msg == f"--save {new} holds step 4 of another run (started from {os.path.realpath(step2)}; this line " \
                  f"starts fresh); choose another --save, or --load {new} to continue that run"


def test_newest_is_the_newest_complete_step(run4, tmp_path, capfd):
    d = copy(run4, tmp_path / "D")
    open(os.path.join(d, "latest"), "w").write("step_00000002\n")   # a save killed between meta.json and `latest`
    assert checkpoint.newest(d) == (os.path.join(d, "step_00000004"), "`latest` names step_00000002: the newest "
                                    "complete step is step_00000004, loading it")
    (again,) = run_distributed(_train, 1, TINY + ["--steps", "4", "--save", d, "--save-every", "1"])
    assert again[0] == [] and f"--save {d} holds step 4 of this run: resuming from it" in capfd.readouterr().out


def test_a_finetune_line_requeues_and_never_fine_tunes_into_its_source(run4, tmp_path, capfd):
    step2, ft = os.path.join(run4, "step_00000002"), str(tmp_path / "ft")
    line = ["--load", step2, "--finetune", "--steps", "2", "--save", ft]
    (first,) = run_distributed(_train, 1, line)
    assert [h["step"] for h in first[0]] == [1, 2]
    before = tree(ft)
    capfd.readouterr()
    (again,) = run_distributed(_train, 1, line)   # resumes the fine-tune: it does not start it again
    assert again[0] == [] and tree(ft) == before
    assert f"--save {ft} holds step 2 of this run: resuming from it, not from --load {step2}" in capfd.readouterr().out
    (msg,) = run_distributed(_train, 1, ["--load", run4, "--finetune", "--save", run4])
    assert msg == f"--load {run4} --finetune would start a new run in --save {run4}, which holds step 4 of its own " \
                  "run; pass --save NEW_DIR for the new run, or drop --finetune to continue that run"


def _saver_meets_a_complete_step(rank, world, argv, other):
    """After step 1, `other` (a complete step 2 of another run) appears in --save before this run saves step 2."""
    after_step = checkpoint.Saver.after_step

    def then_another_run_saves(self, step, counters, last):
        if step == 2 and self.rank == 0:
            shutil.copytree(other, os.path.join(self.root, "step_00000002"))
        return after_step(self, step, counters, last)
    checkpoint.Saver.after_step = then_another_run_saves   # this forked child only
    return _train(rank, world, argv)


@pytest.mark.parametrize("world", [1, 2])
def test_a_saver_never_deletes_a_complete_step(run4, tmp_path, world):
    save = str(tmp_path / "run")
    msgs = run_distributed(_saver_meets_a_complete_step, world, TINY + ["--steps", "3", "--save", save,
                                                                      "--save-every", "1"],
                           os.path.join(run4, "step_00000002"))
    step2 = os.path.join(save, "step_00000002")
    assert msgs == [f"{step2} is a complete checkpoint that this run would replace (is another run saving into "
                    f"{save}?). It is kept: choose another --save, or --load {save} to continue from it"] * world
    assert contents(step2) == contents(os.path.join(run4, "step_00000002")) and latest(save) == "step_00000001"


# ---------------------------------------------------------------- which line is this run's

def test_a_line_of_another_model_is_refused(run4, tmp_path, capfd):
    d = copy(run4, tmp_path / "D")
    before = tree(d)
    (msg,) = run_distributed(_train, 1, TINY + ["--hidden-size", "96", "--steps", "5", "--save", d])
    assert msg == f"--save {d} holds step 4 of a run of another model (started fresh; hidden_size 64, the line's " \
                  f"96); choose another --save, or --load {d} to continue that run"
    (msg,) = run_distributed(_train, 1, ["--preset", "small", "--steps", "5", "--save", d])
    assert msg.startswith(f"--save {d} holds step 4 of a run of another model (started fresh; preset tiny, the "
                          "line's small; "), msg
    (msg,) = run_distributed(_train, 1, TINY + ["--load", os.path.join(run4, "step_00000001"), "--save", d])
    assert msg == f"--save {d} holds step 4 of another run (started fresh; this line starts from --load " \
                  f"{run4}/step_00000001); choose another --save, or --load {d} to continue that run"
    assert tree(d) == before
    capfd.readouterr()   # the run's own model with other training flags is the run: it resumes
    (more,) = run_distributed(_train, 1, TINY + ["--steps", "5", "--lr", "1e-3", "--save", d])
    assert [h["step"] for h in more[0]] == [5]
    assert f"--save {d} holds step 4 of this run: resuming from it" in capfd.readouterr().out



def test_the_resume_line_names_what_changed_from_the_run_as_saved(run4, tmp_path):
    """`changed from the checkpoint's run` compares with the run as saved, its layout too: the same grid flags again
    list nothing of the layout, though another world size re-plans it; dropping --lm-pp lists that, and only that."""
    import cli
    import resume
    d = copy(run4, tmp_path / "D")
    record = os.path.join(d, "step_00000004", "config.json")
    grid = ["--vision-tp", "1", "--vision-dp", "1", "--lm-dp", "1"]
    saved = json.load(open(record))
    json.dump(dict(saved, vision_tp=1, vision_dp=1, lm_dp=1, lm_pp=2), open(record, "w"))

    def changes(argv, world):
        said = []
        resume.resolve(*cli.parse_args(TINY + ["--load", d] + argv), world, said.append)
        return [x for x in said if "changed from the checkpoint's run" in x]
    assert changes(grid + ["--lm-pp", "2", "--steps", "5"], 3) == \
        [f"--load {d}: changed from the checkpoint's run: --steps 4 -> 5"]
    assert changes(grid, 2) == [f"--load {d}: changed from the checkpoint's run: --lm-pp 2 -> chosen"]


@pytest.mark.parametrize("edit, said", [({"steps": "ten"}, '"steps": "ten" (expected int)'),
                                        ({"lr": None}, '"lr": null (expected float)'),
                                        ({"train_samples": "64"}, '"train_samples": "64" (expected int or null)')])
def test_a_hand_edited_run_record_of_the_wrong_types_is_one_line(run4, tmp_path, edit, said):
    """A config.json edited by hand to values of the wrong type: one line naming each field (it was a TypeError
    traceback from the schedule or the record's upgrade)."""
    d = copy(run4, tmp_path / "D")
    record = os.path.join(d, "step_00000004", "config.json")
    json.dump(dict(json.load(open(record)), **edit), open(record, "w"))
    (msg,) = run_distributed(_train, 1, ["--load", d, "--steps", "5"])
    assert msg.startswith(f"{record}: {said}; correct the file (it is the run's record)"), msg


def test_a_run_record_missing_a_field_is_one_line(run4, tmp_path):
    """A field deleted from a config.json by hand: one line naming it (the run resumed at the default seq_len 8192,
    its own was 96, and saved that on; a missing hidden_size was a shape mismatch against 2688). A field added since
    runs were first recorded (config.LATER_FIELDS) may be absent, as in a record of an earlier version: the run
    resumes, and its next record holds every field."""
    def resume(drop):
        d = copy(run4, tmp_path / "-".join(drop))
        record = os.path.join(d, "step_00000004", "config.json")
        json.dump({k: v for k, v in json.load(open(record)).items() if k not in drop}, open(record, "w"))
        return d, record, run_distributed(_train, 1, ["--load", d, "--steps", "5"])[0]
    for drop, said in ((["seq_len"], '"seq_len"'), (["seq_len", "hidden_size", "lm_pp"], '"hidden_size", "seq_len"')):
        _, record, msg = resume(drop)
        assert msg == f"{record}: missing {said} (no default stands in for the run's value); correct the file (it " \
                      "is the run's record). Check --load (a save directory or DIR/step_N of a run of this model)"
    d, _, (history, _) = resume(["lm_pp", "video_fps", "collective_timeout"])
    assert [h["step"] for h in history] == [5]
    assert json.load(open(os.path.join(d, "step_00000005", "config.json"))).keys() == \
        json.load(open(os.path.join(d, "step_00000003", "config.json"))).keys()
