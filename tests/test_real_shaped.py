"""bench/real_shaped.py: a generated data set shaped like real SFT sets. The generator is deterministic and has
its mix (the small form written, the full form planned); on the small form under the tiny preset (seq_len 256,
packed, over-long documents truncated) one step in hetero, own-lanes, pipeline and context-parallel layouts equals
one process, on a step whose rows hold text-only, one-image, multi-image, multi-turn and truncated documents; three
unpacked steps train on one process.
"""
import collections
import filecmp
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import cli
import data
from tests.spawn import run_distributed
from tests.test_train import _train, assert_step_matches, run, warm_imports  # noqa: F401 (autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("real_shaped", os.path.join(ROOT, "bench", "real_shaped.py"))
rs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rs)

GB = 8
# --seed 59: the first step's eight packed rows (of the small form, data seed 0) hold every kind of document
STEP = ["--preset", "tiny", "--seq-len", "256", "--pack", "--overlong", "truncate", "--global-batch", str(GB),
        "--seed", "59", "--steps", "1", "--stage", "3", "--lr", "3e-4", "--lr-schedule", "constant"]


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    """The small form (64 records, seed 0), written once for the module: the path of its train.jsonl."""
    return rs.write(str(tmp_path_factory.mktemp("real_shaped")), seed=0, small=True, processes=1)


# ---------------------------------------------------------------- the generator

def _kind(record):
    """A record's kind from its content alone: text, photo, multi or doc (a page's size)."""
    images = [p for p in record["messages"][0]["content"] if isinstance(p, dict) and p["type"] == "image"] \
        if isinstance(record["messages"][0]["content"], list) else []
    return "text" if not images else "multi" if len(images) > 1 else "doc" if "doc" in record["id"] else "photo"


def _words(text):
    return len(text.split())


def _check_mix(records, sizes, prof, tolerance):
    """Kinds within `tolerance` of their shares, images of each kind in their ranges, word counts about their
    medians and within their clips, ~30 % multi-turn, ~5.5 bytes a word. sizes: {image path: (W, H)}."""
    n = len(records)
    kinds = collections.Counter(_kind(r) for r in records)
    for kind, share in zip(rs.KINDS, rs.SHARES):
        assert abs(kinds[kind] - share * n) <= tolerance * n, (kind, kinds)
    assert abs(sum(len(r["messages"]) > 2 for r in records) / n - rs.MULTI_TURN) <= 0.08
    pages = {(round(W * prof["doc_scale"]), round(H * prof["doc_scale"])) for W, H in rs.DOC_PAGES}
    lo, hi = prof["small_short"][0], prof["photo_short"][1]
    for r in records:
        turns = r["messages"]
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2) and 2 <= len(turns) <= 8
        assert all(isinstance(m["content"], str) for m in turns[1:])   # images only in the first user turn
        kind = _kind(r)
        shapes = [sizes[p["image"]] for p in turns[0]["content"] if p["type"] == "image"] if kind != "text" else []
        assert len(shapes) == {"text": 0, "photo": 1, "doc": 1}.get(kind, len(shapes)) and len(shapes) <= 4
        for W, H in shapes:
            if kind == "doc":
                assert (W, H) in pages, (W, H)
                continue
            short, ratio = min(W, H), W / H
            assert (prof["photo_short"][0] if kind == "photo" else lo) <= short <= hi, (kind, W, H)
            assert min(abs(ratio - a) for a in rs.ASPECTS) <= 1 / short, (W, H)    # rounded to whole pixels
    firsts = collections.defaultdict(list)
    for r in records:
        text = r["messages"][0]["content"]
        firsts[_kind(r)].append(_words(text if isinstance(text, str) else text[-1]["text"]))
    for kind, counts in firsts.items():   # log-normal medians, within sampling noise
        assert 0.6 * prof["prompt"][kind] <= np.median(counts) <= 1.5 * prof["prompt"][kind], (kind, counts)
    answers = [_words(r["messages"][1]["content"]) for r in records]
    assert 0.75 * prof["answer"] <= np.median(answers) <= 1.35 * prof["answer"] and max(answers) <= prof["max_answer"]
    texts = [m["content"] if isinstance(m["content"], str) else m["content"][-1]["text"]
             for r in records for m in r["messages"]]
    assert 5.0 <= sum(map(len, texts)) / sum(map(_words, texts)) <= 6.0      # bytes a word, spaces included
    assert all(0 < _words(t) <= prof["max_answer"] for t in texts)


def test_the_small_form_is_deterministic_and_has_the_mix(tmp_path):
    """The CLI (a pool of 2) and write() in this process (no pool) write the same bytes for the same seed; another
    seed writes other records; 200 records hold the mix, their JPEGs decode at the sizes the ranges allow."""
    a, b, c = (str(tmp_path / x) for x in "abc")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "real_shaped.py"), a, "--small", "--records",
                          "200", "--seed", "3", "--processes", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("records 200 (text 40, photo 100, multi 30, doc 30; ") and \
        out.stdout.strip().endswith(os.path.join(a, "train.jsonl"))
    path = rs.write(b, records=200, seed=3, small=True, processes=1)
    assert sorted(os.listdir(os.path.join(a, "images"))) == sorted(os.listdir(os.path.join(b, "images")))
    names = ["train.jsonl"] + [os.path.join("images", f) for f in os.listdir(os.path.join(a, "images"))]
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors and len(match) == len(names) > 200
    other = rs.write(c, records=200, seed=4, small=True, processes=1)
    assert open(other).read() != open(path).read()

    records = [json.loads(line) for line in open(path)]
    sizes = {}
    for name in names[1:]:
        with Image.open(os.path.join(b, name)) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            im.load()                                                        # decodes in full
            sizes[name] = im.size
    _check_mix(records, sizes, rs.SMALL, tolerance=0.05)


def test_the_full_form_has_the_mix():
    """The full form's 3000 records as planned (nothing written): the issue's mix, sizes and word counts."""
    records, jobs = rs.plan(3000, 0, False)
    sizes = {name: (W, H) for name, _, W, H, _ in jobs}
    assert collections.Counter(_kind(r) for r in records) == {"text": 600, "photo": 1500, "multi": 450, "doc": 450}
    _check_mix(records, sizes, rs.FULL, tolerance=0.0)
    answers = [_words(m["content"]) for r in records for m in r["messages"][1::2]]
    assert max(answers) > 1000    # the long tail reaches past a thousand words (clipped at 1500)
    shorts = [min(W, H) for (_, kind, W, H, _) in jobs if kind == "photo"]
    assert min(shorts) < 230 and max(shorts) == 1080


# ---------------------------------------------------------------- the small form in training

def _documents(sample, sp):
    """[(token ids, image shapes)] of each document of a row (packed rows: by seq_idx), padding left out."""
    n = len(sample.input_ids) - sample.n_pad
    ids, seq = sample.input_ids[:n].tolist(), sample.seq_idx[:n].tolist()
    images, out = iter(sample.images), []
    for d in sorted(set(seq)):
        tokens = [t for t, s in zip(ids, seq) if s == d]
        out.append((tokens, [tuple(next(images).shape) for _ in range(tokens.count(sp["<img>"]))]))
    return out


@pytest.fixture(scope="module")
def step(small_set):
    """STEP on the small form -> its argv, once its first step's samples (what every layout trains on) are checked
    to hold packed rows of two and three documents, text-only, one-image and multi-image documents (the latter of
    different grids), a row without images, a multi-turn chat and a truncated one; and the index to count truncated
    documents."""
    argv = STEP + ["--data", small_set]
    cfg = cli.config_of(argv)
    tok = data.load_tokenizer(None, cfg)
    ds, _ = data.build(cfg, tok, verbose=False)
    sp = tok.special
    assert int(ds.sources[0][2]["truncated"]) >= 3 and max(ds.sources[0][2]["lengths"]) == 256
    rows = [_documents(ds[i], sp) for i in range(GB)]
    docs = [d for row in rows for d in row]
    assert sum(len(row) >= 2 for row in rows) >= 4 and max(map(len, rows)) >= 3, [len(r) for r in rows]
    assert sum(not shapes for _, shapes in docs) >= 3                                   # text only
    assert any(all(not shapes for _, shapes in row) for row in rows)                    # a row of no image
    assert sum(len(shapes) == 1 for _, shapes in docs) >= 3                             # one image
    assert any(len(shapes) >= 2 and len(set(shapes)) >= 2 for _, shapes in docs)        # images of different grids
    assert any(ids.count(sp["<|im_start|>"]) >= 4 for ids, _ in docs)                  # two user turns or more
    assert any(ids[-2:] != [sp["<|im_end|>"], 10] for ids, _ in docs)                  # truncated mid-chat
    return argv


@pytest.fixture(scope="module")
def reference(step):
    return run(step, 1)[0]


LAYOUTS = {  # name: (world, grid flags)
    "hetero v-dp1 | lm-dp1": (2, ["--vision-dp", "1", "--lm-dp", "1"]),
    "hetero v-dp2 | lm-dp2": (4, ["--vision-dp", "2", "--lm-dp", "2"]),
    "colocated dp2 ep2": (2, ["--colocated", "--lm-ep", "2"]),
    "own lanes v-dp2 | lm-tp2": (2, ["--colocated", "--vision-tp", "1", "--vision-dp", "2", "--lm-tp", "2",
                                     "--lm-dp", "1", "--micro-batch", "2"]),
    "colocated pp2": (2, ["--colocated", "--vision-tp", "1", "--lm-pp", "2", "--micro-batch", "2"]),
    "hetero pp2": (3, ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"]),
    "colocated cp2": (2, ["--colocated", "--lm-cp", "2"]),
    "hetero cp2": (3, ["--vision-dp", "1", "--lm-dp", "1", "--lm-cp", "2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.slow
def test_one_step_on_the_small_form_matches_one_process(name, step, reference):
    world, flags = LAYOUTS[name]
    results = run_distributed(_train, world, step + flags, timeout=120.0)
    assert any(h[0]["loss"] is not None for h, _, _ in results)
    assert_step_matches(results, reference, name)


def test_three_unpacked_steps_train_on_one_process(small_set):
    argv = ["--preset", "tiny", "--seq-len", "256", "--overlong", "truncate", "--global-batch", str(GB), "--steps",
            "3", "--lr", "3e-3", "--lr-schedule", "constant", "--data", small_set]
    (hist, _, _), = run(argv, 1)
    losses = [h["loss"] for h in hist]
    assert len(hist) == 3 and all(h["ok"] for h in hist) and all(math.isfinite(x) for x in losses), hist
    assert losses[-1] < losses[0], losses
