"""A fine-tune's whole life with one command line, on a transformers-saved tiny Omni with its tokenizer and processor
files (resume.py: the checkpoint carries its run): start from the HF directory, interrupt, the same line again
resumes (equal to a straight run), the printed resume line runs, eval needs no --tokenizer, the export is complete
(transformers loads every tensor, the source's config fields and processor files come along, its loss is ours),
LoRA's hyper-parameters come back from the checkpoint and its adapters load in PEFT, import-hf's printed
fine-tune line runs (data and save directory filled in) and requeues."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import data
import hf_interop
import radio
from tests.spawn import run_distributed
from tests.test_failsafe import _launch, _train, assert_same, latest
from tests.test_hf_omni import image, omni  # noqa: F401  (omni: the module-scoped fixture)

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what transformers' Omni processor writes (AutoProcessor reads it back where torchvision is installed)
PROCESSOR = {"processor_class": "NemotronH_Omni_Reasoning_V3Processor"}
IMAGE_PROCESSOR = {"image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor", "min_num_patches": 16,
                   "max_num_patches": 256, "processor_class": "NemotronH_Omni_Reasoning_V3Processor"}


@pytest.fixture(scope="module")
def source(omni, tmp_path_factory):   # noqa: F811
    """(the HF directory with processor files, a chat JSONL with images, a held-out JSONL)."""
    d = tmp_path_factory.mktemp("life")
    hf = d / "hf"
    shutil.copytree(omni[0], hf)
    (hf / "processor_config.json").write_text(json.dumps(PROCESSOR))
    (hf / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR))
    for i, (h, w) in enumerate([(64, 96), (48, 48), (80, 32)]):
        Image.fromarray((image(h, w, i) * 255).byte().permute(1, 2, 0).numpy()).save(d / f"img{i}.png")
    chats = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"img{i % 3}.png"},
                                                        {"type": "text", "text": f"what is {i}?"}]},
                           {"role": "assistant", "content": f"number {i} " * (1 + i % 3)}]} for i in range(12)]
    (d / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats[:10]))
    (d / "val.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats[10:]))
    return str(hf), str(d / "chat.jsonl"), str(d / "val.jsonl")


def _printed(out, prefix):
    """The command a run printed after `prefix`."""
    line = next(x for x in out.splitlines() if x.startswith(prefix))
    return shlex.split(line[len(prefix):].strip().strip("`"))


def _sh(cmd):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.slow
def test_fine_tune_life(source, tmp_path, capfd):
    hf, chat, val = source
    save = str(tmp_path / "run")
    line = ["--load", hf, "--preset", "tiny", "--data", chat, "--global-batch", "4", "--steps", "3", "--save", save,
            "--lr", "1e-3", "--lr-schedule", "constant"]
    # Ctrl-C in step 2 (4 micro-batches a step): step 1 is saved, and the same line again resumes from it
    proc = _launch(tmp_path, line, torchrun=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT and latest(save) == "step_00000001", out
    capfd.readouterr()
    (again,) = run_distributed(_train, 1, line)
    said = capfd.readouterr().out
    assert f"--save {save} holds step 1 of this run: resuming from it, not from --load {hf}" in said
    (straight,) = run_distributed(_train, 1, line[:-5] + [str(tmp_path / "straight")] + line[-4:])
    assert [h["step"] for h in again[0]] == [2, 3]
    assert [h["loss"] for h in again[0]] == [h["loss"] for h in straight[0][1:]]
    assert_same(again[1], straight[1])
    assert sorted(os.listdir(os.path.join(save, "step_00000003", "tokenizer"))) == sorted(
        os.listdir(os.path.join(save, "step_00000001", "tokenizer"))) and "tokenizer.json" in os.listdir(
        os.path.join(save, "step_00000003", "tokenizer"))

    # the printed resume line, verbatim: the checkpoint holds the model, tokenizer, data and schedule
    resume = _printed(said, "resume (add --steps N to train on): ")
    assert resume == ["python", "train.py", "--load", save]
    assert "nothing to train" in _sh([sys.executable] + resume[1:])
    more = _sh([sys.executable] + resume[1:] + ["--steps", "4"])
    assert f"--load {save}: changed from the checkpoint's run: --steps 3 -> 4" in more
    assert re.search(r"step 4/4 \| loss [0-9.]+ ", more) and latest(save) == "step_00000004"

    # eval: the run's own tokenizer (its copy in the checkpoint) without --tokenizer
    evals = [run_distributed(_train, 1, ["--eval-only", "--load", save, "--eval-data", val] + extra)[0][0][0]
             for extra in ([], ["--tokenizer", hf])]
    assert evals[0] == evals[1]
    cfg = hf_interop.HFSource(hf, "tiny", say=lambda m: None).cfg
    enc = data.Encoder(data.load_tokenizer(hf, cfg), cfg)
    rows = [enc.encode(json.loads(x), os.path.dirname(val), pixels=True) for x in open(val)]
    samples = [data.make_row([r], cfg, enc.sp["<pad>"], packed=False) for r in rows]
    assert evals[0]["eval_tokens"] == sum(int((s.labels != -100).sum()) for s in samples)

    # export: every tensor transformers expects (the video embedder among the trained ones), the source's split of
    # RADIO's class tokens and registers, its processor files; the exported model's loss is the run's
    out = str(tmp_path / "export")
    export = _printed(said, "export: ")
    assert export[:4] == ["python", "hf_interop.py", "export-hf", "--load"]
    _sh([sys.executable] + export[1:-1] + [out])
    model, info = transformers.NemotronH_Omni_Reasoning_V3.from_pretrained(out, output_loading_info=True,
                                                                           dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    written, theirs = (json.loads(open(os.path.join(d, "config.json")).read()) for d in (out, hf))
    assert written["text_config"]["max_position_embeddings"] == theirs["text_config"]["max_position_embeddings"] != 96
    written, theirs = written["vision_config"], theirs["vision_config"]
    assert (written["num_cls_tokens"], written["num_registers"]) == (theirs["num_cls_tokens"],
                                                                     theirs["num_registers"]) == (2, 1)
    for name, content in (("processor_config.json", PROCESSOR), ("preprocessor_config.json", IMAGE_PROCESSOR)):
        assert json.loads(open(os.path.join(out, name)).read()) == content
    total, n = 0.0, 0
    with torch.no_grad():
        for (ids, _, images), s in zip(rows, samples):
            grid = [[im.shape[1] // 16, im.shape[2] // 16] for im in images]
            logits = model.eval()(input_ids=s.input_ids[None], pixel_values=torch.cat(
                [radio.patchify(im, 16) for im in images]), image_grid_hw=torch.tensor(grid)).logits[0]
            total += F.cross_entropy(logits, s.labels, ignore_index=-100, reduction="sum").item()
            n += int((s.labels != -100).sum())
    (ev,) = run_distributed(_train, 1, ["--eval-only", "--load", save, "--eval-data", val])[0][0]
    assert abs(total / n - ev["eval_loss"]) < 1e-4
    try:
        import torchvision  # noqa: F401  (the Omni image processor needs it)
    except ImportError:
        return
    assert type(transformers.AutoProcessor.from_pretrained(out)).__name__ == PROCESSOR["processor_class"]


def _branch_while_its_source_prunes(rank, world, argv, live):
    """_train(argv) of a branch whose first save waits for the run it branched from (`live`, --keep-last 1) to save
    and prune first: after this run's set-up, before it copies the HF files of the step it was loaded from."""
    import resume
    write, calls = resume.write_run_files, []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}

    def live_run_first(*args):
        if not calls:
            calls.append(subprocess.run(live, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL))
        return write(*args)
    resume.write_run_files = live_run_first
    return _train(rank, world, argv)


@pytest.mark.slow
def test_the_hf_files_survive_keep_last_and_a_branch_of_a_run_that_prunes(source, tmp_path):
    """A run from an HF directory carries its files (processor configs ...) in every step: resumed with --keep-last 1
    (the third save copied from a pruned step: FileNotFoundError), and in a branch whose source run prunes the step
    it was loaded from before the branch's first save (it stays pinned until the branch has a copy of its own)."""
    hf, chat, _ = source
    save, branch = str(tmp_path / "run"), str(tmp_path / "branch")
    run_distributed(_train, 1, ["--load", hf, "--preset", "tiny", "--data", chat, "--global-batch", "4", "--steps",
                                "1", "--save", save])
    (resumed,) = run_distributed(_train, 1, ["--load", save, "--steps", "3", "--save-every", "1", "--keep-last", "1"])
    assert not isinstance(resumed, str) and sorted(os.listdir(save)) == ["latest", "run_config.json", "step_00000003"]
    live = [sys.executable, "train.py", "--load", save, "--steps", "4"]
    (branched,) = run_distributed(_branch_while_its_source_prunes, 1, ["--load", save, "--steps", "5", "--save",
                                                                        branch, "--keep-last", "0"], live)
    assert not isinstance(branched, str), branched
    assert sorted(os.listdir(save)) == ["latest", "run_config.json", "step_00000003", "step_00000004"]   # pinned
    for step_dir in (f"{save}/step_00000004", f"{branch}/step_00000004", f"{branch}/step_00000005"):
        assert json.load(open(os.path.join(step_dir, "source", "processor_config.json"))) == PROCESSOR, step_dir


@pytest.mark.slow
def test_import_hf_command_runs(source, tmp_path, capfd):
    """import-hf prints the fine-tune line with placeholders for the data and the save directory: filled in, it
    trains on the data, saves, and the same line again resumes the fine-tune instead of starting it over."""
    hf, chat, _ = source
    ckpt, run = str(tmp_path / "ckpt"), str(tmp_path / "run")
    out = _sh([sys.executable, "hf_interop.py", "import-hf", "--hf", hf, "--out", ckpt, "--preset", "tiny"])
    command = shlex.split(re.search(r"the same line again resumes the run from YOUR_RUN_DIR\): `([^`]+)`", out)[1])
    assert command == ["torchrun", "--nproc_per_node=8", "train.py", "--load", ckpt, "--finetune", "--data",
                       "YOUR_DATA.jsonl", "--save", "YOUR_RUN_DIR", "--steps", "1000", "--save-every", "200"]
    line = [{"YOUR_DATA.jsonl": chat, "YOUR_RUN_DIR": run}.get(a, a) for a in command[3:]] + ["--steps", "2"]
    capfd.readouterr()
    (first,) = run_distributed(_train, 1, line)
    assert [h["step"] for h in first[0]] == [1, 2] and latest(run) == "step_00000002"
    assert f"train data: {chat}" in capfd.readouterr().out
    (again,) = run_distributed(_train, 1, line)
    assert again[0] == [] and f"--save {run} holds step 2 of this run: resuming from it, not from --load {ckpt}" \
        in capfd.readouterr().out


@pytest.mark.slow
def test_lora_run_keeps_its_hyper_parameters_and_exports_peft(source, tmp_path):
    hf, chat, val = source
    save, out = str(tmp_path / "lora"), tmp_path / "out"
    run_distributed(_train, 1, ["--load", hf, "--preset", "tiny", "--data", chat, "--global-batch", "2", "--steps",
                                "3", "--save", save, "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2"])
    evaluate = lambda *extra: run_distributed(_train, 1, ["--eval-only", "--load", save, "--eval-data", val,  # noqa: E731
                                                          *extra])[0]
    (restored,), _ = evaluate()
    assert evaluate("--lora-rank", "4")[0] == evaluate("--lora-alpha", "8")[0] == [restored]
    assert evaluate("--lora-rank", "4", "--lora-alpha", "32") == (
        f"--load {save} resumes its run, whose value differs: --lora-alpha 32.0 (the checkpoint's: 8.0). Drop these "
        "flags (the checkpoint is the run), or start a new run")
    # the adapters alone, as PEFT loads them onto the HF weights the run started from: the merged export's logits
    hf_interop.main(["export-hf", "--load", save, "--out", str(out / "peft"), "--adapters-only"])
    hf_interop.main(["export-hf", "--load", save, "--out", str(out / "merged")])
    assert json.loads((out / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        os.path.realpath(hf)
    peft = pytest.importorskip("peft")
    cls, ids = transformers.NemotronH_Omni_Reasoning_V3, torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        base = cls.from_pretrained(hf, dtype=torch.float32).eval()
        before = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, out / "peft").eval()(input_ids=ids).logits
        merged = cls.from_pretrained(out / "merged", dtype=torch.float32).eval()(input_ids=ids).logits
    assert (adapted - merged).abs().max() < 1e-5 and (adapted - before).abs().max() > 1e-4
    # a run without adapters has none to export: one line
    plain = str(tmp_path / "plain")
    run_distributed(_train, 1, ["--load", hf, "--preset", "tiny", "--data", chat, "--global-batch", "2", "--steps",
                                "1", "--save", plain])
    with pytest.raises(SystemExit, match=r"^error: the checkpoint has no LoRA adapters \(--lora-rank 0\): export the "
                                         "full model with export-hf without --adapters-only$"):
        hf_interop.main(["export-hf", "--load", plain, "--out", str(out / "none"), "--adapters-only"])
