"""Where the language model's fwd+bwd memory goes (bench/2026-11-28-data-speed.md §4), on one GPU:

  python bench/lm_memory.py [--preset 20l] [--trace]

Twice: as bench.py --parts lm keeps the model (train.py's: bf16 weights, fp32 main_grad buffers, the optimizer's fp32
main weights), then the same model as a plain bf16 module with bf16 .grad; each: bytes before the call, peak, ms.
--trace: the allocator's trace of one call replayed, the bytes alive at its peak by the two innermost project frames."""
import argparse
import collections
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import config  # noqa: E402
import model  # noqa: E402

GIB = 2 ** 30


def measure(name, fn, iters=5):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base, t0 = torch.cuda.memory_allocated(), time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    print(f"{name}: before the call {base / GIB:.2f} GiB, peak {torch.cuda.max_memory_allocated() / GIB:.2f} GiB, "
          f"{(time.perf_counter() - t0) / iters * 1e3:.1f} ms", flush=True)


def where(frames):
    inside = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames
              if f["filename"].startswith(ROOT) and not f["filename"].endswith("lm_memory.py")]
    return " < ".join(inside[:2]) or "elsewhere"


def trace(fn):
    """Replay one call's allocations and frees; print what is alive at the highest point."""
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    fn()
    torch.cuda.synchronize()
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    live, now, top, at_top = {}, 0, 0, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
            now += e["size"]
            if now > top:
                top, at_top = now, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    size, count = collections.Counter(), collections.Counter()
    for n, w in at_top.values():
        size[w] += n
        count[w] += 1
    print(f"allocated during the call, alive at its peak: {top / GIB:.2f} GiB")
    for w, n in size.most_common(20):
        print(f"  {n / GIB:7.3f} GiB {count[w]:4d}x  {w}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="20l")
    p.add_argument("--n-routed-experts", type=int, default=16)
    p.add_argument("--trace", action="store_true")
    a = p.parse_args()
    cfg = config.resolve(a.preset, {"n_routed_experts": a.n_routed_experts})
    dev = torch.device("cuda")
    trained = bench.lm_fwd_bwd(cfg, 1, dev)
    measure("as train.py keeps it", trained)
    if a.trace:
        trace(trained)
    del trained
    torch.cuda.empty_cache()
    lm = model.LanguageModel(cfg).to(dev)
    model.init_weights(lm, 0, {}, cfg)
    lm.bfloat16()
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device=dev)

    def plain():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s, _ = lm.loss_sum(lm(lm.embed(ids)), ids)
        s.backward()
        lm.zero_grad(set_to_none=False)
    measure("a plain bf16 module", plain)


if __name__ == "__main__":
    main()
