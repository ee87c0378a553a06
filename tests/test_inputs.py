"""Every input checked where the config and the data resolve (issue 40): each bad input found by fault injection
ends the run with one line naming the input and the fix, every offender at once, before anything trains: model
sizes out of range or not dividing (every preset passes), unreadable data files, a --tokenizer that is none, a
--metrics-file that cannot be written, --lora-targets that cannot work, over-long documents counted."""
import json
import os

import pytest
import torch

import config
import data
import logs
import lora
import memory
import model
import train
from tests.spawn import run_distributed

TINY = ["--preset", "tiny", "--steps", "1", "--global-batch", "2"]


def one_line(excinfo):
    msg = excinfo.value.code if isinstance(excinfo.value, SystemExit) else str(excinfo.value)
    assert isinstance(msg, str) and "\n" not in msg and "Traceback" not in msg, msg
    return msg


# ---------------------------------------------------------------- the model's sizes (config.check)

@pytest.mark.parametrize("preset", sorted(config.PRESETS))
def test_every_preset_and_vision_variant_passes_check(preset):
    for variant in config.VIT_VARIANTS:
        config.check(config.resolve(preset, {"vision": variant}))


@pytest.mark.parametrize("overrides, want", [
    # the fault injection's four: two crashed (ZeroDivisionError, a reshape), two trained a degenerate model
    ({"num_key_value_heads": 0}, ["--num-key-value-heads 0: must be a finite number >= 1"]),
    ({"hidden_size": 0}, ["--hidden-size 0: must be a finite number >= 1"]),
    ({"num_attention_heads": 0}, ["--num-attention-heads 0: must be a finite number >= 1"]),
    ({"head_dim": 0}, ["--head-dim 0: must be a finite number >= 1"]),
    ({"n_groups": 0, "chunk_size": 0, "ssm_state_size": -1},
     ["--n-groups 0: must be", "--chunk-size 0: must be", "--ssm-state-size -1: must be"]),
    ({"n_groups": 3}, ["mamba_num_heads must be a multiple of n_groups (8 and 3: --n-groups 2 or 4 would do)"]),
    ({"num_key_value_heads": 3}, ["num_attention_heads must be a multiple of num_key_value_heads (4 and 3: "
                                  "--num-key-value-heads 2 or 4 would do)"]),
    ({"num_experts_per_tok": 0}, ["--num-experts-per-tok 0: must be a finite number >= 1"]),
    ({"num_experts_per_tok": 9}, ["--num-experts-per-tok 9: must be at most n_routed_experts 8"]),
    ({"n_routed_experts": 0, "moe_intermediate_size": 0, "moe_shared_expert_intermediate_size": 0},
     ["--n-routed-experts 0: must be", "--moe-intermediate-size 0: must be",
      "--moe-shared-expert-intermediate-size 0: must be"]),
    ({"intermediate_size": 0, "conv_kernel": 0, "mamba_head_dim": 0, "mamba_num_heads": 0},
     ["--intermediate-size 0", "--conv-kernel 0", "--mamba-head-dim 0", "--mamba-num-heads 0"]),
    ({"vit_patch": 0, "vit_hidden": 0, "vit_depth": 0, "vit_mlp": 0, "vit_cpe_grid": 0, "projector_hidden": 0},
     ["--vit-patch 0", "--vit-hidden 0", "--vit-depth 0", "--vit-mlp 0", "--vit-cpe-grid 0", "--projector-hidden 0"]),
    ({"vit_heads": 0}, ["--vit-heads 0: must be a finite number >= 1"]),
    ({"vit_heads": 3}, ["vit_hidden must be a multiple of vit_heads (32 and 3: --vit-heads 2 or 4 would do)"]),
    ({"max_num_patches": 8}, ["--max-num-patches 8: must be 0 (no maximum) or at least --min-num-patches 16"]),
    ({"class_token_len": -1, "mock_image_size": 0}, ["--class-token-len -1: must be a finite number >= 0",
                                                     "--mock-image-size 0: must be a finite number >= 1"]),
    ({"norm_eps": 0, "init_std": -1, "routed_scaling_factor": "nan"},
     ["--norm-eps 0.0: must be a finite number > 0", "--init-std -1.0: must be a finite number > 0",
      "--routed-scaling-factor nan: must be a finite number > 0"]),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_model_sizes_out_of_range_or_not_dividing(overrides, want):
    with pytest.raises(SystemExit) as e:
        config.resolve("tiny", {k: str(v) for k, v in overrides.items()})
    msg = one_line(e)
    assert all(w in msg for w in want), msg
    assert msg.count(";") == len(want) - 1, msg                        # each offender once, nothing else


def test_sizes_of_layers_the_model_has_not_are_not_checked():
    """A model without attention layers (an HF Mamba-MoE, say) may leave the attention sizes at 0."""
    cfg = config.resolve("tiny", {"hybrid_override_pattern": "MEM-", "num_attention_heads": "0",
                                  "num_key_value_heads": "0", "head_dim": "0"})
    assert cfg.num_attention_heads == 0
    with pytest.raises(SystemExit, match="--head-dim 0"):             # an MTP block of attention needs them
        config.resolve("tiny", {"hybrid_override_pattern": "MEM-", "head_dim": "0", "num_nextn_predict_layers": "1",
                                "mtp_pattern": "*E"})


def test_every_offender_in_one_line_from_the_command_line():
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--num-attention-heads", "0", "--head-dim", "0", "--num-key-value-heads", "0",
                           "--hidden-size", "0"])
    msg = one_line(e)
    assert all(f"--{f} 0: must be a finite number >= 1" in msg for f in ("hidden-size", "num-attention-heads",
                                                                         "num-key-value-heads", "head-dim")), msg


# ---------------------------------------------------------------- data files that cannot be read

def _build(path, **kw):
    cfg = config.resolve("tiny", {"data": path, **kw})
    return data.build(cfg, data.load_tokenizer(None, cfg))


def test_unreadable_data_files_are_one_line(tmp_path):
    good = tmp_path / "d" / "a.jsonl"
    good.parent.mkdir()
    good.write_text(json.dumps({"text": "hello"}) + "\n")
    fix = "Fix or remove the file, or leave it out of --data / --eval-data"
    (tmp_path / "d" / "b.jsonl").mkdir()                                # a directory among the files
    with pytest.raises(SystemExit) as e:
        _build(str(tmp_path / "d"))
    assert one_line(e) == f"{tmp_path / 'd' / 'b.jsonl'}: cannot read (Is a directory). {fix}"
    os.rmdir(tmp_path / "d" / "b.jsonl")
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "d" / "c.jsonl")     # a file that is not there
    with pytest.raises(SystemExit) as e:
        _build(str(tmp_path / "d"))
    assert one_line(e) == f"{tmp_path / 'd' / 'c.jsonl'}: cannot read (No such file or directory). {fix}"
    corrupt = tmp_path / "x.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet" * 8)
    with pytest.raises(SystemExit) as e:
        _build(str(corrupt))
    msg = one_line(e)
    assert msg.startswith(f"{corrupt}: cannot read (") and "arquet" in msg and msg.endswith(f"). {fix}"), msg


def test_data_file_gone_after_indexing_is_a_bad_sample(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    ds, _ = _build(str(path))
    path.unlink()
    with pytest.raises(data.BadSample) as e:
        ds.sample(0)
    assert one_line(e).startswith(f"{path}:") and "cannot read the file (No such file or directory)" in str(e.value)


# ---------------------------------------------------------------- over-long documents: counted

def test_overlong_documents_are_counted_with_the_longest(tmp_path):
    path = tmp_path / "o.jsonl"
    lines = [{"text": "ok"}, {"text": "x" * 150}, {"text": "ok"}, {"text": "y" * 300}, {"text": "z" * 120}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(SystemExit) as e:
        _build(str(path))
    assert one_line(e) == (f"{path}: 3 documents are longer than seq_len 96 (the longest, line 4, 302 tokens; first "
                           "at line 2). Raise --seq-len, or pass --overlong truncate|skip")
    path.write_text("".join(json.dumps(x) + "\n" for x in lines[2:]))
    with pytest.raises(SystemExit) as e:
        _build(str(path))
    assert one_line(e) == (f"{path}: 2 documents are longer than seq_len 96 (the first and longest, line 2, 302 "
                           "tokens). Raise --seq-len, or pass --overlong truncate|skip")
    path.write_text("".join(json.dumps(x) + "\n" for x in lines[:3]))
    with pytest.raises(SystemExit) as e:
        _build(str(path))
    assert one_line(e) == (f"{path}:2: a document of 152 tokens is longer than seq_len 96. Raise --seq-len, or pass "
                           "--overlong truncate|skip")


# ---------------------------------------------------------------- --tokenizer

def test_a_tokenizer_that_is_none_is_one_line(tmp_path):
    cfg = config.resolve("tiny")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "tokenizer.json").write_text("{}")
    fix = "Give an HF tokenizer directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json file"
    for path, why in ((tmp_path / "empty", "no tokenizer files in it"),
                      (tmp_path / "notes.txt", "expected value at line 1 column 1"),
                      (tmp_path / "tokenizer.json", "Model missing. at line 1 column 2")):
        with pytest.raises(SystemExit) as e:
            data.load_tokenizer(str(path), cfg)
        assert one_line(e) == f"--tokenizer {path}: not a tokenizer ({why}). {fix}"


# ---------------------------------------------------------------- --metrics-file

def test_a_metrics_file_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    for path, why in ((tmp_path, "Is a directory"), (tmp_path / "missing" / "m.jsonl", "No such file or directory"),
                      (tmp_path / "file" / "m.jsonl", "Not a directory")):
        cfg = config.resolve("tiny", {"metrics_file": str(path)})
        with pytest.raises(SystemExit) as e:
            logs.Log(cfg, True, 0)
        assert one_line(e) == (f"--metrics-file {path}: cannot write ({why}). Name a file in an existing, writable "
                               "directory")
    cfg = config.resolve("tiny", {"metrics_file": str(tmp_path / "m.jsonl")})
    logs.Log(cfg, True, 0).close(0, None)                              # a writable one opens


def _exit_message(rank, world, argv):
    with pytest.raises(SystemExit) as e:
        train.main(list(argv))
    return e.value.code


def test_a_metrics_file_that_cannot_be_written_stops_every_rank_before_training(tmp_path):
    """Two ranks (colocated dp2), rank 0 logs: both end with the line, neither trains or waits for the other."""
    argv = TINY + ["--colocated", "--lm-dp", "2", "--metrics-file", str(tmp_path)]
    msg = f"--metrics-file {tmp_path}: cannot write (Is a directory). Name a file in an existing, writable directory"
    assert run_distributed(_exit_message, 2, argv, timeout=60.0) == [msg, msg]


# ---------------------------------------------------------------- --lora-targets

def test_lora_targets_that_cannot_work_are_one_line():
    with pytest.raises(SystemExit) as e:
        config.resolve("tiny", {"lora_rank": "4", "lora_targets": "(q_proj"})
    assert one_line(e) == ("--lora-targets '(q_proj': not a regular expression (missing ), unterminated subpattern at "
                           "position 0)")
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--lora-rank", "4", "--lora-targets", "qkv_proj$"])
    assert one_line(e) == (
        "--lora-targets 'qkv_proj$' matches no layer, so no adapter would train. The layers: vision.embedder, "
        "vision.blocks.N.attn.{qkv,proj}, vision.blocks.N.mlp.{fc1,fc2}, vision.mlp1.{1,3}, "
        "language.backbone.layers.N.mixer.{in_proj,out_proj,q_proj,k_proj,v_proj,o_proj,up_proj,down_proj}, "
        "language.backbone.layers.N.mixer.experts.up_proj, language.backbone.layers.N.mixer.shared_experts.{up_proj,"
        "down_proj}, language.lm_head")
    cfg = config.resolve("tiny", {"lora_rank": "4", "lora_targets": r"vision\.mlp1\.1$"})
    with torch.device("meta"):   # a pattern that matches only the tower: a hetero language rank adapts nothing
        lm = model.LanguageModel(cfg)
    lora.apply({"language": lm}, cfg)
    assert not any(p.requires_grad for p in lm.parameters())
    assert any(p.requires_grad for m in memory.sizing_model(cfg).values() for p in m.parameters())


@pytest.mark.parametrize("argv, want", [
    (["--dry-run", "--world-size", "0"], "--world-size 0: must be 1 to 1024, the largest world the layout chooser plans"),
    (["--dry-run", "--world-size", "1000003"], "--world-size 1000003: must be 1 to 1024"),
    (["--world-size", "8"], "--world-size 8 plans a dry run: add --dry-run"),
    (["--dry-run", "--gpu-memory", "0"], "--gpu-memory 0.0: must be a finite number of GiB > 0"),
    (["--dry-run", "--gpu-memory", "-5"], "--gpu-memory -5.0: must be a finite number of GiB > 0"),
    (["--dry-run", "--gpu-memory", "nan"], "--gpu-memory nan: must be a finite number of GiB > 0"),
    (["--collective-timeout", "1e15"], "--collective-timeout 1000000000000000.0: must be at most 604800 s (a week)"),
], ids=["world-0", "world-huge", "world-no-dry-run", "memory-0", "memory-negative", "memory-nan", "timeout-huge"])
def test_the_dry_run_s_flags_and_the_timeout_out_of_range_are_one_line(argv, want):
    """Planning flags that plan nothing are refused at once (they planned for 1 rank, divided by 0, printed 'fits nan
    GiB' or searched for minutes); a timeout that overflows torch's own is refused, not a traceback."""
    import train
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny"] + argv)
    assert one_line(e).startswith(want), one_line(e)
