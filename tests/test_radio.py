import math
import os
import socket
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import comm  # noqa: E402
import config  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import radio  # noqa: E402
from tests.spawn import run_distributed  # noqa: E402

P = 16


def tiny_cfg(**over):
    return config.resolve("tiny", over)


def rand_patches(grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(h * w, 3 * P * P, generator=g) for h, w in grids]


def test_packed_equals_each_image_alone():
    torch.manual_seed(0)
    cfg = tiny_cfg()
    model = radio.VisionModel(cfg).eval()
    grids = [(4, 6), (6, 2), (2, 2)]                     # landscape, portrait, square
    patches = rand_patches(grids)
    out = model(patches, grids)
    feats = model.features(torch.cat(patches), grids)     # packed tensor input form
    assert out.shape == (sum(h * w // 4 for h, w in grids), cfg.hidden_size)
    assert feats.shape == (sum(h * w for h, w in grids), cfg.vit_hidden)
    outs, start, fstart = [], 0, 0
    for x, (h, w) in zip(patches, grids):
        alone = model([x], [(h, w)])
        torch.testing.assert_close(out[start:start + h * w // 4], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats[fstart:fstart + h * w], model.features(x, [(h, w)]), atol=1e-5, rtol=1e-5)
        outs.append(alone)
        start, fstart = start + h * w // 4, fstart + h * w
    # the per-image CUDA path (SDPA loop) gives the same as the masked path, and images really interact
    # within themselves only: perturbing image 0 changes nothing in image 1
    q, k, v = torch.randn(3, 4 + 7 + 3, 2, 8).unbind(0)
    torch.testing.assert_close(radio.packed_attention(q, k, v, [4, 7, 3], "loop"),
                               radio.packed_attention(q, k, v, [4, 7, 3], "mask"), atol=1e-6, rtol=1e-6)
    bumped = [patches[0] + 1.0] + patches[1:]
    out2 = model(bumped, grids)
    assert (out2[:6] - out[:6]).abs().max() > 1e-3
    torch.testing.assert_close(out2[6:], out[6:], atol=1e-5, rtol=1e-5)


def test_fixed_path_reference():
    """Packed forward of one image == a direct transcription of docs/vision.md §4-5 with plain tensors."""
    torch.manual_seed(1)
    cfg = tiny_cfg()
    m = radio.VisionModel(cfg).eval()
    h, w = 4, 2
    x = rand_patches([(h, w)], seed=3)[0]
    C, K, H = cfg.vit_hidden, cfg.class_token_len, cfg.vit_heads
    t = x @ m.embedder.weight.T + radio.cpe_eval(m.pos_embed, h, w, cfg.vit_cpe_grid)
    t = torch.cat([m.cls_token, t])
    S = t.shape[0]
    for b in m.blocks:
        y = F.layer_norm(t, (C,), b.norm1.weight, b.norm1.bias, 1e-6)
        qkv = y @ b.attn.qkv.weight.T + b.attn.qkv.bias
        q, k, v = qkv.view(S, 3, H, C // H).permute(1, 2, 0, 3)
        a = torch.softmax(q @ k.transpose(-1, -2) * (C // H) ** -0.5, -1) @ v
        t = t + a.transpose(0, 1).reshape(S, C) @ b.attn.proj.weight.T + b.attn.proj.bias
        y = F.layer_norm(t, (C,), b.norm2.weight, b.norm2.bias, 1e-6)
        hid = y @ b.mlp.fc1.weight.T + b.mlp.fc1.bias
        hid = 0.5 * hid * (1 + torch.erf(hid / math.sqrt(2)))
        t = t + hid @ b.mlp.fc2.weight.T + b.mlp.fc2.bias
    f = t[K:]
    torch.testing.assert_close(m.features([x], [(h, w)]), f, atol=1e-4, rtol=1e-5)
    s = radio.pixel_shuffle(f, h, w)
    s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * m.mlp1["0"].weight
    ref = torch.relu(s @ m.mlp1["1"].weight.T) ** 2 @ m.mlp1["3"].weight.T
    torch.testing.assert_close(m([x], [(h, w)]), ref, atol=1e-5, rtol=1e-4)


def test_pixel_shuffle_worked_example():
    x = torch.arange(8.0)[:, None]
    assert radio.pixel_shuffle(x, 2, 4).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    x = torch.arange(24.0)[:, None]
    assert radio.pixel_shuffle(x, 4, 6).tolist() == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11],
                                                     [12, 13, 18, 19], [14, 15, 20, 21], [16, 17, 22, 23]]
    # C = 2: each block holds the full C-vector of its source token
    x = torch.stack([torch.arange(8.0), -torch.arange(8.0)], 1)
    assert radio.pixel_shuffle(x, 2, 4)[1].tolist() == [2, -2, 3, -3, 6, -6, 7, -7]


def _bilinear_ref(t_RRC, m):
    """align_corners=False: src = (dst + 0.5) * R/m - 0.5, clamped below at 0, neighbours i0, min(i0+1, R-1)."""
    R = t_RRC.shape[0]
    out = torch.zeros(m, m, t_RRC.shape[2], dtype=torch.float64)
    for oy in range(m):
        for ox in range(m):
            sy, sx = max((oy + 0.5) * R / m - 0.5, 0.0), max((ox + 0.5) * R / m - 0.5, 0.0)
            y0, x0 = int(math.floor(sy)), int(math.floor(sx))
            y1, x1 = min(y0 + 1, R - 1), min(x0 + 1, R - 1)
            ly, lx = sy - y0, sx - x0
            out[oy, ox] = ((1 - ly) * (1 - lx) * t_RRC[y0, x0] + (1 - ly) * lx * t_RRC[y0, x1]
                           + ly * (1 - lx) * t_RRC[y1, x0] + ly * lx * t_RRC[y1, x1])
    return out


def test_cpe_interpolation():
    R, C = 4, 3
    table = torch.randn(1, R * R, C, dtype=torch.float64)
    t_RRC = table[0].reshape(R, R, C)
    for h, w in [(2, 6), (6, 2), (3, 3), (8, 5), (4, 4)]:
        m = max(h, w)
        want = _bilinear_ref(t_RRC, m)[:h, :w].reshape(h * w, C)
        got = radio.cpe_eval(table.float(), h, w, R)
        assert got.shape == (h * w, C)
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    # (R, R) is the table itself; long side spans the whole table: row 0 of a 2x6 crop = row 0 of the 6x6 resize
    torch.testing.assert_close(radio.cpe_eval(table, R, R, R), table[0])
    # random-crop CPE: right shape, finite, and within the table's value range (bilinear of zero-padded table)
    torch.manual_seed(0)
    rc = radio.cpe_random_crop(table.float(), 3, 5, R)
    assert rc.shape == (15, C) and rc.abs().max() <= table.abs().max() + 1e-6


def test_token_budget_examples():
    mn, mx = 1024, 13312
    assert radio.grid_for(512, 512, mx, mn) == (32, 32)
    assert radio.grid_for(1080, 1920, 4096, mn) == (48, 84)
    assert radio.grid_for(1080, 1920, 13312, mn) == (68, 120)
    assert radio.grid_for(700, 1000, mx, mn) == (44, 64)
    assert radio.grid_for(480, 640, mx, mn) == (30, 40)
    assert radio.grid_for(60, 100, mx, mn) == (26, 44)
    assert radio.grid_for(400, 3000, 4096, mn) == (22, 172)      # round(H/p + .5) not ceil (22x176)
    # through compute_params: tokens_available is in LM tokens (x4 patches)
    assert radio.compute_params([(1080, 1920)], 1024, mn, mx) == [(48, 84)]
    assert radio.compute_params([(512, 512)], 100000, mn, mx) == [(32, 32)]
    assert radio.compute_params([(1080, 1920)], 100000, mn, mx) == [(68, 120)]
    grids = radio.compute_params([(1080, 1920), (2048, 2048)], 2048, mn, mx)   # shared budget 8192 patches
    assert sum(h * w for h, w in grids) <= 8192 and all(h % 2 == 0 and w % 2 == 0 for h, w in grids)



def test_resize_by_hand():
    """radio.resize, the one resize training uses (data.Encoder; against transformers' processor: test_hf_omni's
    test_processor_parity, where torchvision is installed). By hand: at its size an image is only normalised; a
    2 x 2 image down to one pixel is its mean (the antialiased bicubic kernel spans the four pixels, symmetric)."""
    u8 = torch.tensor([[[0, 255], [255, 0]], [[10, 20], [30, 40]], [[255, 255], [255, 255]]], dtype=torch.uint8)
    assert torch.equal(radio.resize(u8, 2, 2, 1), radio.normalize(u8))
    mean = torch.tensor([127.5, 25.0, 255.0]).view(3, 1, 1) / 255
    torch.testing.assert_close(radio.resize(u8, 1, 1, 1), (mean - torch.tensor(radio.CLIP_MEAN).view(3, 1, 1)) /
                               torch.tensor(radio.CLIP_STD).view(3, 1, 1), atol=1e-6, rtol=0)
    big = radio.resize(torch.rand(3, 50, 70), 4, 6, P)   # any size to the grid's
    assert big.shape == (3, 4 * P, 6 * P) and radio.patchify(big, P).shape == (24, 3 * P * P)


def test_patchify_and_normalize():
    p = 2
    img = torch.arange(3 * 4 * 6.0).reshape(3, 4, 6)              # h, w = 2, 3
    out = radio.patchify(img, p)
    assert out.shape == (6, 12)
    for y in range(2):
        for x in range(3):
            want = [img[c, y * p + yy, x * p + xx].item() for c in range(3) for yy in range(p) for xx in range(p)]
            assert out[y * 3 + x].tolist() == want
    assert out[1].tolist()[:4] == [2, 3, 8, 9]                    # token (0,1), channel 0: rows 0-1, cols 2-3
    white = radio.normalize(torch.ones(3, 2, 2))
    assert abs(white[0, 0, 0].item() - (1 - 0.48145466) / 0.26862954) < 1e-6
    assert torch.equal(radio.normalize(torch.full((3, 1, 1), 255, dtype=torch.uint8)), white[:, :1, :1])


def _reduced_grads(rank, world, m):
    """The gradients the optimizer's finish reduces for module m's parameters (as the tower of one vision rank)."""
    opt = optim.build(types.SimpleNamespace(vision=parallel.ModuleGroups("vision"), lm=None), m, None,
                      config.Config(), torch.device("cpu"))
    opt.finish(1, 0.0)
    return [g for b in opt.buckets for g in b.split(b.main.grad).values()]


def test_init_by_name():
    """Every tower weight is drawn from (seed, its name), comm.draw: a deeper tower (more parameters, drawn before
    the projector's) changes no other parameter's initial value; another seed changes every random one."""
    a = dict(radio.VisionModel(tiny_cfg()).named_parameters())
    b = dict(radio.VisionModel(tiny_cfg(vit_depth=3)).named_parameters())
    assert set(a) < set(b) and all(torch.equal(a[k], b[k]) for k in a)
    c = dict(radio.VisionModel(tiny_cfg(seed=7)).named_parameters())
    assert all(not torch.equal(a[k], c[k]) for k in a if a[k].unique().numel() > 1)


def test_meta_tower_stays_on_meta():
    """Built on the meta device (init.build, the memory plan) the tower allocates nothing and draws nothing: its
    weights stay meta, the RNG where it was, and torch's meta empty_like (which imports sympy) is not reached."""
    state = torch.random.get_rng_state()
    with torch.device("meta"):
        m = radio.VisionModel(tiny_cfg())
    assert all(p.is_meta for p in m.parameters())
    assert torch.equal(torch.random.get_rng_state(), state)


def test_zero_images_and_hf_names():
    cfg = tiny_cfg()
    m = radio.VisionModel(cfg)
    out = m(torch.zeros(0, 3 * P * P), [])
    assert out.shape == (0, cfg.hidden_size)
    (grads,) = run_distributed(_reduced_grads, 1, m)   # the step's reduction: a text-only encoder gets zero gradients
    assert len(grads) == len(list(m.parameters())) and all(g.abs().sum() == 0 for g in grads)
    names = {k: radio.hf_name(k) for k in m.state_dict()}     # as export_hf names the vision tensors
    assert names["embedder.weight"] == "vision_model.radio_model.model.patch_generator.embedder.weight"
    assert names["pos_embed"] == "vision_model.radio_model.model.patch_generator.pos_embed"
    assert names["cls_token"] == "vision_model.radio_model.model.patch_generator.cls_token.token"
    assert names["blocks.1.attn.qkv.weight"] == "vision_model.radio_model.model.blocks.1.attn.qkv.weight"
    assert names["blocks.0.mlp.fc2.bias"] == "vision_model.radio_model.model.blocks.0.mlp.fc2.bias"
    assert {names[f"mlp1.{i}.weight"] for i in (0, 1, 3)} == {"mlp1.0.weight", "mlp1.1.weight", "mlp1.3.weight"}
    assert len(set(names.values())) == len(names)
    assert m.state_dict()["mlp1.1.weight"].shape == (cfg.projector_hidden, 4 * cfg.vit_hidden)


# ---------------------------------------------------------------- tensor parallel, 2 gloo processes

def _tp_worker(rank, port, world):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = tiny_cfg()
        torch.manual_seed(0)
        full = radio.VisionModel(cfg)
        torch.manual_seed(0)
        tp = radio.VisionModel(cfg, tp_group=dist.group.WORLD)
        fp, tpp = dict(full.named_parameters()), dict(tp.named_parameters())
        n_sharded = 0
        for name, prm in tpp.items():
            (_, dim, seg), = getattr(prm, "shards", (("tp", None, None),))
            want = fp[name].detach() if dim is None else comm.shard(fp[name].detach(), dim, rank, world, seg)
            assert torch.equal(prm.detach(), want), f"init of {name} is not shard(full)"  # same-seed init
            with torch.no_grad():
                prm.copy_(want + 0.01 * torch.randn_like(want) if dim is None else want)  # explicit load
                if dim is None:
                    fp[name].copy_(prm)
            n_sharded += dim is not None
        assert n_sharded == 6 * cfg.vit_depth
        grids = [(4, 2), (2, 6)]
        x_full = torch.cat(rand_patches(grids, seed=5)).requires_grad_()
        x_tp = x_full.detach().clone().requires_grad_()
        out_full, out_tp = full(x_full, grids), tp(x_tp, grids)
        torch.testing.assert_close(out_tp, out_full, atol=1e-5, rtol=1e-5)
        g = torch.randn(out_full.shape, generator=torch.Generator().manual_seed(7))
        (out_full * g).sum().backward()
        (out_tp * g).sum().backward()
        torch.testing.assert_close(x_tp.grad, x_full.grad, atol=1e-5, rtol=1e-5)
        for name, prm in tpp.items():
            (_, dim, seg), = getattr(prm, "shards", (("tp", None, None),))
            if dim is None:
                torch.testing.assert_close(prm.grad, fp[name].grad, atol=1e-5, rtol=1e-5, msg=name)
                continue
            for what in ("data", "grad"):
                local = getattr(prm, what).contiguous()
                parts = [torch.empty_like(local) for _ in range(world)]
                dist.all_gather(parts, local)
                ref = getattr(fp[name], what)
                torch.testing.assert_close(comm.unshard(parts, dim, seg), ref, atol=1e-5, rtol=1e-5,
                                           msg=f"{name}.{what}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_matches_single_device():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(port, 2), nprocs=2, join=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
