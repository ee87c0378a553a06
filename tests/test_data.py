"""data.py on CPU: exact ids / labels / loss masks of chat, text and pre-tokenized JSONL lines, images, packing
(boundaries reach the model), blends, held-out split, every bad-input case, the index cache, resume and workers."""
import dataclasses
import itertools
import json
import os

import pytest
import torch
from PIL import Image

import config
import data
import formats
import model
import radio

CFG = config.resolve("tiny")                          # vocab 512, image_token_id 511, seq_len 96, patch 16
TOK = data.ByteTokenizer(CFG.vocab_size, CFG.image_token_id)
SP = TOK.special
IMG, PAD = CFG.image_token_id, SP["<pad>"]


def b(text):
    return list(text.encode())


def write_jsonl(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def build(path, cfg=CFG, verbose=True, **kw):
    """data.build of `path` with the run fields kw (seed 7), the tokenizer kw's (default: bytes)."""
    cfg = dataclasses.replace(cfg, **{"data": path, "seed": 7, **kw})
    return data.build(cfg, data.load_tokenizer(cfg.tokenizer, cfg), verbose)


def decode(ids):
    """Byte-tokenizer ids -> text: runs of bytes as UTF-8, a special as its name, any other id as <id>."""
    names, out = {v: k for k, v in SP.items()}, []
    for is_byte, run in itertools.groupby(ids, lambda i: i < 256):
        out += [bytes(run).decode("utf-8", errors="replace")] if is_byte else [names.get(i, f"<{i}>") for i in run]
    return "".join(out)


def text_of(sample):
    """Decoded non-padding tokens of an unpacked sample."""
    n = int((sample.input_ids != PAD).sum())
    return decode(sample.input_ids[:n].tolist())


def labels_from(ids, targets):
    """labels[t] = ids[t+1] where token t+1 is a target (and not an image id), else -100."""
    return [ids[t + 1] if t + 1 in targets and ids[t + 1] != IMG else -100 for t in range(len(ids) - 1)] + [-100]


def padded(values, fill):
    return values + [fill] * (CFG.seq_len - len(values))


@pytest.fixture
def chat_file(tmp_path):
    os.makedirs(tmp_path / "img")
    Image.new("RGB", (64, 48), (255, 0, 0)).save(tmp_path / "img" / "red.png")   # 48 x 64 px -> 4 x 4 patches
    return write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": "img/red.png"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "Red."}]}])


def chat_expected():
    head = [SP["<|im_start|>"]] + b("system\nBe brief.") + [SP["<|im_end|>"]] + b("\n") + \
        [SP["<|im_start|>"]] + b("user\n") + [SP["<img>"]] + [IMG] * 4 + [SP["</img>"]] + b("What?") + \
        [SP["<|im_end|>"]] + b("\n") + [SP["<|im_start|>"]] + b("assistant\n")
    ids = head + b("Red.") + [SP["<|im_end|>"]] + b("\n")
    return ids, set(range(len(head), len(head) + 5))   # "Red." and <|im_end|> are the targets


def test_byte_tokenizer_reserves_specials_at_the_top():
    assert SP == {"<pad>": 510, "<s>": 509, "</s>": 508, "<|im_start|>": 507, "<|im_end|>": 506, "<img>": 505,
                  "</img>": 504, "<image>": 511}
    assert TOK.encode("hé") == [104, 195, 169]
    with pytest.raises(SystemExit):
        data.ByteTokenizer(512, 200)                   # the image id may not be a byte


def test_chat_line_exact(chat_file):
    ds, _ = build(chat_file)
    s = ds[0]
    ids, targets = chat_expected()
    assert s.input_ids.tolist() == padded(ids, PAD)
    assert s.labels.tolist() == padded(labels_from(ids, targets), -100)
    assert s.seq_idx is None
    (img,) = s.images                                  # 48 x 64 px -> grid 4 x 4 (docs/vision.md §8 rounding) -> 64 x 64
    assert img.shape == (3, 64, 64)
    red = radio.normalize(torch.tensor([255, 0, 0], dtype=torch.uint8)[:, None, None])
    assert torch.allclose(img, red.expand(3, 64, 64), atol=1e-4)
    patches, grids, rows, _ = data.collate_images([s], CFG)
    assert grids == [(4, 4)] and rows == [4] == [int((s.input_ids == IMG).sum())] and patches.shape == (16, 768)
    # vlm.encode moves each image before cutting it (to the GPU): the same patch rows, only the cut runs elsewhere
    moved, *rest = data.collate_images([s], CFG, lambda img: img.to(torch.float64))
    assert moved.dtype == torch.float64 and torch.equal(moved, patches.double()) and rest == [grids, rows, [1]]


def test_chat_train_on_all(chat_file):
    ds, _ = build(chat_file, train_on="all")
    ids, _ = chat_expected()
    assert ds[0].labels.tolist() == padded(labels_from(ids, set(range(len(ids)))), -100)


def test_text_and_pretokenized_lines(tmp_path):
    ds, _ = build(write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}]))
    ids = [SP["<s>"]] + b("hello") + [SP["</s>"]]
    assert ds[0].input_ids.tolist() == padded(ids, PAD)
    assert ds[0].labels.tolist() == padded(b("hello") + [SP["</s>"], -100], -100)
    ds, _ = build(write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
                                                     {"input_ids": [9, 10]}]))
    by_first = {int(ds[i].input_ids[0]): ds[i] for i in range(2)}
    assert by_first[5].input_ids.tolist() == padded([5, 6, 7, 8], PAD)
    assert by_first[5].labels.tolist() == padded([-100, 7, 8, -100], -100)
    assert by_first[9].labels.tolist() == padded([10, -100], -100)


def test_webp_and_palette_images_are_rgb(tmp_path):
    Image.new("P", (40, 200)).save(tmp_path / "p.png")
    Image.new("RGBA", (300, 20), (0, 0, 255, 128)).save(tmp_path / "w.webp")
    path = write_jsonl(tmp_path / "i.jsonl", [{"messages": [
        {"role": "user", "content": [{"type": "image", "image": str(tmp_path / "p.png")},
                                     {"type": "image", "image": "w.webp"}]},
        {"role": "assistant", "content": "two"}]}])
    s = build(path)[0][0]
    assert [im.shape[0] for im in s.images] == [3, 3]
    _, grids, rows, _ = data.collate_images([s], CFG)
    assert all(h % 2 == 0 and w % 2 == 0 for h, w in grids)
    assert sum(rows) == int((s.input_ids == IMG).sum()) and (s.input_ids != PAD).sum() <= CFG.seq_len


def docs_file(tmp_path, n=8, name="d.jsonl", tag="doc"):
    return write_jsonl(tmp_path / name, [{"text": f"{tag}{i:02d}" + "x" * (3 * i)} for i in range(n)])


def test_packing_rows_hold_the_document_stream(tmp_path):
    """Packed rows hold the stream's documents whole and apart (seq_idx, labels), in stream order within a row; one
    pass (len) holds each document once: 8 documents of 7-28 tokens, 140 in all, best-fit into two rows of 96."""
    path = docs_file(tmp_path)
    plain, _ = build(path)
    packed, _ = build(path, pack=True)
    position = {text_of(plain[i]): i for i in range(8)}     # each document's place in the stream's first epoch
    assert len(packed) == 2
    stream = []
    for i in range(len(packed)):
        s, row = packed[i], []
        seq = s.seq_idx
        assert (seq[1:] >= seq[:-1]).all() and seq[0] == 0
        n_docs = int(seq[s.input_ids != PAD].max()) + 1
        assert n_docs >= 2                            # 8 short documents: rows hold several
        for d in range(n_docs):
            where = (seq == d).nonzero().flatten()
            ids, labels = s.input_ids[where], s.labels[where]
            assert labels[-1] == -100                 # no label crosses into the next document
            row.append(position[decode(ids.tolist())])
            one = plain[row[-1]]                      # the same document, unpacked
            assert ids.tolist() == one.input_ids[:len(ids)].tolist() and (one.input_ids[len(ids):] == PAD).all()
            assert labels.tolist() == one.labels[:len(ids)].tolist()
        assert row == sorted(row)
        stream += row
        pad = s.input_ids == PAD
        assert (s.labels[pad] == -100).all() and (seq[pad] == n_docs).all()
    assert sorted(stream) == list(range(8))           # an epoch: each document once


def test_packing_boundaries_reach_the_model(tmp_path):
    """A packed row through the decoder gives every document the hidden states it has alone (Mamba seq_idx
    resets and the document attention mask), so nothing leaks across boundaries."""
    packed, _ = build(docs_file(tmp_path), pack=True)
    torch.manual_seed(0)
    lm = model.LanguageModel(CFG)
    model.init_weights(lm, 1, {"tp": (0, 1), "ep": (0, 1), "etp": (0, 1)}, CFG)
    lm.eval()
    ids, labels, seq, valid = data.collate_text([packed[0], packed[1]])
    assert seq.shape == ids.shape == labels.shape == (2, CFG.seq_len)
    with torch.no_grad():
        h = lm(lm.embed(ids), seq)
        for b_ in range(2):
            for d in seq[b_].unique().tolist():
                where = (seq[b_] == d).nonzero().flatten()
                alone = lm(lm.embed(ids[b_, where][None]))
                assert torch.allclose(h[b_, where], alone[0], atol=1e-4), (b_, d)
        assert not torch.allclose(lm(lm.embed(ids[:1])), h[:1], atol=1e-4)   # without seq_idx it differs


def test_train_passes_seq_idx_to_the_model(tmp_path, monkeypatch):
    import train
    seen, forward = [], model.LanguageModel.forward
    monkeypatch.setattr(model.LanguageModel, "forward", lambda self, h, seq_idx=None, valid=None: (
        seen.append(seq_idx), forward(self, h, seq_idx, valid))[1])
    history, _ = train.main(["--data", docs_file(tmp_path), "--pack", "--steps", "2", "--global-batch", "2",
                             "--log-every", "100"])
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    assert seen and all(s is not None and s.shape == (1, CFG.seq_len) and s.max() > 0 for s in seen)


def test_blend_ratios_and_determinism(tmp_path):
    a, c = docs_file(tmp_path, 5, "a.jsonl", "aa"), docs_file(tmp_path, 3, "c.jsonl", "cc")
    ds, _ = build(f"0.75:{a}, 0.25:{c}")
    picks = [ds.blend(i)[0] for i in range(400)]
    for n in range(1, 401):                           # every prefix within one sample of 3:1
        assert abs(picks[:n].count(0) - 0.75 * n) <= 1
    names = [text_of(ds[i])[3:5] for i in range(40)]
    assert [x == "aa" for x in names] == [p == 0 for p in picks[:40]]
    again, _ = build(f"0.75:{a},0.25:{c}")
    assert all(torch.equal(ds[i].input_ids, again[i].input_ids) for i in range(40))
    a_docs = [text_of(ds[i]) for i in range(40) if picks[i] == 0]
    assert len(set(a_docs[:5])) == 5 and len(set(a_docs[5:10])) == 5    # epoch-wise permutations
    assert a_docs[:5] != a_docs[5:10] or a_docs[5:10] != a_docs[10:15]  # reshuffled each epoch
    other, _ = build(a, seed=8)
    assert [text_of(other[i]) for i in range(5)] != [text_of(build(a)[0][i]) for i in range(5)]


def test_eval_split(tmp_path):
    path = docs_file(tmp_path, 8)
    tr, ev = build(path, eval_frac=0.25)
    train_docs = {text_of(tr[i])[3:8] for i in range(30)}
    eval_docs = {text_of(ev[i])[3:8] for i in range(10)}
    assert train_docs == {f"doc{i:02d}" for i in range(6)} and eval_docs == {"doc06", "doc07"}
    _, ev = build(path, eval_data=docs_file(tmp_path, 2, "e.jsonl", "eee"))
    assert {text_of(ev[i])[3:8] for i in range(4)} == {"eee00", "eee01"}
    with pytest.raises(SystemExit, match="eval"):
        build(path, eval_every=1)


GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
BAD = {
    "malformed JSON": '{"text": "abc"',
    "unknown role": {"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "a"}]},
    "missing image": {"messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]},
                                   {"role": "assistant", "content": "a"}]},
    "undecodable image": {"messages": [{"role": "user", "content": [{"type": "image", "image": "junk.png"}]},
                                       {"role": "assistant", "content": "a"}]},
    "empty assistant turn": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
}


@pytest.mark.parametrize("reason", list(BAD))
def test_bad_input_names_file_line_and_reason(tmp_path, reason, capsys):
    (tmp_path / "junk.png").write_bytes(b"\x89PNG not really")
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, BAD[reason], GOOD])
    with pytest.raises(data.BadSample, match=f"^{path}:2: .*{reason}"):
        build(path)
    ds, _ = build(path, skip_bad_samples=True)
    out = capsys.readouterr().out
    assert "skipped 1 bad line" in out and f"{path}:2: " in out and reason in out
    assert len(ds.sources[0][2]["offsets"]) == 2 and text_of(ds[0]) == text_of(ds[1])   # the two good lines


def test_index_is_cached(tmp_path, monkeypatch, chat_file):
    first, _ = build(chat_file)
    assert any(f.endswith(".idx.npz") for f in os.listdir(tmp_path))
    monkeypatch.setattr(data.Encoder, "encode", lambda *a, **k: pytest.fail("re-indexed"))
    again = formats.index_file(chat_file, data.Encoder(TOK, CFG), verbose=False)
    assert again["lengths"].tolist() == first.sources[0][2]["lengths"].tolist()


def test_hf_tokenizer(tmp_path, chat_file):
    tokenizers = pytest.importorskip("tokenizers")
    specials = {"<|im_start|>": 500, "<|im_end|>": 501, "<img>": 502, "</img>": 503, "<s>": 504, "</s>": 505,
                "<image>": IMG}
    words = {"Red": 10, "What": 11, "Be": 12, "brief": 13, ".": 14, "?": 15, "user": 16, "assistant": 17,
             "system": 18, "<unk>": 19, **specials}
    vocab = {**{f"w{i}": i for i in range(512) if i not in words.values()}, **words}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(specials))
    tok.save(str(tmp_path / "tokenizer.json"))
    ds, _ = build(chat_file, tokenizer=str(tmp_path / "tokenizer.json"))
    s = ds[0]
    n = int((s.input_ids != 505).sum())                # no <pad>: padding is </s>
    assert s.input_ids[:n].tolist() == [500, 18, 12, 13, 14, 501, 500, 16, 502] + [IMG] * 4 + \
        [503, 11, 15, 501, 500, 17, 10, 14, 501]
    assert [t for t in s.labels.tolist() if t != -100] == [10, 14, 501]
    with pytest.raises(SystemExit, match="image-token-id"):
        build(chat_file, cfg=config.resolve("tiny", {"image_token_id": "400"}),
              tokenizer=str(tmp_path / "tokenizer.json"))


def test_resume_and_workers_continue_at_the_right_sample(tmp_path, chat_file):
    ds, _ = build(f"2:{docs_file(tmp_path)},1:{chat_file}", pack=True)
    lane = data.Loader(ds, [1, 2], samples_per_microbatch=4)            # e.g. one lane of a 4-sample micro-batch
    lane.step(0, 2)
    lane.step(8, 2)
    state = lane.state_dict()
    assert state["next_sample"] == 16
    resumed = data.Loader(ds, [1, 2], 4, num_workers=1)
    resumed.load_state_dict(state)
    got = resumed.step(state["next_sample"], 2)
    assert sorted(got) == [17, 18, 21, 22]
    for i, s in got.items():
        want = ds[i]
        assert torch.equal(s.input_ids, want.input_ids) and torch.equal(s.labels, want.labels)
        assert torch.equal(s.seq_idx, want.seq_idx) and all(torch.equal(x, y) for x, y in zip(s.images, want.images))
    text_only = data.Loader(ds, [1], 4, pixels=False).step(16, 1)[17]  # language-only ranks decode no pixels
    assert text_only.images is None and torch.equal(text_only.input_ids, ds[17].input_ids)


def test_padding_mask_reaches_the_batch():
    cfg = config.resolve("tiny", {"seq_len": 12})
    docs = [([1, 2, 3, 4, 5], [True] * 5, None)]
    row = data.make_row(docs, cfg, pad_id=510, packed=False)
    assert row.n_pad == 7 and row.input_ids[5:].tolist() == [510] * 7 and (row.labels[4:] == -100).all()
    full = data.make_row([([1] * 12, [True] * 12, None)], cfg, pad_id=510, packed=False)
    ids, labels, seq, valid = data.collate_text([row, full])
    assert seq is None and valid.sum(1).tolist() == [5, 12]
    assert data.collate_text([full, full])[3] is None
