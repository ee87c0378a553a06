"""Hybrid Mamba2 / attention / MoE decoder (Nemotron 3 Nano and Super families) and the VLM wiring around it.

    h = embeddings(ids)                         # vocab-parallel, no position embedding
    for each layer (pattern char M * E -):  h = h + mixer(RMSNorm(h))
    logits = lm_head(norm_f(h))                 # untied, vocab-parallel; loss without a full-vocab gather
    Super: LatentMoE experts (moe.py) and multi-token prediction (MTP, mtp_losses: docs/super.md §3-4)

Module names equal the HF NemotronH checkpoint names (backbone.layers.{i}.mixer.…), except that a layer's routed
experts are stacked into experts.up_proj [E, F, D] / experts.down_proj [E, D, F] for grouped GEMM.
Every module takes its process groups (None = single device); local shapes are the full shapes / group size.

Shape suffixes (h_BLD is [B, L, D]; a tensor holds this rank's share of a dim tp splits): B batch, L sequence (a
whole row), M this cp rank's positions of a row (cp.py; M = L without context parallelism), D hidden size, N token
positions (B x M flattened), V vocab, E routed experts, F expert ffn width, H attention heads, G KV heads, K head dim.

Context parallelism (cp.py, docs/cp.md): the language model's activations, labels and padding mask hold this cp
rank's positions, seq_idx (document ids) always the whole rows in natural order.
"""
import dataclasses
import math
import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import comm
import config
import cp
import fused
import mamba
import moe
from fused import RMSNorm
from mamba import Mamba2Mixer
from moe import MLP, MoE

CE_CHUNK = 8192   # tokens a head + cross-entropy chunk holds under activation checkpointing (loss_sum)
SEED = 20000   # the language model's weights are drawn from cfg.seed + SEED (train.py: seeds)


class Attention(nn.Module):
    """Causal GQA, no RoPE, no bias; heads and KV groups split over tp; documents masked when packed. Under cp the
    queries are this rank's positions and K / V are gathered from the whole row (cp.py)."""

    def __init__(self, cfg, tp_group=None, cp_group=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        self.tp_group, self.cp_group, self.head_dim = tp_group, cp_group, cfg.head_dim
        self.n_heads, self.n_kv = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
        D = cfg.hidden_size
        self.q_proj = nn.Linear(D, self.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * cfg.head_dim, D, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            comm.mark_shard(lin.weight, ("tp", 0, None))
        comm.mark_shard(self.o_proj.weight, ("tp", 1, None))

    def forward(self, x_BMD, seq_idx=None, valid_BL=None):
        Bsz, M, _ = x_BMD.shape
        x_BMD = comm.copy_to(x_BMD, self.tp_group)
        q = self.q_proj(x_BMD).view(Bsz, M, self.n_heads, self.head_dim).transpose(1, 2)
        k = cp.gather(self.k_proj(x_BMD), self.cp_group)
        v = cp.gather(self.v_proj(x_BMD), self.cp_group)
        L = k.shape[1]
        k, v = (t.view(Bsz, L, self.n_kv, self.head_dim).transpose(1, 2) for t in (k, v))
        o = attend(q, k, v, cp.spans(L, comm.group_rank(self.cp_group), comm.group_size(self.cp_group)), seq_idx)
        o = o.transpose(1, 2).reshape(Bsz, M, self.n_heads * self.head_dim)
        return comm.reduce_from(self.o_proj(o), self.tp_group)


def attention_facts(cfg, seq_len, T=0, tp=1, cp=1, ep=1, etp=1):
    """What the plan and the cost model count of one attention layer (kind_facts): the causal scores and values,
    2 x 2 x (seq / 2) x heads x head dim a token, x3; the saved inputs of its projections, SDPA's output and
    logsumexp, and under cp the whole rows' K and V, which cp exchanges."""
    nh, nkv, hd, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    kv = 2 * T * 2 * nkv * hd / tp
    return {"flops": 3 * 2 * seq_len * nh * hd, "idle": 0,
            "saved": 2 * T * D + 2 * T * (nh + 2 * nkv * cp) * hd / tp + 2 * 2 * T * nh * hd / tp + 4 * T * nh / tp,
            "exchange": 2 * 2 * T * cp * 2 * nkv * hd / tp,
            "sends": {"tp": (2 * (tp - 1) / tp * 2 * T * D, 1), "cp": ((cp - 1) * kv, 1)}}


def attend(q_BHMK, k_BGLK, v_BGLK, spans, seq_idx_BL=None):
    """Causal attention of the queries at row positions `spans` (cp.spans: contiguous chunks, in the queries'
    order) over the whole row's keys: each chunk reads the keys up to its end. Memory stays linear in the sequence:
    unpacked rows use no mask tensor (is_causal, or the lower-right causal bias of a chunk that does not start the
    row: the flash / efficient kernels); packed rows (seq_idx: key s <= query t, same document) a block-sparse
    FlexAttention mask on CUDA, a boolean mask on the CPU (the reference it is tested against).
    (K: head dim, G: KV heads, S: a chunk's keys.)"""
    out, start = [], 0
    for a, b in spans:
        q = q_BHMK[:, :, start:start + b - a]
        start += b - a
        k, v = k_BGLK[:, :, :b], v_BGLK[:, :, :b]
        if seq_idx_BL is not None and q.is_cuda:
            out.append(_document_flex(q, k, v, seq_idx_BL, a))
        elif seq_idx_BL is not None:
            pos = torch.arange(b, device=q.device)
            doc = seq_idx_BL[:, :b]
            mask = (pos[None, :] <= pos[a:, None]) & (doc[:, a:, None] == doc[:, None, :])
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True))
        elif a == 0:
            out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        else:
            from torch.nn.attention.bias import causal_lower_right   # imports torch._dynamo: not at import time
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(b - a, b), enable_gqa=True))
    return torch.cat(out, 2) if len(out) > 1 else out[0]


_FLEX = {}   # the compiled FlexAttention and mask builder, and the last micro-batch's block masks (shared by layers)


def _document_flex(q_BHMK, k_BGSK, v_BGSK, seq_idx_BL, offset):
    """Document-causal attention through FlexAttention: queries at row positions offset .. offset + M, keys 0 .. S.
    Its block mask skips the blocks no query reads (other documents, the future), so neither time nor memory is
    quadratic in a row of short documents. A micro-batch's masks are built once and reused by every layer: the
    cache is keyed by the seq_idx tensor itself (train.py makes one per micro-batch; holding it keeps its memory
    from being reused by the next one)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        _FLEX.update(attn=torch.compile(flex_attention), mask=torch.compile(create_block_mask), key=None)
    if _FLEX["key"] is not seq_idx_BL:
        _FLEX.update(key=seq_idx_BL, masks={})
    M, S = q_BHMK.shape[2], k_BGSK.shape[2]
    if (offset, M, S) not in _FLEX["masks"]:
        doc_BS = seq_idx_BL[:, :S].contiguous()

        def same_document_causal(b, h, qi, ki):
            return (ki <= qi + offset) & (doc_BS[b, qi + offset] == doc_BS[b, ki])
        _FLEX["masks"][(offset, M, S)] = _FLEX["mask"](same_document_causal, doc_BS.shape[0], None, M, S,
                                                      device=q_BHMK.device)
    return _FLEX["attn"](q_BHMK, k_BGSK, v_BGSK, block_mask=_FLEX["masks"][(offset, M, S)], enable_gqa=True)


# Each layer kind, by its hybrid_override_pattern character: its mixer, built from (cfg, groups, dispatcher) and
# called on the normed input with keywords seq_idx and valid_BL (each mixer takes both, so a Block calls any kind
# alike), and its facts (kind_facts). A new kind is a row here and one in config.LAYER_KINDS (what the config and
# layout checks know of it).
KINDS = {
    "M": (lambda cfg, g, d: Mamba2Mixer(cfg, g.get("tp"), g.get("cp")), mamba.facts),
    "*": (lambda cfg, g, d: Attention(cfg, g.get("tp"), g.get("cp")), attention_facts),
    "E": (lambda cfg, g, d: MoE(cfg, g.get("tp"), g.get("ep"), g.get("etp"), d, g.get("cp")), moe.moe_facts),
    "-": (lambda cfg, g, d: MLP(cfg.hidden_size, cfg.intermediate_size, g.get("tp")), moe.mlp_facts),
}


class Block(nn.Module):
    def __init__(self, kind, cfg, groups, dispatcher):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mixer = KINDS[kind][0](cfg, groups, dispatcher)

    def forward(self, h, seq_idx=None, valid=None):
        return h + self.mixer(self.norm(h), seq_idx=seq_idx, valid_BL=valid)


def kind_facts(cfg, kind, seq_len, T=0, tp=1, cp=1, ep=1, etp=1):
    """One layer of `kind`, as the memory plan and the cost model count it ({T} tokens a rank, this rank's tp, cp,
    ep and etp shares): flops, its training FLOPs a token besides 6 x its active parameters; idle, its parameters a
    token does not run; saved, the bytes autograd keeps of its mixer for backward (bf16); exchange, the bytes of cp's
    send and receive buffers while its backward runs; sends, {group: (bytes a rank sends, collectives)} a pass. A
    kind without a row (a fork's new character, before its facts) is estimated as the known kind that saves the
    most, never a KeyError inside the plan."""
    if kind in KINDS:
        return KINDS[kind][1](cfg, seq_len, T, tp, cp, ep, etp)
    return max((f(cfg, seq_len, T, tp, cp, ep, etp) for _, f in KINDS.values()), key=lambda f: f["saved"])


def planned(cfg):
    """cfg with each kind KINDS lacks as the known kind that kind_facts estimates it by: the plan's meta model."""
    stand_in = max(KINDS, key=lambda k: kind_facts(cfg, k, 1, 1)["saved"])
    return dataclasses.replace(cfg, **{f: "".join(k if k in KINDS else stand_in for k in getattr(cfg, f))
                                       for f in ("hybrid_override_pattern", "mtp_pattern")})


class VocabEmbedding(nn.Module):
    """Rows [V/tp * rank, V/tp * (rank+1)) of the table; ids elsewhere look up zero, then sum over tp."""

    def __init__(self, vocab, dim, tp_group=None):
        super().__init__()
        self.tp_group = tp_group
        local = vocab // comm.group_size(tp_group)
        self.start = local * comm.group_rank(tp_group)
        self.weight = nn.Parameter(torch.empty(local, dim))
        comm.mark_shard(self.weight, ("tp", 0, None))

    def forward(self, ids):
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        h = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[..., None]
        return comm.reduce_from(h, self.tp_group)


class LanguageModel(nn.Module):
    """The decoder, or with stage = (s, p) its pipeline stage s of p (stage_layers, `split`: the layout's): the layers
    of that stage under their global names (backbone.layers.{i}), the embedding on the first stage, norm_f, the head
    and MTP on the last."""

    def __init__(self, cfg, groups=None, dispatcher="alltoall", stage=(0, 1), split=()):
        super().__init__()
        groups = groups or {}
        self.cfg, self.tp_group, self.cp_group = cfg, groups.get("tp"), groups.get("cp")
        tp = comm.group_size(self.tp_group)
        if cfg.vocab_size % tp:
            raise ValueError(f"vocab_size {cfg.vocab_size} is not divisible by tp {tp}")
        self.first, self.last = stage[0] == 0, stage[0] == stage[1] - 1
        self.backbone = nn.Module()
        if self.first:
            self.backbone.embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, self.tp_group)
        self.backbone.layers = nn.ModuleDict({str(i): Block(cfg.hybrid_override_pattern[i], cfg, groups, dispatcher)
                                              for i in stage_layers(cfg, stage[1], split)[stage[0]]})
        if self.last:
            self.backbone.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // tp, bias=False)
            comm.mark_shard(self.lm_head.weight, ("tp", 0, None))
            if cfg.num_nextn_predict_layers:
                self.mtp = MTP(cfg, groups, dispatcher)
        self.checkpoint_layers = cfg.activation_checkpointing

    def embed(self, input_ids):
        return self.backbone.embeddings(input_ids)

    def begin_step(self, aux_scale):
        """Once before a step's micro-batches: the routers' aux-loss scale (moe.set_aux_loss_scale)."""
        moe.set_aux_loss_scale(self, aux_scale)

    def end_step(self, rate=None, group=None):
        """Once after a step: the routers' bias update from the step's expert counts summed over `group` -> those
        counts (None without MoE layers); rate None, a dropped step's (failsafe.abandon_step): they are discarded."""
        return moe.update_expert_bias(self, rate, group)

    def forward(self, h_BMD, seq_idx=None, valid=None):
        """Embedded input (image rows already placed), or the previous stage's output -> final normed hidden
        states (the last stage's; before norm_f on the others). seq_idx [B, L]: document ids of packed rows;
        valid [B, M]: False on padding, which MoE layers neither count nor balance."""
        if torch.is_autocast_enabled(h_BMD.device.type):  # residual stream in bf16 (residual_in_fp32 false)
            h_BMD = h_BMD.to(torch.get_autocast_dtype(h_BMD.device.type))
        h_BMD = self._layers(self.backbone.layers.values(), h_BMD, seq_idx, valid)
        return self.backbone.norm_f(h_BMD) if self.last else h_BMD

    def _layers(self, layers, h_BMD, seq_idx, valid):
        for layer in layers:
            if self.checkpoint_layers and torch.is_grad_enabled():
                h_BMD = torch.utils.checkpoint.checkpoint(layer, h_BMD, seq_idx, valid, use_reentrant=False)
            else:
                h_BMD = layer(h_BMD, seq_idx, valid)
        return h_BMD

    def mtp_losses(self, hidden_BMD, h_BMD, labels_BL, seq_idx=None, valid=None):
        """Multi-token prediction (docs/super.md §3-4): for depth k = 1 .. mtp.depths, the sum of its token
        cross-entropies on the tokens k + 1 ahead. hidden: forward()'s output (depth 0); h: forward()'s input, the
        embedded tokens with image rows placed (rolled left k: the token k ahead's); labels: the whole rows. Depth
        k runs MTP block (k - 1) mod num_nextn_predict_layers on cat[enorm(embedding), hnorm(previous depth)],
        through the shared output head. Under cp the embedding k ahead may be another rank's: h's whole rows are
        gathered first."""
        sums, P, at = [], len(self.cfg.mtp_pattern), (comm.group_rank(self.cp_group), comm.group_size(self.cp_group))
        h_BLD = cp.gather(h_BMD, self.cp_group)
        for k in range(1, self.mtp.depths + 1):
            b = (k - 1) % self.cfg.num_nextn_predict_layers
            first, layers = self.mtp.layers[b * P], self.mtp.layers[b * P:(b + 1) * P]
            e_BMD = cp.local(h_BLD.roll(-k, 1), *at).to(hidden_BMD.dtype)
            x = first.eh_proj(torch.cat([first.enorm(e_BMD), first.hnorm(hidden_BMD)], -1))
            hidden_BMD = layers[-1].final_layernorm(self._layers(layers, x, seq_idx, valid))
            sums.append(self.loss_sum(hidden_BMD, cp.local(mtp_labels(labels_BL, seq_idx, k), *at))[0])
        return sums

    def logits(self, hidden):
        """This rank's vocab slice of the logits (the full logits when tp = 1)."""
        return self.lm_head(comm.copy_to(hidden, self.tp_group))

    def loss_sum(self, hidden, labels):
        """Sum of token cross-entropies over labels != -100, and their count (for per-token normalisation).
        Under activation checkpointing the head and loss run CE_CHUNK tokens at a time, each chunk's logits
        recomputed in backward: the logits of a long row (65536 x 131072 x 2 bytes = 16 GiB, and their gradient)
        are never alive at once, one chunk's are."""
        count = (labels != -100).sum()
        h_ND, t_N = hidden.flatten(0, 1), labels.flatten()
        if not (self.checkpoint_layers and torch.is_grad_enabled()) or len(t_N) <= CE_CHUNK:
            return self._chunk_loss(h_ND, t_N), count
        return sum(torch.utils.checkpoint.checkpoint(self._chunk_loss, h, t, use_reentrant=False)
                   for h, t in zip(h_ND.split(CE_CHUNK), t_N.split(CE_CHUNK))), count

    def _chunk_loss(self, h_ND, t_N):
        return vocab_parallel_cross_entropy(self.logits(h_ND), t_N, self.tp_group).sum()


class MTP(nn.Module):
    """cfg.num_nextn_predict_layers blocks of cfg.mtp_pattern layers, flattened as HF names them: layer
    b * len(mtp_pattern) + s is sublayer s of block b; a block's first layer also holds enorm, hnorm and eh_proj
    ([D, 2D]: the embedding's columns first), its last final_layernorm (docs/super.md §3). Training runs
    cfg.mtp_depths depths (default one a block); more depths than blocks share them."""

    def __init__(self, cfg, groups, dispatcher):
        super().__init__()
        self.depths = mtp_depths(cfg)
        self.layers = nn.ModuleList(Block(k, cfg, groups, dispatcher) for _ in range(cfg.num_nextn_predict_layers)
                                    for k in cfg.mtp_pattern)
        P, D = len(cfg.mtp_pattern), cfg.hidden_size
        for b in range(cfg.num_nextn_predict_layers):
            first, last = self.layers[b * P], self.layers[(b + 1) * P - 1]
            first.enorm, first.hnorm = RMSNorm(D, cfg.norm_eps), RMSNorm(D, cfg.norm_eps)
            first.eh_proj = nn.Linear(2 * D, D, bias=False)   # replicated over tp, as the residual stream is
            last.final_layernorm = RMSNorm(D, cfg.norm_eps)


def mtp_depths(cfg):
    """How many MTP depths a run trains (0 without MTP blocks)."""
    return cfg.mtp_depths or cfg.num_nextn_predict_layers


def mtp_labels(labels_BL, seq_idx_BL, k):
    """Depth k's targets: the labels rolled left k (token i + k + 1), none in the last k positions of a row or where
    position i + k is in another document than i (packed rows). Works on the host (counts) and the device."""
    out = labels_BL.roll(-k, -1)
    out[..., -k:] = -100
    if seq_idx_BL is not None:
        out[seq_idx_BL.roll(-k, -1) != seq_idx_BL] = -100
    return out


def vocab_parallel_cross_entropy(logits_NV, targets_N, group=None):
    """Per-token CE over a vocab split across `group`; no rank ever holds the full logits. -100 -> loss 0."""
    return _VocabParallelCE.apply(logits_NV, targets_N, group)


class _VocabParallelCE(torch.autograd.Function):
    """Softmax cross-entropy on a vocab shard with no fp32 copy of the logits: forward keeps one logsumexp per
    row (over all shards, combined from each shard's own), backward rebuilds the softmax from the logits in the
    same single pass that writes the gradient (fused.cross_entropy_grad)."""

    @staticmethod
    def forward(ctx, logits_NV, targets_N, group):
        V = logits_NV.shape[-1]
        local_t = targets_N - V * comm.group_rank(group)
        inside = (local_t >= 0) & (local_t < V)
        local_t = local_t.clamp(0, V - 1)
        lse, target_logit = fused.logsumexp_and_pick(logits_NV, local_t)
        target_logit = target_logit * inside
        if comm.group_size(group) > 1:  # logsumexp of the shards' logsumexps, shifted by the largest
            top = lse.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack([torch.exp(lse - top), target_logit])   # one SUM for both
            dist.all_reduce(sums, group=group)
            lse, target_logit = top + torch.log(sums[0]), sums[1]
        valid = targets_N != -100
        ctx.save_for_backward(logits_NV, lse, local_t, inside & valid, valid)
        return (lse - target_logit) * valid

    @staticmethod
    def backward(ctx, grad_N):
        logits_NV, lse, local_t, hit, valid = ctx.saved_tensors
        return fused.cross_entropy_grad(logits_NV, lse, local_t, hit, grad_N * valid), None, None


def place_images(h_BMD, input_ids, image_rows, rows_per_sample, image_token_id, cp_rank=0, cp_size=1):
    """Write image embedding rows into the placeholder positions, in order; under cp (h holds this rank's positions,
    input_ids the whole rows) the rows whose placeholders this rank holds. input_ids live on the host (as the loader
    made them): the check and the positions cost no device sync."""
    is_image = input_ids.cpu() == image_token_id
    for b, (n_slots, n_rows) in enumerate(zip(is_image.sum(1).tolist(), rows_per_sample)):
        if n_slots != n_rows:
            raise ValueError(f"sample {b}: {n_slots} image placeholder tokens but {n_rows} image embedding rows")
    if image_rows.shape[0] == 0:
        return h_BMD
    if cp_size > 1:   # the rows this rank's positions hold, in their order
        row = torch.full(is_image.shape, -1).masked_scatter_(is_image, torch.arange(image_rows.shape[0]))
        row = cp.local(row, cp_rank, cp_size).flatten()     # the image row at each of this rank's positions
        is_image = row >= 0
        image_rows = image_rows[host_to_device(row[is_image], image_rows.device)]
    pos = host_to_device(is_image.flatten().nonzero().squeeze(1), h_BMD.device)
    return h_BMD.flatten(0, 1).index_copy(0, pos, image_rows.to(h_BMD.dtype)).view_as(h_BMD)


def host_to_device(t, device):
    """Copy without a stream sync: CUDA copies from pageable memory wait for the GPU, copies from pinned do not."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def set_trainable(modules, stage=2, regex=None):
    """Freeze by training stage, or by a regex over prefixed names ("vision.…", "language.…"; overrides stage).

    Stage 1: only the projector (vision.mlp1) trains. Stage 2: the vision tower is frozen, projector and language
    model train. Stage 3: everything trains. Frozen parameters get no gradient and no optimizer state.
    """
    for prefix, module in modules.items():
        for name, p in module.named_parameters():
            full = f"{prefix}.{name}"
            if regex is not None:
                train = re.search(regex, full) is not None
            elif stage == 1:
                train = full.startswith("vision.mlp1.")
            elif stage == 2:
                train = not full.startswith("vision.") or full.startswith("vision.mlp1.")
            else:   # stage 3 (config.check allows 1, 2, 3)
                train = True
            p.requires_grad_(train)


# ---------------------------------------------------------------- initialisation (independent of the layout)

def tower_trains(vision):
    """Whether the vision tower (all but the projector, mlp1) runs a backward: some parameter of it trains."""
    return any(p.requires_grad for n, p in vision.named_parameters() if not n.startswith("mlp1."))


def init_weights(model, seed, coords, cfg):
    """Draw every parameter as its full tensor from a generator seeded by (seed, name), then keep this rank's
    shard. The initial model is then the same for every layout (tp, ep, hetero or colocated). The values:
    docs/decoder.md §1 (std, output layers) and §2 (Mamba).

    coords: {"tp": (rank, size), "ep": ..., "etp": ...}; kinds left out are unsharded.
    """
    ranks, sizes = {k: r for k, (r, _) in coords.items()}, {k: n for k, (_, n) in coords.items()}
    for name, p in model.named_parameters():
        comm.init_shard(p, name, seed, rule(name, cfg), ranks, sizes)


def rule(name, cfg):
    """How parameter `name` is drawn, as comm.draw takes it: (full shape, generator) -> tensor."""
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(len(cfg.hybrid_override_pattern))
    return lambda shape, gen: _decoder_rule(name, shape, gen, std, out_std, cfg.conv_kernel)


def _decoder_rule(name, shape, gen, std, out_std, conv_kernel):
    device = gen.device

    def uniform(lo, hi):   # in place: one full-size tensor at a time (memory.py's set-up peak), the same values
        return torch.rand(shape, generator=gen, device=device).mul_(hi - lo).add_(lo)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":                                   # A ~ U[1, 16]
        return uniform(1.0, 16.0).log_()
    if leaf == "dt_bias":                                 # dt log-uniform in [1e-3, 1e-1], bias = softplus^-1(dt)
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if "conv1d" in name:                                  # kaiming_uniform(a=sqrt 5) on fan_in = width
        return uniform(-1 / math.sqrt(conv_kernel), 1 / math.sqrt(conv_kernel))
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    if leaf == "D" or "norm" in name:
        return torch.ones(shape, device=device)
    if any(k in name for k in ("out_proj", "o_proj", "down_proj")):  # output layers: std / sqrt(layers)
        return torch.randn(shape, generator=gen, device=device).mul_(out_std)
    return torch.randn(shape, generator=gen, device=device).mul_(std)


# ---------------------------------------------------------------- parameter counts and FLOPs (throughput, MFU)

@config.per_config
def count_language_params(cfg, mtp=False):
    """(total, active per token) of the language model, embedding and LM head included, buffers excluded; mtp:
    of its MTP blocks instead (active: one block's, what one depth runs). Cached: every training step counts its
    FLOPs."""
    with torch.device("meta"):
        lm = LanguageModel(planned(cfg))
    total = sum(p.numel() for n, p in lm.named_parameters() if n.startswith("mtp.") == mtp)
    if not mtp:
        return total, total - sum(kind_facts(cfg, k, cfg.seq_len)["idle"] for k in cfg.hybrid_override_pattern)
    blocks = cfg.num_nextn_predict_layers
    return total, (total // blocks - sum(kind_facts(cfg, k, cfg.seq_len)["idle"] for k in cfg.mtp_pattern)) \
        if blocks else 0


@config.per_config
def layer_flops_per_token(cfg, seq_len):
    """Training FLOPs per token of each decoder layer (the pattern's order) and of the rest (the head, MTP):
    lm_flops_per_token's terms, per layer."""
    with torch.device("meta"):
        params = {k: sum(p.numel() for p in Block(k, cfg, {}, "alltoall").parameters())
                  for k in set(planned(cfg).hybrid_override_pattern)}
    facts = {k: kind_facts(cfg, k, seq_len) for k in set(cfg.hybrid_override_pattern)}
    layers = [6 * (params[known] - facts[k]["idle"]) + facts[k]["flops"]
              for k, known in zip(cfg.hybrid_override_pattern, planned(cfg).hybrid_override_pattern)]
    return layers, lm_flops_per_token(cfg, seq_len) - sum(layers)


@config.per_config
def stage_layers(cfg, pp, split=()):
    """The decoder's layers of each of `pp` pipeline stages: contiguous ranges, at least one layer each, that
    make the slowest stage's training FLOPs (the last stage's with the head and MTP) as small as can be; or with
    `split` (the first layer of each stage after the first: chooser.fit_split's, where that split does not fit a
    rank's memory) those."""
    if pp == 1 or split:
        bounds = [0, *split, len(cfg.hybrid_override_pattern)]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    layers, head = layer_flops_per_token(cfg, cfg.seq_len)
    n = len(layers)
    sums = [0] + [sum(layers[:i + 1]) for i in range(n)]
    # best[s][i]: the slowest of s stages over the first i layers, the cheapest split; cut[s][i]: its last start
    best = [[0.0] + [math.inf] * n] + [[math.inf] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    for s in range(1, pp + 1):
        for i in range(s, n - (pp - s) + 1):
            for j in range(s - 1, i):
                w = max(best[s - 1][j], sums[i] - sums[j] + head * (s == pp and i == n))
                if w < best[s][i]:
                    best[s][i], cut[s][i] = w, j
    stops, i = [], n
    for s in range(pp, 0, -1):
        stops.append(i)
        i = cut[s][i]
    bounds = [0] + stops[::-1]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def lm_flops_per_token(cfg, seq_len):
    """Training FLOPs (fwd + bwd = 3 x fwd) per token of the language model: 6 x active matmul parameters (all
    active parameters except the embedding lookup) and each layer's own (kind_facts: attention's scores and values,
    a Mamba layer's SSD). MTP: each depth one block and the output head again."""
    (_, active), (_, block), depths = count_language_params(cfg), count_language_params(cfg, True), \
        mtp_depths(cfg)
    matmul = 6 * (active - cfg.vocab_size * cfg.hidden_size + depths * (block + cfg.vocab_size * cfg.hidden_size))
    layers = cfg.hybrid_override_pattern + cfg.mtp_pattern * depths
    return matmul + sum(kind_facts(cfg, k, seq_len)["flops"] for k in layers)
