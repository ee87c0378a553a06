"""Indexing at scale: time and peak RSS of formats.index_file on N LLaVA-style records, as JSONL (image paths) and
as parquet (HF messages + embedded PNG bytes), in 1 process and in R processes of one node (LOCAL_RANK 0..R-1:
local rank 0 indexes, the others wait for its cache; --all-index: every process indexes, the old behaviour).

    python bench/index_scale.py gen /tmp/idx 1000000        # writes /tmp/idx/{llava.jsonl,hf.parquet,img/}
    python bench/index_scale.py run /tmp/idx/llava.jsonl 8  # prints one line per rank: seconds, peak RSS
    python bench/index_scale.py read /tmp/idx/hf.parquet    # then: milliseconds per random sample
"""
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ANSWER = "The picture shows a small solid square of one color, centred, with nothing else in the frame. " * 3


def gen(out, n):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    os.makedirs(f"{out}/img", exist_ok=True)
    pngs = []
    for k in range(100):
        buf = io.BytesIO()
        Image.new("RGB", (64 + 16 * (k % 5), 48), (k, 255 - k, 3 * k % 256)).save(buf, "PNG")
        pngs.append(buf.getvalue())
        open(f"{out}/img/{k}.png", "wb").write(pngs[-1])
    with open(f"{out}/llava.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "image": f"img/{i % 100}.png", "conversations": [
                {"from": "human", "value": f"<image>\nDescribe picture {i} in detail."},
                {"from": "gpt", "value": ANSWER}]}) + "\n")
    schema = pa.Table.from_pylist(rows(0, 1, pngs)).schema
    with pq.ParquetWriter(f"{out}/hf.parquet", schema) as w:
        for start in range(0, n, 10000):   # row groups of 1000 rows (HF datasets: 100 for image data)
            w.write_table(pa.Table.from_pylist(rows(start, min(n, start + 10000), pngs), schema), row_group_size=1000)


def rows(start, stop, pngs):
    return [{"messages": [{"role": "user", "content": [{"type": "image", "text": None},
                                                       {"type": "text", "text": f"Describe picture {i} in detail."}]},
                          {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}],
             "images": [{"bytes": pngs[i % 100], "path": None}]} for i in range(start, stop)]


def one(path):
    import config
    import data
    import formats
    cfg = config.resolve("small")
    enc = data.Encoder(data.ByteTokenizer(cfg.vocab_size, cfg.image_token_id), cfg)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t, cpu = time.perf_counter(), time.process_time()
    idx = formats.index_file(path, enc, verbose=False)
    dt, cpu = time.perf_counter() - t, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"local_rank {os.environ.get('LOCAL_RANK', 0)}: {len(idx['offsets'])} documents in {dt:.1f} s "
          f"({cpu:.1f} s CPU), peak RSS {rss / 1024:.0f} MiB ({rss0 / 1024:.0f} MiB after imports)", flush=True)


def read(path, n=300):
    """Random access after indexing: seconds per sample (pixels decoded) at random indices."""
    import numpy as np

    import config
    import data
    cfg = config.resolve("small", {"data": path, "seed": 1})
    ds, _ = data.build(cfg, data.load_tokenizer(None, cfg), verbose=False)
    picks = np.random.default_rng(0).integers(0, len(ds.sources[0][2]["offsets"]), n)   # within epoch 0
    t = time.perf_counter()
    for i in picks:
        ds.sample(int(i))
    print(f"{path}: {1e3 * (time.perf_counter() - t) / n:.2f} ms per random sample (images decoded)")


def run(path, ranks, all_index=False):
    for f in os.listdir(os.path.dirname(path)):   # a cold start: no cached index
        if f.endswith(".idx.npz"):
            os.remove(os.path.join(os.path.dirname(path), f))
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "one", path],
                              env={**os.environ, "LOCAL_RANK": "0" if all_index else str(r)}) for r in range(ranks)]
    assert all(p.wait() == 0 for p in procs)
    print(f"{path}: {ranks} process(es){' all indexing' if all_index else ''}: {time.perf_counter() - t:.1f} s wall")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "gen":
        gen(sys.argv[2], int(sys.argv[3]))
    elif cmd == "one":
        one(sys.argv[2])
    elif cmd == "read":
        read(sys.argv[2])
    else:
        run(sys.argv[2], int(sys.argv[3]), "--all-index" in sys.argv)
