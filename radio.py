"""RADIO ViT vision tower, 2x2 pixel shuffle and projector (docs/vision.md; the forward: §5-7, §11), and the image
preprocessing (token budget, resize, normalise, patchify). Tensor parallel (Megatron style) splits attention heads
and the MLP width over `tp_group`; everything else, the projector included, is replicated on every TP rank.

Shape suffixes (x_SC is [S, C]; a dim that tp splits is this rank's share of it):
  S packed sequence (every image's K class tokens and its patches)   T patches of the micro-batch (sum of h*w)
  N patches of one image (h*w)   Q tokens after the shuffle (T/4)   C ViT width   X shuffled width (4C)
  D language hidden size   A attention heads   d head dim (q_SAd: [S, A, d])   E attention width (A x d)
  M MLP width   R CPE table side   P CPE table positions (R*R)   m max(h, w)   h, w patch grid
  H, W image height, width in pixels   1, 2, 3 a batch of one, an (x, y) pair, RGB
  t frames of one item (1: an image, video_temporal_patch: a video tubelet)   G t*3p² (a tubelet's patch vector)
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import comm
import fused
import lora
import moe

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
INIT_STD = 0.02          # all block / projector weights; pos table, class tokens and embedder: docs/vision.md §3
SEED = 10000             # the tower's weights are drawn from cfg.seed + SEED (train.py: seeds)


# ---------------------------------------------------------------- position encoding (CPE, docs/vision.md §2)

def cpe_eval(table_1PC, h, w, R):
    """Eval-mode CPE: bilinear (align_corners=False) resize of the R×R table to m×m, m = max(h, w), then a
    top-left crop, so the long side spans the whole table and the aspect ratio is kept. -> [h*w, C]."""
    C = table_1PC.shape[-1]
    if (h, w) == (R, R):
        return table_1PC[0]
    t_1CRR = table_1PC.reshape(1, R, R, C).permute(0, 3, 1, 2)
    m = max(h, w)
    t_1Cmm = F.interpolate(t_1CRR.float(), size=(m, m), mode="bilinear", align_corners=False)
    return t_1Cmm[:, :, :h, :w].to(table_1PC.dtype).flatten(2)[0].t()


def cpe_random_crop(table_1PC, h, w, R):
    """Train-mode CPE (optional): sample a random window of the table and grid_sample it at h×w points.
    Draws from torch's default CPU generator: TP ranks must share that state (seed by data-parallel rank)
    because the ViT input is replicated over the TP group."""
    C = table_1PC.shape[-1]
    u = torch.rand(4).tolist()
    scale = math.sqrt(0.1) + (1 - math.sqrt(0.1)) * u[0]
    aspect = math.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * u[1])
    sx, sy = min(max(scale * aspect, 0.0), 1.0), min(max(scale / aspect, 0.0), 1.0)
    px, py = (1 - sx) * u[2], (1 - sy) * u[3]
    dev = table_1PC.device
    xs = torch.linspace(0, 1, w, device=dev) * sx + px
    ys = torch.linspace(0, 1, h, device=dev) * sy + py
    gy, gx = torch.meshgrid(ys, xs, indexing="ij")
    grid_1hw2 = (torch.stack([gx, gy], -1) * 2 - 1)[None]       # grid_sample wants (x, y) in [-1, 1]
    t_1CRR = table_1PC.reshape(1, R, R, C).permute(0, 3, 1, 2).float()
    out_1Chw = F.grid_sample(t_1CRR, grid_1hw2, mode="bilinear", padding_mode="zeros", align_corners=True)
    return out_1Chw.to(table_1PC.dtype).flatten(2)[0].t()


# ---------------------------------------------------------------- attention over a packed sequence

def packed_attention(q_SAd, k_SAd, v_SAd, seqlens, mode=None):
    """Bidirectional attention restricted to each image's segment -> [S, A, d]: mode "mask" (the CPU's) one SDPA
    call with the block-diagonal mask (O(S²) memory), "loop" (CUDA's) one unmasked SDPA call per image: cuDNN's
    kernel on Hopper, the fastest measured on ViT-H's heads of 80 (H200, torch 2.11, fwd + bwd a layer: one 2048²
    image 13.4 ms, flash varlen 21.9; 14 images of 27k tokens 7.4 ms, flash varlen 8.4; bench/attention_kernels.py).
    With several images each one's q, k, v are copied into contiguous [1, A, N, d] tensors and its output's gradient
    made contiguous: given views of the packed sequence (at an offset, with the qkv GEMM's strides) cuDNN 9.19's
    backward failed (`mha_graph.execute`), read out of bounds or returned wrong gradients on real-shaped
    micro-batches (bench/2026-11-28-real-shaped.md); one image at offset 0, the mock's layout, never did."""
    mode = mode or ("loop" if q_SAd.is_cuda else "mask")
    q, k, v = (t.transpose(0, 1)[None] for t in (q_SAd, k_SAd, v_SAd))   # [1, A, S, d]: 4-D, or no flash
    if mode == "mask" and len(seqlens) > 1:
        seg_S = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens)).to(q.device)
        o_1ASd = F.scaled_dot_product_attention(q, k, v, attn_mask=seg_S[:, None] == seg_S[None, :])
    elif len(seqlens) == 1:
        o_1ASd = F.scaled_dot_product_attention(q, k, v)
    else:
        outs = []
        for qi, ki, vi in zip(q.split(seqlens, 2), k.split(seqlens, 2), v.split(seqlens, 2)):
            o_1ANd = F.scaled_dot_product_attention(qi.contiguous(), ki.contiguous(), vi.contiguous())
            if o_1ANd.requires_grad:
                o_1ANd.register_hook(torch.Tensor.contiguous)   # its gradient is a strided slice of the cat's
            outs.append(o_1ANd)
        o_1ASd = torch.cat(outs, 2)
    return o_1ASd[0].transpose(0, 1)


# ---------------------------------------------------------------- transformer block (docs/vision.md §4)

def _linear(n_in, n_out, bias=True):
    # No constructor init: it would draw from the RNG by LOCAL shape; reset_parameters draws full shapes instead.
    # On the meta device (init.build, the memory plan) the init does nothing to skip, and skip_init would put the
    # weights on the CPU through torch's meta empty_like, whose first call imports sympy (1 s of every start-up)
    if torch.get_default_device().type == "meta":
        return nn.Linear(n_in, n_out, bias=bias)
    return nn.utils.skip_init(nn.Linear, n_in, n_out, bias=bias)


class Block(nn.Module):
    """timm pre-LN ViT block; heads and MLP width split over tp_group (qkv/fc1 column-, proj/fc2 row-parallel)."""

    def __init__(self, cfg, tp_group=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        C, M = cfg.vit_hidden, cfg.vit_mlp
        assert cfg.vit_heads % tp == 0 and M % tp == 0, "vision TP size must divide vit_heads and vit_mlp"
        self.tp_group, self.heads, self.hd = tp_group, cfg.vit_heads // tp, C // cfg.vit_heads
        Cl, Ml = C // tp, M // tp
        self.norm1 = nn.LayerNorm(C, eps=1e-6)
        # Names follow timm (blocks.{i}.attn.qkv, .mlp.fc1 ...) so HF keys map 1:1 (docs/vision.md §10).
        self.attn = nn.ModuleDict(dict(qkv=_linear(C, 3 * Cl), proj=_linear(Cl, C)))
        self.norm2 = nn.LayerNorm(C, eps=1e-6)
        self.mlp = nn.ModuleDict(dict(fc1=_linear(C, Ml), fc2=_linear(Ml, C)))
        # Full qkv rows are [q all heads | k all heads | v all heads]; each block is split by heads, so a rank
        # holds [q_r | k_r | v_r] (rank r's heads of each). proj / fc2 split their input columns; their
        # biases are replicated and added once after the all-reduce.
        comm.mark_shard(self.attn.qkv.weight, ("tp", 0, [C, C, C]))
        comm.mark_shard(self.attn.qkv.bias, ("tp", 0, [C, C, C]))
        comm.mark_shard(self.attn.proj.weight, ("tp", 1, None))
        comm.mark_shard(self.mlp.fc1.weight, ("tp", 0, None))
        comm.mark_shard(self.mlp.fc1.bias, ("tp", 0, None))
        comm.mark_shard(self.mlp.fc2.weight, ("tp", 1, None))

    def forward(self, x_SC, seqlens):
        S, g = x_SC.shape[0], self.tp_group
        y_SC = comm.copy_to(fused.layer_norm(x_SC, self.norm1), g)
        q, k, v = self.attn.qkv(y_SC).view(S, 3, self.heads, self.hd).unbind(1)  # scale = hd^-0.5 (SDPA default)
        o_SE = packed_attention(q, k, v, seqlens).reshape(S, self.heads * self.hd)
        x_SC = x_SC + self.row_parallel(self.attn.proj, o_SE)
        y_SC = comm.copy_to(fused.layer_norm(x_SC, self.norm2), g)
        h_SM = F.gelu(self.mlp.fc1(y_SC))                                        # exact erf GELU
        return x_SC + self.row_parallel(self.mlp.fc2, h_SM)

    def row_parallel(self, linear, x):
        """The bias is added once, after the sum over tp ranks; on one rank inside the GEMM (no extra pass). A LoRA
        adapter's partial product goes through the same sum (lora.py's row-parallel rule)."""
        if comm.group_size(self.tp_group) == 1:
            return linear(x)
        y = lora.add_adapter(linear, (x,), F.linear(x, linear.weight))
        return comm.reduce_from(y, self.tp_group) + linear.bias


def flops(cfg, grids, tower_trains, frames=None):
    """FLOPs of one vision forward (+ backward where needed) over images and video tubelets with patch grids
    `grids` (frames: t per item, 1 for an image; a tubelet's embedder is t times wider).
    A frozen tower runs forward only (x1), the projector always trains (x3)."""
    C, M, K = cfg.vit_hidden, cfg.vit_mlp, cfg.class_token_len
    block_params = 4 * C * C + 2 * C * M
    tower = proj = 0
    for (h, w), t in zip(grids, frames or [1] * len(grids)):
        S = h * w + K
        tower += 2 * S * (block_params * cfg.vit_depth + t * 3 * cfg.vit_patch ** 2 * C) + 4 * S * S * C * cfg.vit_depth
        proj += 2 * (h * w // 4) * (4 * C * cfg.projector_hidden + cfg.projector_hidden * cfg.hidden_size)
    return tower * (3 if tower_trains else 1) + 3 * proj


def facts(cfg, S, Q, tp=1, tower_trains=True):
    """What the plan and the cost model count of the tower and projector over S tower tokens and Q projector rows on
    one rank: saved, the bytes autograd keeps for backward (a frozen tower nothing, the projector its inputs: the
    shuffled rows in fp32 and bf16, its hidden layer's before the squared ReLU, which moe.relu2_down recomputes);
    sends, {"tp": (bytes, all-reduces)} of the blocks' row-parallel outputs, forward (and backward where the tower
    trains)."""
    C = cfg.vit_hidden
    projector = 4 * Q * 4 * C + 2 * Q * 4 * C + 2 * Q * cfg.projector_hidden
    per_block = 2 * S * C * 4 + 2 * S * (3 * C + C) / tp + 2 * 2 * S * cfg.vit_mlp / tp + 4 * S * cfg.vit_heads / tp
    count = cfg.vit_depth * (4 if tower_trains else 2) * (tp > 1)
    return {"saved": cfg.vit_depth * per_block * tower_trains + projector,
            "sends": {"tp": (count * (2 * (tp - 1) / tp) * 2 * S * C, count)}}


def rule(name, C):
    """How tower parameter `name` (width C) is drawn, as comm.draw takes it: (full shape, generator) -> tensor."""
    def draw(shape, gen):
        if name in ("pos_embed", "cls_token"):
            return torch.randn(shape, generator=gen) * C ** -0.5     # RADIO ViTPatchGenerator / ClsToken
        if name in ("embedder.weight", "video_embedder.weight"):
            return torch.randn(shape, generator=gen)                 # N(0, 1), as Megatron for a fresh embedder
        if "norm" in name or name == "mlp1.0.weight":
            return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        if name.endswith("bias"):
            return torch.zeros(shape)
        return torch.randn(shape, generator=gen) * INIT_STD
    return draw


# ---------------------------------------------------------------- pixel shuffle (docs/vision.md §6)

def pixel_shuffle(x_NC, h, w):
    """InternVL v2 2x2 shuffle of one image's row-major [h*w, C] features -> [(h/2)*(w/2), 4C].
    Output token (i, j) = [x(2i,2j), x(2i,2j+1), x(2i+1,2j), x(2i+1,2j+1)] (channel block 2*dy + dx)."""
    assert h % 2 == 0 and w % 2 == 0, f"pixel shuffle needs an even grid, got {h}x{w}"
    C = x_NC.shape[-1]
    x = x_NC.reshape(h // 2, 2, w // 2, 2, C)            # (i, dy, j, dx, c)
    return x.permute(0, 2, 1, 3, 4).reshape((h // 2) * (w // 2), 4 * C)


# ---------------------------------------------------------------- the model

class VisionModel(nn.Module):
    """RADIO ViT + pixel shuffle + projector. forward(patches, grids) -> [sum h*w/4, hidden_size]."""

    def __init__(self, cfg, tp_group=None):
        super().__init__()
        self.cfg, self.tp_group = cfg, tp_group
        C, K, R, p = cfg.vit_hidden, cfg.class_token_len, cfg.vit_cpe_grid, cfg.vit_patch
        self.embedder = _linear(3 * p * p, C, bias=False)         # Linear on flattened patches, not a conv
        if cfg.video_temporal_patch:                                 # tubelets: t frames' patches in one vector
            self.video_embedder = _linear(cfg.video_temporal_patch * 3 * p * p, C, bias=False)
        self.pos_embed = nn.Parameter(torch.empty(1, R * R, C))      # CPE table, row-major over R×R
        self.cls_token = nn.Parameter(torch.empty(K, C))             # cls + register tokens, no pos-enc
        self.blocks = nn.ModuleList(Block(cfg, tp_group) for _ in range(cfg.vit_depth))
        # HF `mlp1` = Sequential(RMSNorm, Linear, ReLU², Linear): keep its indices 0, 1, 3 as names.
        self.mlp1 = nn.ModuleDict({"0": fused.RMSNorm(4 * C, eps=1e-5),
                                   "1": _linear(4 * C, cfg.projector_hidden, bias=False),
                                   "3": _linear(cfg.projector_hidden, cfg.hidden_size, bias=False)})
        if cfg.num_nextn_predict_layers:   # Megatron gives every block built from a config with MTP a final norm,
            self.final_layernorm = nn.LayerNorm(C, eps=1e-6)   # the tower too: before the shuffle (3.5 Super VL)
        self.reset_parameters()

    def reset_parameters(self):
        """Draw every parameter at its full shape from (cfg.seed + SEED, its name) on the CPU and keep this rank's
        shard (comm.init_shard): the same weights on any layout and device, each independent of the others."""
        if self.pos_embed.is_meta:                                   # sizing only (dry run): nothing to draw
            return
        ranks, sizes = {"tp": comm.group_rank(self.tp_group)}, {"tp": comm.group_size(self.tp_group)}
        for name, prm in self.named_parameters():
            comm.init_shard(prm, name, self.cfg.seed + SEED, rule(name, self.cfg.vit_hidden), ranks, sizes, "cpu")

    def embed(self, patches, lens, frames):
        """Patch rows -> [T, C] in item order: an image's rows through `embedder`, a tubelet's t rows per patch (its
        frames' 3p² vectors, docs/vision.md §11) as one [N, t*3p²] vector each through `video_embedder`."""
        if all(t == 1 for t in frames):
            return self.embedder(patches.to(self.embedder.weight.dtype))
        if not hasattr(self, "video_embedder"):
            raise ValueError("video tubelets given to a tower without a video embedder (video_temporal_patch 0)")
        items = patches.to(self.embedder.weight.dtype).split([n * t for n, t in zip(lens, frames)])
        out = {}
        for video, linear in ((False, self.embedder), (True, self.video_embedder)):
            mine = [x.reshape(n, -1) for x, n, t in zip(items, lens, frames) if (t > 1) == video]
            out[video] = iter(linear(torch.cat(mine)).split([x.shape[0] for x in mine]) if mine else ())
        return torch.cat([next(out[t > 1]) for t in frames])

    def features(self, patches, grids, frames=None):
        """ViT output with class tokens removed: [T, C], item order, row-major within each image or tubelet.
        frames[i]: 1 for an image, t for a tubelet (whose patch rows come t per patch); default all images."""
        grids = [(int(h), int(w)) for h, w in grids]
        frames = frames or [1] * len(grids)
        if isinstance(patches, (list, tuple)):
            patches = torch.cat(list(patches))
        lens = [h * w for h, w in grids]
        assert patches.shape[0] == sum(n * t for n, t in zip(lens, frames)), \
            f"{patches.shape[0]} patch rows for grids {grids} of {frames} frames"
        K, crop = self.cfg.class_token_len, self.training and self.cfg.vit_random_crop_cpe
        cache, pos = {}, []                                          # eval CPE is the same for equal grids
        for hw in grids:
            if hw not in cache or crop:
                cache[hw] = (cpe_random_crop if crop else cpe_eval)(self.pos_embed, *hw, self.cfg.vit_cpe_grid)
            pos.append(cache[hw])
        x_TC = self.embed(patches, lens, frames) + torch.cat(pos)
        # One packed sequence [cls, img0, cls, img1, ...]; segment i = K class tokens + N_i patches.
        x_SC = torch.cat([t for c in x_TC.split(lens) for t in (self.cls_token.to(x_TC.dtype), c)])
        seqlens = [n + K for n in lens]
        for blk in self.blocks:
            x_SC = blk(x_SC, seqlens)
        return torch.cat([seg[K:] for seg in x_SC.split(seqlens)])

    def forward(self, patches, grids, frames=None):
        """patches: list of [N_i, 3p²] or packed [Σ N_i, 3p²] (normalised, patchified: docs/vision.md §1; a tubelet
        of t frames holds t rows per patch, frame by frame); grids: [(h_i, w_i)] with even h_i, w_i; frames: t_i per
        item (default all 1: images). Returns [Σ h_i*w_i/4, hidden_size] in item order."""
        if len(grids) == 0:   # text-only microbatch (its parameters step on zero gradients: optim.AdamW.finish)
            return self.mlp1["3"].weight.new_zeros(0, self.cfg.hidden_size)
        grids = [(int(h), int(w)) for h, w in grids]
        x_TC = self.features(patches, grids, frames)
        if hasattr(self, "final_layernorm"):
            x_TC = fused.layer_norm(x_TC, self.final_layernorm)
        x_QX = torch.cat([pixel_shuffle(c, h, w) for c, (h, w) in zip(x_TC.split([h * w for h, w in grids]), grids)])
        return moe.relu2_linear(self.mlp1["1"](self.mlp1["0"](x_QX)), self.mlp1["3"])   # HF mlp1 (vision.md §7)


def hf_name(key):
    """This module's full (unsharded) state-dict key -> HF Nemotron-VL key (docs/vision.md §10)."""
    if key.startswith("mlp1."):
        return key
    if key.startswith("final_layernorm."):
        return "vision_projector.vision_final_layernorm." + key.split(".", 1)[1]
    special = {"embedder.weight": "patch_generator.embedder.weight", "pos_embed": "patch_generator.pos_embed",
               "video_embedder.weight": "patch_generator.video_embedder.weight",
               "cls_token": "patch_generator.cls_token.token"}
    return "vision_model.radio_model.model." + special.get(key, key)


# ---------------------------------------------------------------- preprocessing (docs/vision.md §1, §8)

def normalize(img_3HW):
    """RGB in [0, 1] (or uint8) -> CLIP-normalised float. Called by the data pipeline, not the model."""
    img = img_3HW.float() / 255 if img_3HW.dtype == torch.uint8 else img_3HW.float()
    mean = torch.tensor(CLIP_MEAN, device=img.device)[:, None, None]
    std = torch.tensor(CLIP_STD, device=img.device)[:, None, None]
    return (img - mean) / std


def patchify(img_3HW, p):
    """[3, h*p, w*p] -> [h*w, 3p²]: tokens row-major over the grid, each vector (channel, row, col)-ordered."""
    c, H, W = img_3HW.shape
    h, w = H // p, W // p
    return img_3HW.reshape(c, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, c * p * p)


def resize(img_3HW, th, tw, p):
    """An RGB image (uint8, or float in [0, 1]) -> CLIP-normalised [3, th*p, tw*p]: bicubic with antialias
    (align_corners=False), as transformers' Omni image processor resizes. Normalising first is the same result
    (resampling is linear per channel, nothing is clamped)."""
    img = normalize(img_3HW)
    if tuple(img.shape[1:]) == (th * p, tw * p):
        return img
    return F.interpolate(img[None], size=(th * p, tw * p), mode="bicubic", align_corners=False, antialias=True)[0]


def grid_for(H, W, budget, min_patches, p=16):
    """Patch grid (th, tw) for an H×W px image under `budget` patches (docs/vision.md §8): transformers' Omni
    get_patch_grid_size, except that every side is at least 2 patches (the shuffle's minimum) where that one floors a
    thin image's short side to 0 (or divides by 0); the grid may then exceed the budget, as transformers' may."""
    ch, cw = round(H / p + 0.5), round(W / p + 0.5)      # Python round (half-to-even): docs/vision.md §8
    f = min(math.sqrt(budget / (ch * cw)), 1.0)          # never upscale here
    th, tw = max(math.floor(f * ch), 1), max(math.floor(f * cw), 1)
    if budget > min_patches and th * tw < min_patches:   # upscale small images to the minimum
        u = math.sqrt(min_patches / (th * tw))
        th, tw = math.ceil(u * th), math.ceil(u * tw)
    if th % 2:                                            # even sides for the 2x2 pixel shuffle
        th = th + 1 if (th + 1) * tw <= budget else max(2, th - 1)
    if tw % 2:
        tw = tw + 1 if th * (tw + 1) <= budget else max(2, tw - 1)
    return th, tw


def compute_params(sizes_HW, tokens_available, min_patches, max_patches, p=16):
    """Grids [(th, tw)] for images of pixel sizes [(H, W)] sharing `tokens_available` LM tokens (post-shuffle).
    Budgets are in pre-shuffle patches; max_patches = 0 means no per-image maximum."""
    n = len(sizes_HW)
    B = max(tokens_available * 4, min_patches * n)
    per = [int(max(min(B, max_patches or math.inf), min_patches))] * n
    for _ in range(10):
        grids = [grid_for(H, W, b, min_patches, p) for (H, W), b in zip(sizes_HW, per)]
        tot = sum(th * tw for th, tw in grids)
        if tot <= B:
            break
        new = [max(min_patches, int(th * tw * B / tot)) for th, tw in grids]
        per = new if any(a < b for a, b in zip(new, per)) else [min_patches] * n
    return grids
