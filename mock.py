"""Mock data (docs/data.md §1): a synthetic VLM task that learns through the image (--mock-text task), or random
tokens and pixels for throughput runs (--mock-text random). A sample is a pure function of (seed, index).

task, with an image:  <image> x n  c  c+1  c+2 ...  (token ids FIRST + counting mod COUNT), c a multiple of STRIDE,
    the image one flat colour plus noise that names c: so the first count token is predictable only through the
    image (without it its loss stays at ln 8), every later one from the previous token.
task, text-only (a mock_text_only_frac share): counting from a random c.
"""
import torch

from data import Sample

COUNT, FIRST = 64, 32                            # counting tokens: ids FIRST .. FIRST + COUNT - 1
STRIDE = 8                                       # an image's count starts at a multiple of 8: 8 colours
LEVELS = (-1.0, 1.0)                             # a colour channel's level, in CLIP-normalised units
NOISE = 0.1


def colour(start):
    """A start count 8k -> its RGB colour [3]: the bits of k pick each channel's level."""
    return torch.tensor([LEVELS[(start // STRIDE >> bit) & 1] for bit in range(3)])


class MockData:
    def __init__(self, cfg, seed):
        self.cfg, self.seed = cfg, seed
        self.fingerprint = f"mock-{cfg.mock_text}-{seed}"
        side = cfg.mock_image_size // cfg.vit_patch
        if cfg.mock_image_size % (2 * cfg.vit_patch):
            raise SystemExit(f"--mock-image-size {cfg.mock_image_size} is not a multiple of 2 x patch "
                             f"({2 * cfg.vit_patch}). Use a multiple of {2 * cfg.vit_patch}")
        self.image_tokens = side * side // 4
        self.answer_position = self.image_tokens - 1    # its label only the image predicts (task, with an image)
        if self.image_tokens + 2 > cfg.seq_len:
            raise SystemExit(f"a mock image of {self.image_tokens} tokens leaves no room for text in seq_len "
                             f"{cfg.seq_len}. Raise --seq-len or lower --mock-image-size")
        if cfg.mock_text == "task" and (cfg.vocab_size < FIRST + COUNT or FIRST <= cfg.image_token_id < FIRST + COUNT):
            raise SystemExit(f"the mock task uses token ids {FIRST}-{FIRST + COUNT - 1}: it needs vocab_size >= "
                             f"{FIRST + COUNT} and an image_token_id outside them. Use --mock-text random")

    def __getitem__(self, index):
        return self.sample(index)

    def sample(self, index, pixels=True):
        """Sample `index`; pixels=False (language-only ranks) skips drawing the image, drawn last for that reason."""
        cfg = self.cfg
        if cfg.mock_num_samples:
            index %= cfg.mock_num_samples
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        text_only = torch.rand((), generator=g).item() < cfg.mock_text_only_frac
        n_img = 0 if text_only else self.image_tokens
        if cfg.mock_text == "random":
            text = torch.randint(1, cfg.vocab_size - 1, (cfg.seq_len + 1 - n_img,), generator=g)
            text = text + (text >= cfg.image_token_id).long()        # skip the image token id
        else:
            start = int(torch.randint(0, COUNT, (), generator=g)) if text_only else \
                STRIDE * int(torch.randint(0, COUNT // STRIDE, (), generator=g))
            text = FIRST + (start + torch.arange(cfg.seq_len + 1 - n_img)) % COUNT
        tokens = torch.cat([torch.full((n_img,), cfg.image_token_id), text])
        input_ids, labels = tokens[:-1], tokens[1:].clone()
        labels[labels == cfg.image_token_id] = -100
        if cfg.mock_text == "random":
            labels[input_ids == cfg.image_token_id] = -100
        images = None
        if pixels:
            images = [] if text_only else [self.image(start if cfg.mock_text == "task" else None, g)]
        return Sample(input_ids, labels, images)

    def image(self, start, g):
        """[3, S, S]: random pixels (start None), else the colour of count `start` plus noise."""
        S = self.cfg.mock_image_size
        noise = torch.randn(3, S, S, generator=g)
        return noise if start is None else colour(start)[:, None, None] + NOISE * noise
