"""A generated data set shaped like real VLM SFT sets (never downloaded): JSONL chats in the project's record format
(docs/data.md §2) beside JPEG files the loader decodes at full size, deterministic from a seed.

    python bench/real_shaped.py OUT_DIR [--records N] [--seed S] [--small] [--processes P]
    # -> OUT_DIR/train.jsonl, OUT_DIR/images/*.jpg; prints one line of counts and the path
    import real_shaped; path = real_shaped.write(out_dir, records=None, seed=0, small=False)   # None: 3000, 64 small

The mix (exact counts per kind, in a seeded order; N = 3000 by default, 64 in the small form):
  20 %  text only
  50 %  one photo: short side uniform in 336-1080 px, aspect 1:1, 4:3, 3:2, 16:9, their portrait forms (3:4, 2:3,
        9:16) or 2:1
  15 %  two to four images: each a small image (short side 224-640 px, the same aspects) or a photo as above
  15 %  one document page, W x H one of 1700x2200, 2048x1536, 1536x2048, 1654x2339
Text: lowercase pseudo-words of 2-10 letters (a seeded vocabulary of 8192, drawn Zipf-like, ~4.4 letters a word)
with occasional commas and full stops, ~5.6 bytes a word with its space: what the byte tokenizer sees. Word counts
are log-normal (sigma 1), clipped at 1200 (prompts) and 1500 (answers); medians: first prompts 150 words (text
only), 40 (photo), 60 (several images), 100 (document); answers 60; follow-up prompts 25, their answers 40. 30 % of
the chats have 2-4 user/assistant turns; a chat's images are in its first user turn, before its text. Each record
also has an "id" (its kind and number; the loader ignores it).
Images: a photo is a random colour grid of 2-8 cells a side (numpy, seeded per image) resized bilinearly by PIL to
its size; a document page is off-white with dark grey text-like bars in lines and paragraphs. JPEG quality 85.
Cheap to make and small on disk (3000 records: 3.56 Gpixels in ~210 MB; smooth content compresses well, and decodes
somewhat faster per pixel than real photos), but with the real pixel counts. A pool of processes (every core)
writes them; the bytes do not depend on its size (the same Pillow / libjpeg build writes the same files).
Time: 27 s in one process on a 2-core CPU machine, 14-19 s with the pool of 2 there, so ~3 s on 16 cores.

The small form (--small; what the CPU tests train on with `--preset tiny --seq-len 256`: patch 16, 16-256 patches
an image): the same kinds, proportions, aspect ratios and multi-turn share, 64 records by default; photos' short
sides 40-144 px, small images' 32-80 px, document pages 1/8 of the sizes above (192-292 px); word counts log-normal
with sigma 0.8, medians: first prompts 6 (text only), 3 (photo), 4 (several images), 5 (document); answers 7;
follow-up prompts and answers 3; clipped at 100 and 150 words. Under the byte tokenizer a document is then
~40-250 tokens (median ~140, one in seven past 256: --overlong truncate cuts those), and --pack puts two or three
documents in two thirds of the rows (95 % full; next-fit, before packing.py, a third at 77 %).
"""
import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

KINDS = ("text", "photo", "multi", "doc")
SHARES = (0.20, 0.50, 0.15, 0.15)
MULTI_TURN = 0.30                                   # chats with 2-4 user/assistant turns
ASPECTS = (1.0, 4 / 3, 3 / 2, 16 / 9, 3 / 4, 2 / 3, 9 / 16, 2.0)   # width / height
DOC_PAGES = ((1700, 2200), (2048, 1536), (1536, 2048), (1654, 2339))   # W x H
QUALITY = 85
VOCAB = 8192                                        # pseudo-words of the vocabulary

FULL = dict(photo_short=(336, 1080), small_short=(224, 640), doc_scale=1.0, sigma=1.0,
            prompt=dict(text=150, photo=40, multi=60, doc=100), followup=25, answer=60, followup_answer=40,
            max_prompt=1200, max_answer=1500)
SMALL = dict(photo_short=(40, 144), small_short=(32, 80), doc_scale=1 / 8, sigma=0.8,
             prompt=dict(text=6, photo=3, multi=4, doc=5), followup=3, answer=7, followup_answer=3,
             max_prompt=100, max_answer=150)


# ---------------------------------------------------------------- text

def vocabulary(seed):
    """(words, cumulative Zipf weights) of the seed's pseudo-word vocabulary."""
    rng = np.random.default_rng([seed, 0x766f63])
    lengths = 2 + rng.binomial(8, 0.3, VOCAB)       # 2-10 letters, mean 4.4
    letters = rng.integers(97, 123, int(lengths.sum()), dtype=np.uint8).tobytes().decode("ascii")
    ends = np.cumsum(lengths)
    words = [letters[e - n:e] for n, e in zip(lengths.tolist(), ends.tolist())]
    weights = 1.0 / (np.arange(VOCAB) + 10.0)
    return words, np.cumsum(weights) / weights.sum()


def count(rng, median, sigma, most):
    return int(min(max(1, round(median * np.exp(sigma * rng.standard_normal()))), most))


def words(rng, vocab, n, question=False):
    """n pseudo-words: commas after ~7 %, sentence ends after ~6 %, a final '.' or '?'."""
    vw, cdf = vocab
    picks = np.minimum(np.searchsorted(cdf, rng.random(n)), VOCAB - 1).tolist()
    marks = rng.random(n).tolist()
    out = [vw[j] + ("," if m < 0.07 else "." if m < 0.13 else "") for j, m in zip(picks, marks)]
    out[-1] = out[-1].rstrip(",.") + ("?" if question else ".")
    return " ".join(out)


# ---------------------------------------------------------------- images (in the pool's processes)

def _size(short, aspect):
    long = int(round(short * max(aspect, 1 / aspect)))
    return (long, short) if aspect >= 1 else (short, long)    # (W, H)


def _photo(rng, W, H):
    from PIL import Image
    gw = int(rng.integers(2, 9))
    gh = max(2, min(8, int(round(gw * H / W))))
    cells = rng.integers(0, 256, (gh, gw, 3), dtype=np.uint8)
    return Image.fromarray(cells).resize((W, H), Image.BILINEAR)


def _page(rng, W, H):
    """White page, a title bar, then lines of dark word-like bars in paragraphs, ragged right."""
    from PIL import Image
    a = np.empty((H, W, 3), np.uint8)
    a[:] = 255 - rng.integers(0, 12, 3, dtype=np.uint8)      # a faint paper tint
    m = max(2, W // 12)
    pitch = max(3, H // int(rng.integers(40, 61)))
    bar = max(2, int(pitch * 0.55))
    y = m
    a[y:y + 2 * bar, m:m + int((W - 2 * m) * rng.uniform(0.3, 0.7))] = 40    # the title
    y += 3 * pitch
    while y + bar < H - m:
        if rng.random() < 0.12:                                  # a paragraph break
            y += pitch
            continue
        x, end = m + (int(2 * bar * 2) if rng.random() < 0.1 else 0), W - m - int(rng.integers(0, max(1, W // 4)))
        ink = int(rng.integers(10, 70))
        while x < end:
            w = int(bar * rng.uniform(1.5, 6))
            a[y:y + bar, x:min(x + w, end)] = ink
            x += w + max(1, bar // 2)
        y += pitch
    return Image.fromarray(a)


def _image(job):
    """One image file: job = (path, kind, W, H, seed words) -> (bytes written, pixels)."""
    path, kind, W, H, key = job
    rng = np.random.default_rng(key)
    img = _page(rng, W, H) if kind == "doc" else _photo(rng, W, H)
    img.save(path, "JPEG", quality=QUALITY)
    return os.path.getsize(path), W * H


# ---------------------------------------------------------------- records

def _quota(n):
    """Exact counts per kind summing to n (largest remainders)."""
    raw = [n * s for s in SHARES]
    out = [int(r) for r in raw]
    for k in sorted(range(len(raw)), key=lambda k: out[k] - raw[k])[:n - sum(out)]:
        out[k] += 1
    return out


def plan(records, seed, small):
    """-> (records as dicts, image jobs): the whole set, text included, without touching the disk."""
    prof = SMALL if small else FULL
    rng = np.random.default_rng([seed, 0x6b696e64])
    kinds = np.repeat(np.arange(len(KINDS)), _quota(records))
    rng.shuffle(kinds)
    vocab = vocabulary(seed)
    sigma, out, jobs = prof["sigma"], [], []
    for i, kind in enumerate(KINDS[k] for k in kinds.tolist()):
        r = np.random.default_rng([seed, i])
        sizes = []
        if kind == "photo":
            sizes = [("photo", *_size(int(r.integers(prof["photo_short"][0], prof["photo_short"][1] + 1)),
                                      ASPECTS[r.integers(len(ASPECTS))]))]
        elif kind == "multi":
            for _ in range(int(r.integers(2, 5))):
                lo, hi = prof["small_short" if r.random() < 0.5 else "photo_short"]
                sizes.append(("photo", *_size(int(r.integers(lo, hi + 1)), ASPECTS[r.integers(len(ASPECTS))])))
        elif kind == "doc":
            W, H = DOC_PAGES[r.integers(len(DOC_PAGES))]
            sizes = [("doc", round(W * prof["doc_scale"]), round(H * prof["doc_scale"]))]
        parts = []
        for k, (what, W, H) in enumerate(sizes):
            name = f"images/{i:06d}_{k}.jpg"
            jobs.append((name, what, W, H, [seed, i, k]))
            parts.append({"type": "image", "image": name})
        turns = int(r.integers(2, 5)) if r.random() < MULTI_TURN else 1
        messages = []
        for t in range(turns):
            median = prof["prompt"][kind] if t == 0 else prof["followup"]
            prompt = words(r, vocab, count(r, median, sigma, prof["max_prompt"]), question=True)
            answer = words(r, vocab, count(r, prof["answer" if t == 0 else "followup_answer"], sigma,
                                           prof["max_answer"]))
            content = parts + [{"type": "text", "text": prompt}] if t == 0 and parts else prompt
            messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        out.append({"id": f"{kind}-{i:06d}", "messages": messages})
    return out, jobs


def write(out_dir, records=None, seed=0, small=False, processes=None, verbose=False):
    """Writes OUT_DIR/train.jsonl and OUT_DIR/images/ -> the JSONL's path. records: default 3000, 64 small;
    processes: the image pool's size (default: every core; 1: in this process). verbose: print the counts."""
    t0 = time.perf_counter()
    records = records if records is not None else 64 if small else 3000
    recs, jobs = plan(records, seed, small)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    path = os.path.join(out_dir, "train.jsonl")
    with open(path, "w") as f:
        for rec in recs:
            f.write(json.dumps(rec) + "\n")
    jobs = [(os.path.join(out_dir, name), *rest) for name, *rest in jobs]
    processes = processes or os.cpu_count() or 1
    if processes == 1 or len(jobs) < 64:
        done = [_image(j) for j in jobs]
    else:
        order = sorted(range(len(jobs)), key=lambda j: -jobs[j][2] * jobs[j][3])   # the largest first
        # spawned, not forked: a fork of a process running threads (torch's, a test session's) can hang in the child
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            done = list(pool.imap_unordered(_image, [jobs[j] for j in order], chunksize=4))
    if verbose:
        per = {k: sum(r["id"].startswith(k + "-") for r in recs) for k in KINDS}
        turns = sum(len(r["messages"]) > 2 for r in recs)
        nbytes = sum(b for b, _ in done) + os.path.getsize(path)
        print(f"records {len(recs)} (" + ", ".join(f"{k} {v}" for k, v in per.items()) + f"; {turns} multi-turn), "
              f"images {len(jobs)}, {sum(p for _, p in done) / 1e6:.1f} Mpixels, {nbytes / 2**20:.1f} MiB on disk, "
              f"{time.perf_counter() - t0:.1f} s -> {path}", flush=True)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--records", type=int, default=None, help="default 3000, 64 with --small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true",
                    help="the small form of the CPU tests (--preset tiny --seq-len 256)")
    ap.add_argument("--processes", type=int, default=None, help="image pool size (default: every core)")
    a = ap.parse_args(argv)
    if a.records is not None and a.records < 1:
        sys.exit("--records must be at least 1")
    write(a.out_dir, a.records, a.seed, a.small, a.processes, verbose=True)


if __name__ == "__main__":
    main()
