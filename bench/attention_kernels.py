"""The tower's packed attention on real-shaped images: which SDPA backend each image's shape gets, which backends
fail (forward + backward) on which shapes, the ways to lay a micro-batch's segments out for SDPA (radio.Block's q,
k, v are views of one qkv GEMM output) checked against flash varlen, and the time of each.

    python bench/attention_kernels.py [--vision vit-h] [--rows 200] [--pressure-gib 2] [--phases shapes,layouts,time]
    python bench/attention_kernels.py --train LAYOUT [train.py flags]   # train with radio.packed_attention replaced

Image sizes follow bench/real_shaped.py's mix (photos, small images, document pages) through the project's own
token budget (radio.compute_params, seq_len 8192), packed into rows of 8192 tokens as --pack does (best-fit
decreasing within windows of packing.WINDOW documents, packing.py): a segment is an image's h*w patches plus its
class tokens. Errors are found in child processes (a CUDA error can leave the context unusable), run with CUDA_LAUNCH_BLOCKING=1 so that an error names its own call; a child that fails is
restarted at the next case. Prints one JSON line a finding, then a table of times.
"""
import argparse
import json
import os
import random
import runpy
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import config   # noqa: E402
import packing  # noqa: E402
import radio    # noqa: E402

BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
PHOTO_RATIOS = (1.0, 4 / 3, 3 / 2, 16 / 9, 2.0)
PAGES = ((1700, 2200), (2048, 1536), (1536, 2048), (1654, 2339))


# ---------------------------------------------------------------- real-shaped segments

def image_sizes(rng):
    """(H, W) of one sample's images, bench/real_shaped.py's mix (text-only samples bring none)."""
    def photo(lo, hi):
        short, r = rng.randint(lo, hi), rng.choice(PHOTO_RATIOS)
        long = round(short * r)
        return (short, long) if rng.random() < 0.5 else (long, short)
    u = rng.random()
    if u < 0.2:
        return []
    if u < 0.7:
        return [photo(336, 1080)]
    if u < 0.85:
        return [photo(224, 640) if rng.random() < 0.7 else photo(336, 1080) for _ in range(rng.randint(2, 4))]
    w, h = rng.choice(PAGES)
    return [(h, w)]


def microbatches(cfg, n, seed):
    """n packed rows' segment lists (h*w + class tokens an image): documents (their image tokens h*w/4 plus the
    text) packed into seq_len tokens as RealData.window packs a window."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        segs, tokens = [], []
        for _ in range(packing.WINDOW):
            text = int(min(rng.lognormvariate(5.3, 0.9), 9000))
            grids = radio.compute_params(image_sizes(rng), max(cfg.seq_len - text, 0), cfg.min_num_patches,
                                         cfg.max_num_patches, cfg.vit_patch)
            segs.append([h * w + cfg.class_token_len for h, w in grids])
            tokens.append(min(text + sum(h * w // 4 for h, w in grids), cfg.seq_len))
        rows += [[s for d in row for s in segs[d]] for row in packing.best_fit_decreasing(tokens, cfg.seq_len)]
    return rows[:n]


# ---------------------------------------------------------------- ways to run a packed micro-batch
# q, k, v: [S, A, d] views of one [S, 3, A, d] GEMM output, as radio.Block makes them; lens: the segments

def split_heads_first(q, k, v, lens):   # radio.py at 38a560c: [1, A, S, d] views split along S, joined along S
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    return torch.cat([F.scaled_dot_product_attention(a, b, c) for a, b, c in
                      zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2))], 2)[0].transpose(0, 1)


def rows(q, k, v, lens, contiguous=False):   # segments cut along S of [S, A, d], outputs joined along S
    outs, at = [], 0
    for n in lens:
        a, b, c = (t[at:at + n].contiguous() if contiguous else t[at:at + n] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (a, b, c)))[0].transpose(0, 1))
        at += n
    return torch.cat(outs, 0)


def rows_contiguous(q, k, v, lens):
    return rows(q, k, v, lens, True)


def heads_contiguous(q, k, v, lens):   # contiguous [1, A, S_i, d] segments, and their outputs' gradients
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    outs = []
    for a, b, c in zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2)):
        o = F.scaled_dot_product_attention(a.contiguous(), b.contiguous(), c.contiguous())
        if o.requires_grad:
            o.register_hook(lambda g: g.contiguous())
        outs.append(o)
    return torch.cat(outs, 2)[0].transpose(0, 1)


def varlen(q, k, v, lens):   # flash's variable-length kernel: every segment in one call, [S, A, d] as it is
    from torch.nn.attention.varlen import varlen_attn
    cu = torch.tensor([0] + list(lens), device=q.device).cumsum(0).to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max(lens), max(lens))


LAYOUTS = {"split-heads-first": split_heads_first, "rows": rows, "rows-contiguous": rows_contiguous,
           "heads-contiguous": heads_contiguous, "varlen": varlen}


# ---------------------------------------------------------------- children (one CUDA context each)

def qkv(S, heads, hd, grad=True):
    g = torch.Generator("cuda").manual_seed(S)
    return [(torch.randn(1, heads, S, hd, device="cuda", generator=g, dtype=torch.bfloat16) * 0.5)
            .requires_grad_(grad) for _ in range(3)]


def shapes_child(backend, cases, heads, hd, pressure_gib):
    """One segment of each length in `cases` on one backend, fwd + bwd of contiguous q, k, v."""
    if pressure_gib:   # the caching allocator holds all but `pressure_gib` GiB: the driver has that much left
        free, _ = torch.cuda.mem_get_info()
        torch.empty(int(free - pressure_gib * 2 ** 30), dtype=torch.uint8, device="cuda")   # freed into the cache
    for S in cases:
        try:
            q, k, v = qkv(S, heads, hd)
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                o = F.scaled_dot_product_attention(q, k, v)
                o.backward(torch.ones_like(o))
            torch.cuda.synchronize()
            print(f"OK {S}", flush=True)
        except Exception as e:   # noqa: BLE001 - the finding is the error
            print(f"FAIL {S} {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            sys.exit(1)


def layouts_child(layout, cases, heads, hd, rows_):
    """Rows `cases` of `rows_` through a block's qkv GEMM and LAYOUTS[layout], forward and backward, against flash
    varlen's output and weight gradient: 'OK i out-err grad-err segments' or 'FAIL i error'."""
    C = heads * hd
    for i in cases:
        lens = rows_[i]
        try:
            g = torch.Generator("cuda").manual_seed(i)
            x = torch.randn(sum(lens), C, device="cuda", generator=g, dtype=torch.bfloat16)
            w = (torch.randn(3 * C, C, device="cuda", generator=g) * C ** -0.5).to(torch.bfloat16)
            dy = torch.randn(sum(lens), C, device="cuda", generator=g, dtype=torch.bfloat16)
            res = []
            for fn in (LAYOUTS[layout], varlen):
                wi = w.clone().requires_grad_()
                q, k, v = (x @ wi.t()).view(sum(lens), 3, heads, hd).unbind(1)
                o = fn(q, k, v, lens).reshape(sum(lens), C)
                o.backward(dy)
                torch.cuda.synchronize()
                res.append((o.detach().float(), wi.grad.float()))
            errs = [((a - b).norm() / b.norm()).item() for a, b in zip(*res)]
            print(f"OK {i} {errs[0]:.2e} {errs[1]:.2e} {len(lens)}", flush=True)
        except Exception as e:   # noqa: BLE001
            print(f"FAIL {i} {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            sys.exit(1)


def in_children(args, cases, restarts=4):
    """-> ({case: error}, {case: the OK line's numbers}): children over `cases` (`args`: this script's flags), each
    restarted after a failure at the next case."""
    failed, ok, todo = {}, {}, list(cases)
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    while todo and restarts >= 0:
        out = subprocess.run([sys.executable, __file__, *args, "--cases", ",".join(map(str, todo))],
                             capture_output=True, text=True, env=env, timeout=600)
        for line in out.stdout.splitlines():
            word, _, rest = line.partition(" ")
            case, _, more = rest.partition(" ")
            if word == "OK":
                ok[int(case)] = more
            elif word == "FAIL":
                failed[int(case)] = more
        todo = [c for c in todo if c not in ok and c not in failed]
        if out.returncode and todo and not any(line.startswith(f"FAIL {todo[0]} ") for line in
                                               out.stdout.splitlines()):
            last = out.stderr.strip().splitlines()[-1:] or ["no output"]   # died without its FAIL line
            failed[todo.pop(0)] = f"child died (exit {out.returncode}): {last[0][:300]}"
        restarts -= 1
    return failed, ok


# ---------------------------------------------------------------- timing

def timed(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def fwd_bwd(layout, lens, heads, hd):
    S, C = sum(lens), heads * hd
    x = torch.randn(S, 3 * C, device="cuda", dtype=torch.bfloat16).requires_grad_()

    def run():
        q, k, v = x.view(S, 3, heads, hd).unbind(1)
        o = LAYOUTS[layout](q, k, v, lens)
        o.backward(torch.ones_like(o))
    return run


def train(layout, argv):
    """train.py with radio.packed_attention running LAYOUTS[layout] where training runs it (CUDA, bf16)."""
    real = radio.packed_attention

    def packed_attention(q, k, v, seqlens, mode=None):
        if q.is_cuda and q.dtype == torch.bfloat16 and mode is None:
            return LAYOUTS[layout](q, k, v, list(seqlens))
        return real(q, k, v, seqlens, mode)
    radio.packed_attention = packed_attention
    sys.argv = [os.path.join(ROOT, "train.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--train":
        return train(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser()
    p.add_argument("--vision", default="vit-h")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=int, default=200, help="packed rows whose image shapes are probed")
    p.add_argument("--layout-rows", type=int, default=40, help="of them, rows run through each layout")
    p.add_argument("--pressure-gib", type=float, default=2.0)
    p.add_argument("--phases", default="shapes,layouts,time")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    a = p.parse_args()
    cfg = config.resolve("20l", {"vision": a.vision})
    heads, hd = cfg.vit_heads, cfg.vit_hidden // cfg.vit_heads
    packed = microbatches(cfg, a.rows, a.seed)
    if a.child:
        kind, name = a.child.split(":")
        cases = [int(c) for c in a.cases.split(",")]
        return (shapes_child(name, cases, heads, hd, a.pressure_gib) if kind == "shapes" else
                layouts_child(name, cases, heads, hd, packed))
    shapes = sorted({s for r in packed for s in r})
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu":
                      torch.cuda.get_device_name(), "vision": a.vision, "heads": heads, "head_dim": hd,
                      "rows": len(packed), "shapes": len(shapes), "segments_min_max": [shapes[0], shapes[-1]],
                      "tower_tokens_per_row_max": max(map(sum, packed)), "images_per_row_max": max(map(len, packed))}),
          flush=True)
    common = ["--vision", a.vision, "--rows", str(a.rows), "--seed", str(a.seed)]
    if "shapes" in a.phases:
        chosen = {}
        for S in shapes:
            chosen.setdefault(SDPBackend(torch._fused_sdp_choice(*qkv(S, heads, hd))).name, []).append(S)
        print(json.dumps({"default_choice": {k: [len(v), v[:3], v[-3:]] for k, v in chosen.items()}}), flush=True)
        for pressure in (0.0, a.pressure_gib):
            for backend in BACKENDS:
                failed, ok = in_children(common + ["--child", f"shapes:{backend}", "--pressure-gib", str(pressure)],
                                         shapes)
                print(json.dumps({"backend": backend, "driver_free_gib": pressure or "all", "ran": len(ok),
                                  "failed": len(failed), "first_failures": dict(list(failed.items())[:4])}), flush=True)
    broken = set()   # layouts that failed a row: not timed (their error could end this process's context)
    if "layouts" in a.phases:
        cases = [i for i in range(len(packed)) if len(packed[i]) > 1][:a.layout_rows]
        for name in LAYOUTS:
            failed, ok = in_children(common + ["--child", f"layouts:{name}"], cases)
            if failed:
                broken.add(name)
            worst = max((float(e) for m in ok.values() for e in m.split()[:2]), default=None)
            print(json.dumps({"layout": name, "rows": len(cases), "ran": len(ok), "failed": len(failed),
                              "worst_rel_err_vs_varlen": worst, "first_failures": dict(list(failed.items())[:3]),
                              "failed_rows": {i: packed[i] for i in list(failed)[:3]}}), flush=True)
    if "time" in a.phases:
        pick = {"mock 2048^2": [128 * 128 + cfg.class_token_len], "largest row": max(packed, key=sum),
                "most images": max(packed, key=len), "median row": sorted(packed, key=sum)[len(packed) // 2]}
        results = {}
        for batch, lens in pick.items():
            for name in LAYOUTS:
                try:
                    if name in broken:
                        raise RuntimeError("failed in the layouts phase")
                    results[(batch, name)] = timed(fwd_bwd(name, lens, heads, hd))
                except Exception as e:   # noqa: BLE001 - a layout that fails here has its error in the table
                    results[(batch, name)] = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
                print(json.dumps({"batch": batch, "segments": len(lens), "tokens": sum(lens), "layout": name,
                                  "fwd_bwd_ms": results[(batch, name)]}), flush=True)
        print(f"{'micro-batch':14s} {'segs':>4s} {'tokens':>6s} " + " ".join(f"{m:>18s}" for m in LAYOUTS))
        for batch, lens in pick.items():
            cells = [results[(batch, m)] for m in LAYOUTS]
            print(f"{batch:14s} {len(lens):4d} {sum(lens):6d} " +
                  " ".join(f"{c:18.2f}" if isinstance(c, float) else f"{'error':>18s}" for c in cells))


if __name__ == "__main__":
    main()
