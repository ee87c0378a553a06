"""formats.py on CPU: LLaVA / ShareGPT records (JSONL and .json arrays) and parquet shards with embedded images give
exactly the samples of the same data written as messages JSONL with image files; over-long policies; bad records;
a parquet + JSONL blend resumes bit-exactly; local rank 0 indexes while the others wait."""
import io
import json
import os
import sys

import pytest
import torch
from PIL import Image

import data
import formats
from tests.spawn import run_distributed
from tests.test_data import IMG, PAD, SP, b, build, decode, padded, write_jsonl

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def image_bytes(color, size, fmt):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt)
    return buf.getvalue()


IMAGES = {"red.png": image_bytes((255, 0, 0), (64, 48), "PNG"), "blue.jpg": image_bytes((0, 0, 255), (32, 32), "JPEG"),
          "green.png": image_bytes((0, 200, 0), (48, 32), "PNG")}
# (question, answer, images): two images in one turn, one image, none
CHATS = [("Which colors?", "Red and blue.", ["red.png", "blue.jpg"]), ("And this?", "Green.", ["green.png"]),
         ("Hi", "Hello there.", [])]


@pytest.fixture
def files(tmp_path):
    for name, raw in IMAGES.items():
        (tmp_path / name).write_bytes(raw)
    return tmp_path


def as_messages(q, a, images, ref=lambda name: {"type": "image", "image": name}):
    return [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [ref(n) for n in images] + [{"type": "text", "text": q}]},
            {"role": "assistant", "content": [{"type": "text", "text": a}]}]   # lists throughout, as parquet has it


def as_llava(q, a, images):
    return {"image": images[0] if len(images) == 1 else images, "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "<image>\n" * len(images) + q},
        {"from": "gpt", "value": a}]}


def assert_same_samples(ds, ref, n=len(CHATS)):
    for i in range(n):
        s, r = ds[i], ref[i]
        assert torch.equal(s.input_ids, r.input_ids) and torch.equal(s.labels, r.labels)
        assert len(s.images) == len(r.images) and all(torch.equal(x, y) for x, y in zip(s.images, r.images))


def test_llava_jsonl_and_json_array_equal_messages(files):
    ref, _ = build(write_jsonl(files / "m.jsonl", [{"messages": as_messages(*c)} for c in CHATS]))
    s = ref[[i for i in range(3) if len(ref[i].images) == 2][0]]     # the two-image chat, exactly
    head = [SP["<|im_start|>"]] + b("system\nBe brief.") + [SP["<|im_end|>"]] + b("\n") + [SP["<|im_start|>"]] + \
        b("user\n") + [SP["<img>"]] + [IMG] * 4 + [SP["</img>"], SP["<img>"]] + [IMG] * 4 + [SP["</img>"]] + \
        b("Which colors?") + [SP["<|im_end|>"]] + b("\n") + [SP["<|im_start|>"]] + b("assistant\n")
    assert s.input_ids.tolist() == padded(head + b("Red and blue.") + [SP["<|im_end|>"]] + b("\n"), PAD)
    assert [t for t in s.labels.tolist() if t != -100] == b("Red and blue.") + [SP["<|im_end|>"]]

    marked = [{"messages": [{**m, "content": m["content"][0]["text"]} if m["role"] != "user" else
                            {**m, "content": "<image>\n" * len(ims) + q} for m in as_messages(q, a, ims)],
               "images": ims} for q, a, ims in CHATS]                      # string contents with <image> marks
    assert_same_samples(build(write_jsonl(files / "marked.jsonl", marked))[0], ref)
    llava = [as_llava(*c) for c in CHATS]
    assert_same_samples(build(write_jsonl(files / "l.jsonl", llava))[0], ref)
    (files / "l.json").write_text("[\n" + ",\n".join(json.dumps(r, indent=2) for r in llava) + "\n]\n")
    assert_same_samples(build(str(files / "l.json"))[0], ref)
    (files / "one_line.json").write_text(json.dumps(llava))
    assert_same_samples(build(str(files / "one_line.json"))[0], ref)


def test_json_array_errors_name_the_element_line(files):
    good = as_llava(*CHATS[2])
    bad = {**good, "conversations": [{"from": "robot", "value": "x"}]}
    path = files / "a.json"
    path.write_text("[\n" + ",\n".join(json.dumps(r, indent=1, ensure_ascii=False) for r in [good, bad]) + "\n]")
    second = 2 + json.dumps(good, indent=1).count("\n") + 1            # line where element 2 starts
    with pytest.raises(data.BadSample, match=f"^{path}:{second}: bad conversation turn"):
        build(str(path))
    path.write_text('[{"text": "héllo wörld"}, \n {"text": "zwei"}, {"text": ')   # cut short
    with pytest.raises(data.BadSample, match=f"^{path}:2: malformed JSON array element"):
        build(str(path))
    path.write_text('[{"text": "héllo wörld"}, {"text": "zwei ✓"}]')
    ds, _ = build(str(path))
    assert sorted(decode(ds[i].input_ids[1:][ds[i].input_ids[1:] < 256].tolist()) for i in range(2)) == \
        ["héllo wörld", "zwei ✓"]


def write_parquet(path, rows, row_group_size=2):
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=row_group_size)
    return str(path)


def test_parquet_with_embedded_images_equals_jsonl_with_files(files):
    ref, _ = build(write_jsonl(files / "m.jsonl", [{"messages": as_messages(*c)} for c in CHATS]))
    rows = [{"messages": as_messages(q, a, ims, ref=lambda n: {"type": "image"}),
             "images": [{"bytes": IMAGES[n], "path": None} for n in ims]} for q, a, ims in CHATS]
    sub = files / "shards"
    sub.mkdir()
    ds, _ = build(write_parquet(sub / "hf.parquet", rows))
    assert_same_samples(ds, ref)
    ds[0]                                            # the parent has the shard open when the worker forks
    got = data.Loader(ds, [0, 1, 2], 3, num_workers=1).step(0, 1)      # a DataLoader worker reads it again
    assert_same_samples([got[i] for i in range(3)], ref)
    assert all(torch.equal(ds.sample(i, pixels=False).input_ids, ref[i].input_ids) for i in range(3))
    # LLaVA in parquet: custom column names, images as bytes or as paths (relative to the shard), 1-row groups
    llava = [{"conv": as_llava(*c)["conversations"], "img": [{"bytes": IMAGES[n], "path": "x"} for n in c[2]]
              if len(c[2]) == 1 else [{"bytes": None, "path": f"../{n}"} for n in c[2]]} for c in CHATS]
    path = write_parquet(sub / "llava.parquet", llava, 1)
    with pytest.raises(SystemExit, match="no column pictures .*--data-columns"):
        build(path, data_columns="messages=conv,images=pictures")
    with pytest.raises(SystemExit, match="no column messages or conversations or text"):
        build(path)
    assert_same_samples(build(path, data_columns="messages=conv,images=img")[0], ref)
    # a glob and a directory: the shards of one entry share its weight by their document counts
    write_parquet(sub / "more.parquet", rows[:1])
    ds, _ = build(f"{sub}/[hm]*.parquet")
    assert [p for _, p, _ in ds.sources] == [str(sub / "hf.parquet"), str(sub / "more.parquet")]
    assert ds.blend.w.tolist() == [0.75, 0.25]
    os.remove(sub / "llava.parquet")
    assert [p for _, p, _ in build(str(sub))[0].sources] == [str(sub / "hf.parquet"), str(sub / "more.parquet")]


def test_bad_parquet_rows_name_file_and_row(files, capsys):
    rows = [{"messages": as_messages(q, a, ims, ref=lambda n: {"type": "image"}),
             "images": [{"bytes": IMAGES[n], "path": None} for n in ims]} for q, a, ims in CHATS]
    rows[1]["images"] = [{"bytes": b"\x89PNG broken", "path": None}]
    rows[2]["images"] = [{"bytes": IMAGES["red.png"], "path": None}]     # an image and no image part
    path = write_parquet(files / "bad.parquet", rows)
    with pytest.raises(data.BadSample, match=f"^{path}:row 1: undecodable image embedded image"):
        build(path)
    ds, _ = build(path, skip_bad_samples=True)
    out = capsys.readouterr().out
    assert "1 documents, skipped 2 bad line(s)" in out
    assert f"{path}:row 2: 0 image places (<image> or image parts) for 1 images" in out
    assert ds.sources[0][2]["lines"].tolist() == [0]


def test_llava_image_count_mismatch(files, capsys):
    bad = as_llava(*CHATS[1])
    bad["conversations"][1]["value"] = "<image>\n<image>\nTwo?"
    path = write_jsonl(files / "l.jsonl", [as_llava(*CHATS[2]), bad])
    with pytest.raises(data.BadSample, match=rf"^{path}:2: 2 image places \(<image> or image parts\) for 1 images"):
        build(path)
    build(path, skip_bad_samples=True)
    assert "skipped 1 bad line(s)" in capsys.readouterr().out


def test_missing_pyarrow_names_the_extra(files, monkeypatch):
    path = write_parquet(files / "x.parquet", [{"text": "hello"}])
    formats._parquet.cache_clear()
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)          # import fails as if not installed
    with pytest.raises(SystemExit, match=rf"^{path}: reading parquet needs pyarrow: pip install -e '\.\[parquet\]'"):
        build(path)
    formats._parquet.cache_clear()


# ---------------------------------------------------------------- over-long documents

def overlong_file(tmp_path):
    """line 1 fits; line 2: text over seq_len 96; line 3: an image from token 94 on cannot fit (its run is at least
    <img> + 1 + </img>); line 4: only the system turn fits, so nothing is left to train on."""
    return write_jsonl(tmp_path / "o.jsonl", [
        {"text": "short"}, {"text": "x" * 150},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "text", "text": "a" * 73}, {"type": "image", "image": "red.png"},
            {"type": "text", "text": "b"}]}]},
        {"messages": [{"role": "system", "content": "s" * 120}, {"role": "assistant", "content": "ok"}]}])


def test_overlong_error_and_skip(files, capsys):
    path = overlong_file(files)
    with pytest.raises(SystemExit) as e:                                # all three counted, the longest named
        build(path)
    assert e.value.code == (f"{path}: 3 documents are longer than seq_len 96 (the first and longest, line 2, 152 "
                            "tokens). Raise --seq-len, or pass --overlong truncate|skip")
    ds, _ = build(path, overlong="skip")
    assert ds.sources[0][2]["lines"].tolist() == [1] and "1 documents, skipped 3 over-long" in capsys.readouterr().out
    ds, _ = build(path, skip_bad_samples=True)                         # error + --skip-bad-samples: counted as bad
    assert ds.sources[0][2]["lines"].tolist() == [1] and "skipped 3 bad line(s)" in capsys.readouterr().out


def test_overlong_truncate_never_cuts_an_image(files, capsys):
    ds, _ = build(overlong_file(files), overlong="truncate")
    out = capsys.readouterr().out
    assert "3 documents, 2 truncated to seq_len, skipped 1 over-long" in out and "o.jsonl:4: no tokens to train" in out
    idx = ds.sources[0][2]
    assert idx["lines"].tolist() == [1, 2, 3] and idx["lengths"].tolist() == [7, 96, 94]
    by_line = {int(line): ds.load(0, d, True) for d, line in enumerate(idx["lines"])}
    assert by_line[2] == ([SP["<s>"]] + b("x" * 95), [False] + [True] * 95, [])
    head = [SP["<|im_start|>"]] + b("user\nhi") + [SP["<|im_end|>"]] + b("\n") + [SP["<|im_start|>"]] + \
        b("assistant\n")
    assert by_line[3] == (head + b("a" * 73), [False] * 21 + [True] * 73, [])   # the image and what follows: gone
    s = ds[[i for i in range(3) if ds[i].n_pad == 2][0]]                         # the sample of line 3
    assert s.images == [] and s.labels.tolist() == [-100] * 20 + b("a" * 73) + [-100] * 3


def test_truncate_keeps_whole_images():
    runs = [(2, 6), (8, 12)]
    assert formats.truncate(list(range(20)), [1] * 20, runs, 10) == (list(range(8)), [1] * 8, 1)
    assert formats.truncate(list(range(20)), [1] * 20, runs, 12) == (list(range(12)), [1] * 12, 2)
    assert formats.truncate(list(range(20)), [1] * 20, runs, 4) == ([0, 1], [1, 1], 0)
    assert formats.truncate(list(range(20)), [1] * 20, runs, 14) == (list(range(14)), [1] * 14, 2)


# ---------------------------------------------------------------- runs

def _index_on_rank(rank, world, path):
    calls, encode = [], data.Encoder.encode
    data.Encoder.encode = lambda self, *a, **k: (calls.append(1), encode(self, *a, **k))[1]
    ds, _ = build(path)
    return len(calls), ds.sources[0][2]["lengths"].tolist()


def test_local_rank_0_indexes_while_the_others_wait(files):
    path = write_jsonl(files / "m.jsonl", [{"messages": as_messages(*c)} for c in CHATS])
    (calls0, lengths0), (calls1, lengths1) = run_distributed(_index_on_rank, 2, path)
    assert calls0 == 3 and calls1 == 0 and lengths0 == lengths1 and len(lengths0) == 3


@pytest.mark.slow
def test_parquet_and_jsonl_blend_resumes_bit_exactly(files):
    import train
    rows = [{"messages": as_messages(q, a, ims, ref=lambda n: {"type": "image"}),
             "images": [{"bytes": IMAGES[n], "path": None} for n in ims]} for q, a, ims in CHATS]
    shard = write_parquet(files / "s.parquet", rows)
    chat = write_jsonl(files / "l.jsonl", [as_llava(*c) for c in CHATS])
    argv = ["--data", f"0.6:{shard},0.4:{chat}", "--pack", "--global-batch", "2", "--lr-decay-iters", "6",
            "--log-every", "100"]
    save = str(files / "ckpt")

    def run(*extra):
        history, modules = train.main(argv + list(extra))
        return [h["loss"] for h in history], {f"{k}.{n}": t for k, m in modules.items()
                                              for n, t in m.state_dict().items()}
    straight = run("--steps", "4")
    first = run("--steps", "2", "--save", save)
    resumed = run("--steps", "4", "--load", save)
    assert first[0] + resumed[0] == straight[0]
    assert all(torch.equal(straight[1][k], resumed[1][k]) for k in straight[1])
