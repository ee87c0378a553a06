"""--pack on CPU: packing.best_fit_decreasing against a plain reference and the optimum on random lengths; packed
rows a pure function of the index (two data sets, rows asked in any order); one pass holding every document once;
the fill on long-tailed lengths; the tower's bound on a source smaller than a window; a run resumed under another
packer is told."""
import hashlib
import json
import math
import os
import random
import types

import numpy as np
import pytest
import torch
from PIL import Image

import data
import memory
import packing
from tests.test_data import CFG, build, docs_file, write_jsonl


def reference(lengths, capacity):
    """Best-fit decreasing as textbooks write it: for each length, longest first, every open row that holds it,
    the fullest of them (the first opened on a tie), else a new row."""
    rows, used = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [r for r in range(len(rows)) if used[r] + lengths[i] <= capacity]
        if fits:
            r = min(fits, key=lambda r: (capacity - used[r], r))
            rows[r].append(i)
            used[r] += lengths[i]
        else:
            rows.append([i])
            used.append(lengths[i])
    return sorted((sorted(row) for row in rows), key=lambda row: row[0])


def fewest_rows(lengths, capacity):
    """The optimum by exhaustive search: each length, longest first, into every open row with room or a new one."""
    lengths, best = sorted(lengths, reverse=True), [len(lengths)]

    def place(i, used):
        if len(used) >= best[0]:
            return
        if i == len(lengths):
            best[0] = len(used)
            return
        for r in range(len(used)):
            if used[r] + lengths[i] <= capacity:
                place(i + 1, used[:r] + [used[r] + lengths[i]] + used[r + 1:])
        place(i + 1, used + [lengths[i]])

    place(0, [])
    return best[0]


def random_lengths(rng, n, capacity):
    """Uniform, small, near-capacity or long-tailed (log-normal) lengths in [1, capacity], with ties."""
    kind = rng.choice(["uniform", "small", "large", "tail"])
    draw = {"uniform": lambda: rng.randint(1, capacity), "small": lambda: rng.randint(1, max(1, capacity // 5)),
            "large": lambda: rng.randint(capacity // 3, capacity),
            "tail": lambda: min(capacity, max(1, round(rng.lognormvariate(math.log(capacity / 4), 0.8))))}[kind]
    return [draw() for _ in range(n)]


def test_best_fit_decreasing_against_a_reference_and_the_optimum():
    rng = random.Random(0)
    for trial in range(800):   # the first half small enough for the exhaustive optimum
        capacity = rng.choice([10, 96, 256, 8192])
        lengths = random_lengths(rng, rng.randint(0, 9 if trial < 400 else 90), capacity)
        rows = packing.best_fit_decreasing(lengths, capacity)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))          # each exactly once
        assert all(sum(lengths[i] for i in row) <= capacity for row in rows)
        assert all(row == sorted(row) for row in rows) and [row[0] for row in rows] == sorted(r[0] for r in rows)
        assert rows == reference(lengths, capacity), (capacity, lengths)
        assert len(rows) >= math.ceil(sum(lengths) / capacity)
        if len(lengths) <= 9:   # best-fit decreasing is within 11/9 OPT + 6/9 rows of the optimum (Dósa 2007)
            best = fewest_rows(lengths, capacity)
            assert best <= len(rows) <= 11 / 9 * best + 6 / 9, (lengths, capacity)
    assert packing.best_fit_decreasing([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert packing.best_fit_decreasing([3, 7, 2, 8], 10) == [[0, 1], [2, 3]]   # 8+2 and 7+3, as read in order


def lengths_file(tmp_path, lengths, name="t.jsonl"):
    """Pre-tokenized documents of the given token lengths, all trained."""
    return write_jsonl(tmp_path / name, [{"input_ids": [1 + i % 200] * n} for i, n in enumerate(lengths)])


def long_tailed(n, seq_len, seed=0):
    """Log-normal token lengths shaped like bench/real_shaped.py's at seq_len 8192 (median 0.29 seq_len, 90th
    percentile 0.62), at most seq_len."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(math.log(0.29 * seq_len), 0.6, n)), 2, seq_len).astype(int).tolist()


@pytest.mark.parametrize("window", [4, 64])
def test_rows_are_a_function_of_the_index_alone(tmp_path, monkeypatch, window):
    """Two data sets of one file and seed give the same rows, the one asked in order, the other shuffled, across
    epochs (with windows of 4, more of them than the windows' cache holds)."""
    monkeypatch.setattr(packing, "WINDOW", window)
    path = lengths_file(tmp_path, long_tailed(300, CFG.seq_len))
    a, b = build(path, pack=True)[0], build(path, pack=True)[0]
    n = 2 * len(a) + 7
    order = list(range(n))
    random.Random(1).shuffle(order)
    shuffled = {k: b.row(0, k) for k in order}
    assert [a.row(0, k) for k in range(n)] == [shuffled[k] for k in range(n)]
    for k in order[:12]:
        assert a.sizes(k) == b.sizes(k) and torch.equal(a[k].input_ids, b[k].input_ids)
        assert torch.equal(a[k].seq_idx, b[k].seq_idx)


@pytest.mark.parametrize("n", [150, 128, 5])
def test_one_pass_holds_every_document_once(tmp_path, n):
    """len: the rows of the first epoch's windows (150 documents: 64, 64 and 22; 128: two whole windows; 5: one),
    each document in one of them; the next rows pack the second epoch alike, and no row holds a document twice."""
    path = lengths_file(tmp_path, long_tailed(n, CFG.seq_len, seed=n))
    ds, _ = build(path, pack=True)
    first = [ds.row(0, k) for k in range(len(ds))]
    assert sorted(d for row in first for d in row) == list(range(n))
    windows = -(-n // packing.WINDOW)
    assert ds.rows_before(0, windows) == len(ds)
    second = [ds.row(0, k) for k in range(len(ds), ds.rows_before(0, 2 * windows))]
    assert sorted(d for row in second for d in row) == list(range(n))
    assert all(len(set(row)) == len(row) and ds.sizes(k)[0] <= CFG.seq_len
               for k, row in enumerate(first + second))


def test_long_tailed_lengths_fill_rows_to_95_percent(tmp_path):
    lengths = long_tailed(2000, CFG.seq_len)
    ds, _ = build(lengths_file(tmp_path, lengths), pack=True)
    fill = sum(lengths) / (len(ds) * CFG.seq_len)
    assert sum(ds.sizes(k)[0] for k in range(len(ds))) == sum(lengths)
    nextfit, used = 1, 0                              # what --pack did before: next-fit over the stream
    for d in range(len(lengths)):
        length = lengths[ds.doc(0, d)]
        nextfit, used = (nextfit, used + length) if used + length <= CFG.seq_len else (nextfit + 1, length)
    assert fill >= 0.95 and len(ds) < 0.9 * nextfit, (fill, len(ds), nextfit)


def test_the_tower_bound_holds_on_a_source_smaller_than_a_window(tmp_path):
    """Five documents (three with images) are one window an epoch: over many epochs no row holds a document twice,
    and every row's tower tokens and projector rows stay within memory.tower_load's bound."""
    os.makedirs(tmp_path / "img")
    for name, size in (("a.png", (64, 64)), ("b.png", (96, 48)), ("c.png", (32, 32))):
        Image.new("RGB", size, (200, 30, 30)).save(tmp_path / "img" / name)
    chats = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"img/{name}"},
                                                       {"type": "text", "text": "what?"}]},
                           {"role": "assistant", "content": "red"}]} for name in ("a.png", "b.png", "c.png")]
    path = write_jsonl(tmp_path / "tiny.jsonl", chats + [{"text": "a short one"}, {"text": "x" * 40}])
    ds, _ = build(path, pack=True)
    tower, rows, what = memory.tower_load(ds, ds.cfg)
    assert "packed" in what and len(ds.sources[0][2]["offsets"]) == 5
    for k in range(40 * len(ds)):
        docs = ds.row(0, k)
        assert len(set(docs)) == len(docs)
        _, patches = ds.sizes(k)
        assert sum(patches) + ds.cfg.class_token_len * len(patches) <= tower and sum(patches) // 4 <= rows


def test_a_run_resumed_under_another_packer_is_told(tmp_path, monkeypatch, capsys):
    """The data's fingerprint names the packer and its window: a checkpoint of next-fit rows (its fingerprint as
    61c227c computed it) or of another window resumes with the 'different data' line; the same packer silently."""
    path = docs_file(tmp_path)
    ds, _ = build(path, pack=True)
    idx = ds.sources[0][2]
    nextfit = hashlib.sha256(json.dumps(["train", 7, True, ds.enc.fingerprint, [
        (1.0, os.path.abspath(path), int(idx["offsets"].sum()), len(idx["offsets"]))]]).encode()).hexdigest()[:16]
    monkeypatch.setattr(packing, "WINDOW", 32)
    other, _ = build(path, pack=True)
    same, windows = data.Loader(ds, [0], 1).state_dict(), data.Loader(other, [0], 1).state_dict()
    for state, told in ((same, False), ({"next_sample": 4, "fingerprint": nextfit}, True), (windows, True)):
        data.Loader(ds, [0], 1).load_state_dict(state)
        assert ("data: resuming on different data" in capsys.readouterr().out) == told
    assert len({ds.fingerprint, other.fingerprint, build(path)[0].fingerprint}) == 3


def test_blends_pack_each_source_apart(tmp_path):
    """A blend packs each source's stream apart (source 0's rows are its rows alone); len sums one pass of each."""
    a, b = lengths_file(tmp_path, long_tailed(90, CFG.seq_len), "a.jsonl"), \
        lengths_file(tmp_path, long_tailed(40, CFG.seq_len, 1), "b.jsonl")
    ds, alone = build(f"2:{a},1:{b}", pack=True)[0], build(a, pack=True)[0]
    assert [ds.row(0, k) for k in range(len(alone))] == [alone.row(0, k) for k in range(len(alone))]
    assert sorted(d for k in range(len(ds) - len(alone)) for d in ds.row(1, k)) == list(range(40))


@pytest.mark.parametrize("pack", [False, True])
def test_a_blend_of_many_shards_orders_each_once_an_epoch(monkeypatch, pack):
    """A blend draws from its 12 shards in turn: each shard's permutation is drawn once for its epoch (a cache of a
    few entries shared by all shards drew one at nearly every sample: 7 ms a sample at 16 shards of 200k documents)."""
    rng, n = np.random.default_rng(0), 500
    idx = [{"offsets": np.zeros(n, np.int64), "lengths": rng.integers(2, CFG.seq_len // 3, n),
            "images": np.zeros(n, np.int64), "image_tokens": np.zeros(n, np.int64)} for _ in range(12)]
    enc = types.SimpleNamespace(fingerprint="f", cfg=CFG)
    ds = data.RealData([(1.0, f"shard{s}.jsonl", x) for s, x in enumerate(idx)], enc, 7, pack)
    drawn, randperm = [], torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: drawn.append(a[0]) or randperm(*a, **k))
    for i in range(12 * 60):   # within every shard's first epoch
        ds.sizes(i)
    assert drawn == [n] * 12
