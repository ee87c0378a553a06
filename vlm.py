"""The VLM's loss: what training, evaluation and the tests all call, on one device or on a rank's share.

    rows, per_sample = encode(vision, samples, cfg)              # tower + projector: the samples' image rows
    parts = language_loss(lm, rows, per_sample, samples, cfg)    # embed, place the rows, decoder, token losses
    loss = parts.sum / parts.tokens                              # per-token mean (one device)

Under parallelism the same two functions run on each rank's share (docs/parallel.md §7): encode on a vision lane's
samples, the bridge carries the rows to the language lanes that own those samples (bridge.py), language_loss on a
lane's samples and, under cp, this rank's positions (`cp_at`); the schedule (schedule.py) orders them. A step's
sums are divided by the token count of the whole step (train.py), so every layout gives one device's loss.
"""
from typing import NamedTuple

import torch

import cp
import data
import model
import radio


def compute_dtype(device):
    """What the language model's residual stream runs in: bf16 on CUDA (the weights' dtype there), fp32 on the CPU
    (the reference)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def autocast(device):
    """compute_dtype's autocast on CUDA, none on the CPU."""
    return torch.autocast("cuda", dtype=compute_dtype(torch.device("cuda")), enabled=device.type == "cuda")


def encode(vision, samples, cfg):
    """-> (image rows [R, D] of the samples' images and video tubelets in sample order, [rows of each sample])."""
    device = vision.mlp1["3"].weight.device
    patches, grids, rows, frames = data.collate_images(samples, cfg, lambda t: model.host_to_device(t, device))
    with autocast(device):
        return vision(patches.to(device), grids, frames), rows


def inputs(lm, ids, host_ids, rows, per_sample, cfg, cp_at=(0, 1)):
    """The decoder's input [B, M, D]: the embedded ids (this rank's positions on the device) with the image rows
    written into the placeholders; host_ids: the whole rows on the host (model.place_images). Logits of one
    device: lm.logits(lm(inputs(lm, ids, ids, *encode(vision, samples, cfg), cfg)))."""
    return model.place_images(lm.embed(ids), host_ids, rows, per_sample, cfg.image_token_id, *cp_at)


class LossParts(NamedTuple):
    """One micro-batch of one language lane. The sums cover this rank's positions (all of them without cp); tokens
    counts the lane's whole rows, so summing it over cp ranks would count them twice."""
    sum: torch.Tensor     # sum of the token losses (labels != -100)
    mtp: list             # per MTP depth: the sum of its token losses (empty unless asked for)
    tokens: int           # loss tokens of the samples


def language_loss(lm, rows, per_sample, samples, cfg, cp_at=(0, 1), mtp=False, received=None):
    """The samples' token losses given their image rows (encode's, or the bridge's) -> LossParts. cp_at: (cp rank,
    cp size) of this rank (cp.py); mtp: also the MTP depths' losses (training only). A pipeline stage of the model
    (model.LanguageModel's stage) runs its part: the first embeds the tokens and places the rows, a later one starts
    from `received` (the previous stage's outputs); a stage but the last returns its outputs to send on instead:
    [hidden states], with mtp [hidden states, the decoder input] (the last stage's MTP blocks read it)."""
    device = next(lm.parameters()).device
    ids, labels, seq_idx, valid = data.collate_text(samples)
    tokens = int(labels.ne(-100).sum())
    ids_dev, labels_BL, seq_idx, valid = (None if t is None else model.host_to_device(t, device) for t in
                                          (cp.local(ids, *cp_at), labels, seq_idx,   # labels (MTP): whole rows
                                           None if valid is None else cp.local(valid, *cp_at)))
    with autocast(device):  # seq_idx: document ids of packed rows; valid: False on padding
        if lm.first:
            h = inputs(lm, ids_dev, ids, rows, per_sample, cfg, cp_at)
            if not rows.numel() and torch.is_grad_enabled():  # text only: an exact 0 ties the loss to the (empty)
                h = h + rows.requires_grad_().sum()  # rows, so a frozen language model still runs the backward (and
            x = h                                     # its collectives) that every lane runs
        else:
            x, h = received if mtp else (received[0], None)
        hidden = lm(x, seq_idx, valid)
        if not lm.last:
            return [hidden, h.to(hidden.dtype)] if mtp else [hidden]
        s, _ = lm.loss_sum(hidden, cp.local(labels_BL, *cp_at))
        depths = lm.mtp_losses(hidden, h, labels_BL, seq_idx, valid) if mtp else []
    return LossParts(s, depths, tokens)


def loss(vision, lm, samples, cfg):
    """The per-token mean loss of the samples on one device (no MTP)."""
    parts = language_loss(lm, *encode(vision, samples, cfg), samples, cfg)
    return parts.sum / max(parts.tokens, 1)


def flops(cfg, samples, side, tower_trains=True):
    """Training FLOPs of the samples on `side` ("vision": tower + projector, a frozen tower forward only; "lm": the
    decoder over the whole rows, padding included). Formulas: model.py, radio.py."""
    if side == "lm":
        return sum(len(s.input_ids) for s in samples) * model.lm_flops_per_token(cfg, cfg.seq_len)
    p = cfg.vit_patch
    items = [(i.shape[1] // p, i.shape[2] // p, i.shape[0] // 3) for s in samples for i in s.images]
    return radio.flops(cfg, [(h, w) for h, w, _ in items], tower_trains, [t for _, _, t in items])
