"""Context parallelism (cp.py, docs/cp.md) on gloo: the zigzag split by hand; the language model at cp 2 / 4 (with tp 2)
== one device, losses and gradients, packed documents and padding; a training step on real packed data whose images
straddle the shards' boundaries == one process, hetero and colocated, with tp 2, ep 2, etp 2, LoRA and activation
checkpointing; resume from cp 2 into cp 1 and cp 4.
"""
import contextlib
import io
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from PIL import Image

import cli
import comm
import config
import cp
import data
import model
import parallel
import train
from layout import Layout
from tests.spawn import run_distributed
from tests.test_train import assert_step_matches, run

GROUPS4 = ["--n-groups", "4"]   # tiny has 2 Mamba groups; cp 4 (and tp 2 x cp 2) scans 1 / 4 of them a rank


def test_zigzag_split_by_hand():
    """16 positions, cp 2: chunks of 4, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    assert cp.spans(16, 0, 2) == [(0, 4), (12, 16)] and cp.spans(16, 1, 2) == [(4, 8), (8, 12)]
    assert cp.local(torch.arange(16), 1, 4, 0).tolist() == [2, 3, 12, 13]
    assert cp.spans(16, 0, 1) == [(0, 16)]
    x = torch.arange(32).view(2, 16)
    parts = [cp.local(x, r, 4) for r in range(4)]
    assert parts[0][0].tolist() == [0, 1, 14, 15] and parts[3][1].tolist() == [22, 23, 24, 25]
    assert torch.equal(cp.natural(parts, 1), x) and all(torch.equal(a, b) for a, b in zip(cp.zigzag(x, 4, 1), parts))


# ---------------------------------------------------------------- the language model alone

def _lm_grads(rank, world, tp, size):
    """One forward / backward of two packed, padded rows: the whole rows on one device, and this rank's positions
    on a tp x cp grid. -> (loss of one device, sum of the cp ranks' losses, worst relative gradient error)."""
    cfg = config.resolve("tiny", {"n_groups": "4"})
    par = parallel.setup(Layout(world=world, colocated=True, vision_tp=tp, vision_dp=1, lm_tp=tp, lm_dp=1,
                                lm_cp=size))
    m = par.lm
    g = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, 500, (2, 96), generator=g), torch.randint(0, 500, (2, 96), generator=g)
    seq_idx = torch.tensor([[0] * 30 + [1] * 40 + [2] * 26, [0] * 96])     # documents cross every shard boundary
    valid = torch.ones(2, 96, dtype=torch.bool)
    valid[1, 80:] = False                                                   # padding: neither counted nor balanced
    labels[~valid] = -100
    one = model.LanguageModel(cfg)
    model.init_weights(one, 1, {}, cfg)
    loss, _ = one.loss_sum(one(one.embed(ids), seq_idx, valid), labels)
    loss.backward()
    lm = model.LanguageModel(cfg, {"tp": m.tp, "cp": m.cp})
    model.init_weights(lm, 1, {"tp": (m.tp_rank, m.tp_size)}, cfg)
    at = (m.cp_rank, m.cp_size)
    part, _ = lm.loss_sum(lm(lm.embed(cp.local(ids, *at)), seq_idx, cp.local(valid, *at)), cp.local(labels, *at))
    part.backward()
    total = part.detach().clone()
    dist.all_reduce(total, group=m.cp)
    ref, worst = dict(one.named_parameters()), 0.0
    for name, p in lm.named_parameters():
        grad = p.grad.clone()   # each cp rank's share; routed experts (tp ranks route distinct tokens) over tp too
        dist.all_reduce(grad, group=m.tp_dp_cp if comm.is_expert(p) else m.cp)
        want = comm.take_shard(ref[name].grad, [s for s in getattr(p, "shards", ()) if s[0] == "tp"],
                               {"tp": m.tp_rank}, {"tp": m.tp_size})
        worst = max(worst, ((grad - want).abs().max() / want.abs().max()).item())
    return loss.item(), total.item(), worst


@pytest.mark.parametrize("tp,size", [(1, 2), (1, 4), (2, 2)], ids=["cp2", "cp4", "tp2-cp2"])
def test_language_model_matches_one_device(tp, size):
    for one, total, worst in run_distributed(_lm_grads, tp * size, tp, size):
        assert abs(total - one) <= 1e-5 * one and worst < 1e-5, (one, total, worst)


def test_attention_chunks_equal_a_full_mask():
    """attend() on a rank's two chunks (keys up to each chunk's end, lower-right causal) == the rows of full causal
    attention at those positions; a negative control: top-left causal (is_causal) on the second chunk is not."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 16, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g), \
        torch.randn(1, 2, 16, 8, generator=g)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    pos = cp.local(torch.arange(16), 1, 2, 0)
    got = model.attend(q[:, :, pos], k, v, cp.spans(16, 1, 2))
    assert (got - full[:, :, pos]).abs().max() < 1e-6
    wrong = torch.nn.functional.scaled_dot_product_attention(q[:, :, 8:12], k[:, :, :12], v[:, :, :12],
                                                             is_causal=True, enable_gqa=True)
    assert (wrong - full[:, :, 8:12]).abs().max() > 1e-2


@pytest.mark.slow
def test_document_flex_mask_equals_the_boolean_mask(monkeypatch):
    """The CUDA path's FlexAttention mask (run here eagerly, uncompiled) == the CPU path's boolean mask on packed
    rows, for a rank's two zigzag chunks whose documents cross the chunk boundaries; keys of another document and of
    the future read nothing. A negative control: the mask without the chunk's offset differs."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    monkeypatch.setitem(model._FLEX, "attn", flex_attention)
    monkeypatch.setitem(model._FLEX, "mask", create_block_mask)
    monkeypatch.setitem(model._FLEX, "key", None)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 256, 16, generator=g) for h in (4, 2, 2))
    seq_idx = torch.tensor([[0] * 70 + [1] * 130 + [2] * 56, [0] * 256])
    for rank in (0, 1):
        spans, pos = cp.spans(256, rank, 2), cp.local(torch.arange(256), rank, 2, 0)
        want = model.attend(q[:, :, pos], k, v, spans, seq_idx)
        got = torch.cat([model._document_flex(q[:, :, a:b], k[:, :, :b], v[:, :, :b], seq_idx, a)
                         for a, b in spans], 2)
        assert (got - want).abs().max() < 1e-5
        if rank == 0:   # its second chunk is positions 192 .. 256
            wrong = model._document_flex(q[:, :, 192:], k, v, seq_idx, 0)
            assert (wrong - want[:, :, 64:]).abs().max() > 1e-2


# ---------------------------------------------------------------- a training step on real packed data

def packed_data(root):
    """Chat documents with images (one of 24 placeholder tokens) and text documents, packed into rows of 96. The
    first step's rows: [image 7-30 crossing positions 12 and 24 and a text, text only, two images 10-65, a small
    image 7-16], each with padding, 1-2 documents a row."""
    os.makedirs(root / "img", exist_ok=True)
    for i, (w, h) in enumerate([(192, 128), (96, 64), (64, 64), (160, 64)]):
        Image.new("RGB", (w, h), (40 * i, 200 - 30 * i, 90)).save(root / "img" / f"{i}.png")
    lines = []
    for i in range(8):
        if i % 2 == 0:
            lines.append({"messages": [
                {"role": "user", "content": [{"type": "text", "text": "see" * (i % 3)},
                                             {"type": "image", "image": f"img/{i // 2}.png"},
                                             {"type": "text", "text": f"q{i}"}]},
                {"role": "assistant", "content": "ans" + "x" * (3 * i)}]})
        else:
            lines.append({"text": f"doc{i} " + "lorem ipsum " * i})
    path = root / "cp.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.fixture(scope="module")
def step_data(tmp_path_factory):
    path = packed_data(tmp_path_factory.mktemp("cp"))
    argv = ["--preset", "tiny", "--data", path, "--pack", "--steps", "1", "--global-batch", "4", "--stage", "3",
            "--lr", "3e-4", "--lr-schedule", "constant"] + GROUPS4
    cfg = cli.config_of(argv)
    ds, _ = data.build(cfg, data.ByteTokenizer(cfg.vocab_size, cfg.image_token_id), False)
    rows = [ds[i] for i in range(4)]
    images = [(s.input_ids == cfg.image_token_id).nonzero().squeeze(1).tolist() for s in rows]
    assert images[0] == list(range(7, 31)) and images[1] == []                 # straddles 12 (cp 4) and 24 (cp 2)
    assert all(s.seq_idx is not None and s.seq_idx.max() >= 1 and s.n_pad > 0 for s in rows)
    return argv


LAYOUTS = {  # name: (world, grid flags)
    "hetero v-dp1 + lm-cp2": (3, ["--vision-dp", "1", "--lm-dp", "1", "--lm-cp", "2"]),
    "hetero v-dp2 + lm-tp2-cp2": (6, ["--vision-dp", "2", "--lm-dp", "1", "--lm-tp", "2", "--lm-cp", "2",
                                      "--micro-batch", "2"]),
    "colocated cp4": (4, ["--colocated", "--lm-cp", "4"]),
    "colocated cp2 tp2": (4, ["--colocated", "--lm-cp", "2", "--lm-tp", "2"]),
    "colocated cp2 dp2 ep2": (4, ["--colocated", "--lm-cp", "2", "--lm-ep", "2"]),
    "colocated cp2 dp2 ep2 etp2": (4, ["--colocated", "--lm-cp", "2", "--lm-ep", "2", "--lm-etp", "2"]),
}


@pytest.fixture(scope="module")
def reference(step_data):
    return run(step_data, 1)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.slow
def test_training_step_matches_one_process(name, step_data, reference):
    world, flags = LAYOUTS[name]
    assert_step_matches(run(step_data + flags, world), reference, name)


@pytest.mark.slow
def test_lora_with_activation_checkpointing_matches_one_process(step_data):
    argv = step_data + ["--lora-rank", "4", "--activation-checkpointing"]
    assert_step_matches(run(argv + ["--colocated", "--lm-cp", "2"], 2), run(argv, 1)[0], "LoRA cp2")


def _step_lines(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(list(argv))
    return sum(line.startswith("step ") for line in out.getvalue().splitlines())


def test_one_rank_prints_the_step_lines(step_data):
    """The cp ranks of a lane all know the loss; only cp rank 0 prints it (both did: every line came twice)."""
    assert run_distributed(_step_lines, 2, step_data + ["--colocated", "--lm-cp", "2", "--steps", "2"]) == [2, 0]


# ---------------------------------------------------------------- resume across cp sizes

def _losses_and_weights(rank, world, argv):
    history, modules = train.main(list(argv))
    return [h["loss"] for h in history], {f"{k}.{n}": p.detach().clone() for k, m in modules.items()
                                          for n, p in m.named_parameters()}


@pytest.mark.slow
def test_resume_from_cp2_into_cp1_and_cp4(step_data, tmp_path):
    """Two steps at cp 2, saved, then steps 3-4 at cp 1 (one process) and at cp 4: the losses and weights of the
    straight four-step cp 2 run, to fp32 rounding (the layouts sum in different orders)."""
    argv = step_data + ["--global-batch", "2"]   # the later flag wins
    cp2 = ["--colocated", "--lm-cp", "2"]
    straight = run_distributed(_losses_and_weights, 2, argv + cp2 + ["--steps", "4"])
    save = str(tmp_path / "run")
    run_distributed(_losses_and_weights, 2, argv + cp2 + ["--steps", "2", "--save", save])
    assert json.load(open(os.path.join(save, "step_00000002", "meta.json")))["layout"]["lm_cp"] == 2
    for world, flags in ((1, []), (4, ["--colocated", "--lm-cp", "4"])):
        run_dir = shutil.copytree(save, str(tmp_path / f"run{world}"))   # a resumed run saves into its run
        resumed = run_distributed(_losses_and_weights, world, argv + flags + ["--steps", "4", "--load", run_dir])
        for losses, weights in resumed:
            assert len(losses) == 2 and all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, straight[0][0][2:]))
            for k, w in weights.items():
                assert (w - straight[0][1][k]).abs().max() <= 1e-5, (world, k)
