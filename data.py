"""Samples and micro-batches. A sample is a pure function of (seed, global sample index), so every rank of every
layout can build exactly the samples it owns, and changing the layout never changes what a step trains on.

Sample: input_ids [L], labels [L] (-100 = no loss), images: list of [3, H, W] float tensors, CLIP-normalised.
Image i occupies h_i*w_i/4 consecutive placeholder tokens (image_token_id) in input_ids.
"""
from dataclasses import dataclass

import torch

import radio


@dataclass
class Sample:
    input_ids: torch.Tensor
    labels: torch.Tensor
    images: list


class MockData:
    """Megatron-20L-style mock: one square image of cfg.mock_image_size px followed by random text tokens
    (never the image token or the pad id 0); a seeded fraction of samples is text only."""

    def __init__(self, cfg, seed):
        self.cfg, self.seed = cfg, seed
        side = cfg.mock_image_size // cfg.vit_patch
        if cfg.mock_image_size % (2 * cfg.vit_patch):
            raise ValueError(f"mock_image_size {cfg.mock_image_size} must be a multiple of 2*patch = {2 * cfg.vit_patch}")
        self.image_tokens = side * side // 4
        if self.image_tokens >= cfg.seq_len:
            raise ValueError(f"mock image of {self.image_tokens} tokens does not fit seq_len {cfg.seq_len}")

    def __getitem__(self, index):
        cfg = self.cfg
        if cfg.mock_num_samples:
            index %= cfg.mock_num_samples
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        text_only = torch.rand((), generator=g).item() < cfg.mock_text_only_frac
        n_img = 0 if text_only else self.image_tokens
        text = torch.randint(1, cfg.vocab_size - 1, (cfg.seq_len + 1 - n_img,), generator=g)
        text = text + (text >= cfg.image_token_id).long()        # skip the image token id
        tokens = torch.cat([torch.full((n_img,), cfg.image_token_id), text])
        input_ids, labels = tokens[:-1], tokens[1:].clone()
        labels[input_ids == cfg.image_token_id] = -100
        images = [] if text_only else [torch.randn(3, cfg.mock_image_size, cfg.mock_image_size, generator=g)]
        return Sample(input_ids, labels, images)


def collate_text(samples):
    """-> input_ids [B, L], labels [B, L] (language side)."""
    return torch.stack([s.input_ids for s in samples]), torch.stack([s.labels for s in samples])


def collate_images(samples, cfg):
    """-> packed patches [T, 3p²], grids [(h, w)], image rows per sample (vision side).

    Images are already at a patch-aligned size here; the token budget (radio.compute_params) decided it
    when the sample was made, so the count of placeholder tokens and of image rows agree by construction.
    """
    p, patches, grids, rows = cfg.vit_patch, [], [], []
    for s in samples:
        n = 0
        for img in s.images:
            h, w = img.shape[1] // p, img.shape[2] // p
            patches.append(radio.patchify(img, p))
            grids.append((h, w))
            n += h * w // 4
        rows.append(n)
    packed = torch.cat(patches) if patches else torch.zeros(0, 3 * p * p)
    return packed, grids, rows
