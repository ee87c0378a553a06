"""Samples and micro-batches. A sample is a pure function of (data, seed, global sample index), so every rank of
every layout builds exactly the samples it owns, and changing the layout never changes what a step trains on.

Sample: input_ids [L], labels [L] (-100 = no loss, padding included), images: list of [3, h*p, w*p] float tensors,
CLIP-normalised and already at their patch-aligned size (None where the rank asked for no pixels), seq_idx [L]:
document id per token of a packed row (None when unpacked). Image i occupies h_i*w_i/4 consecutive placeholder
tokens (image_token_id) in input_ids (docs/vision.md §9).

Records (docs/data.md §2; files and record shapes: formats.py): {"messages": [...]}, chats of text, image and video
parts (video.py); {"text": "..."}, BOS + text + EOS, all trained; {"input_ids": [...], "loss_mask": [...]}, as is
(loss_mask[t] = 1 trains token t, default all). Index i -> (source s, its k-th draw) by a greedy weighted schedule;
unpacked, the k-th draw of s is document perm_{seed,s,epoch}[k mod n_s] (epoch = k // n_s); packed (--pack), it is
the k-th row of s's permuted document stream cut into windows of packing.WINDOW documents (within each epoch), each
window packed best-fit decreasing (packing.py). Token lengths come from a one-time index of every file, cached
beside it. A document longer than seq_len: --overlong (docs/data.md §5, formats.truncate).
"""
import bisect
import hashlib
import itertools
import json
import os
import re
import signal
from dataclasses import dataclass, replace

import numpy as np
import torch

import formats
import packing
import radio
import video
import watchdog
from formats import Bad, BadSample, Overlong

# Special tokens of the chat template (ChatML as in Nemotron Nano v2 / Nano-VL): <|im_start|>role\n...<|im_end|>\n;
# an image is <img> + <image> x M + </img> (docs/vision.md §9). The byte tokenizer reserves all of them.
SPECIALS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<img>", "</img>")
ROLES = ("system", "user", "assistant")


@dataclass
class Sample:
    input_ids: torch.Tensor
    labels: torch.Tensor
    images: list
    seq_idx: torch.Tensor = None
    n_pad: int = 0                    # padding tokens at the end of the row (not routed or counted by MoE layers)

    def pin_memory(self):
        """A DataLoader pinning (Loader on CUDA) calls it in its own thread: the images' copies to the GPU then
        neither wait for the GPU nor stage every pixel through pinned memory on the step's path."""
        return replace(self, images=[img.pin_memory() for img in self.images])


def sizes(ds, i):
    """(non-padding tokens, patches of each image) of sample i of `ds`, what lanes.py weighs: from the index where
    `ds` has one (RealData), else from the sample built without pixels (the mock's is cheap: its placeholders are
    one image's)."""
    if hasattr(ds, "sizes"):
        return ds.sizes(i)
    s = ds.sample(i, pixels=False)
    n = int((s.input_ids == ds.cfg.image_token_id).sum())
    return len(s.input_ids) - s.n_pad, [4 * n] if n else []


# ---------------------------------------------------------------- tokenizers

class ByteTokenizer:
    """Offline default: UTF-8 bytes are ids 0-255. <image> is cfg.image_token_id; the other specials count down
    from vocab_size - 1 (skipping it), so they fit any vocab >= 264 (tiny, vocab 512: <pad> 510, <s> 509, </s> 508,
    <|im_start|> 507, <|im_end|> 506, <img> 505, </img> 504, <image> 511)."""

    def __init__(self, vocab_size, image_token_id):
        top = [i for i in range(vocab_size - 1, 255, -1) if i != image_token_id][:len(SPECIALS)]
        if image_token_id < 256 or len(top) < len(SPECIALS):
            raise SystemExit(f"byte tokenizer: needs image_token_id >= 256 (got {image_token_id}) and room for "
                             f"{len(SPECIALS)} specials above 255 in vocab_size {vocab_size}")
        self.special = dict(zip(SPECIALS, top), **{"<image>": image_token_id})
        self.fingerprint = f"bytes-{vocab_size}-{image_token_id}"

    def encode(self, text):
        return list(text.encode("utf-8"))


class HFTokenizer:
    """An HF tokenizer (optional `transformers`): a directory or a bare tokenizer.json (docs/data.md §6). Without a
    chat template chats are rendered with the ChatML of Encoder.chat, which needs <|im_start|> and <|im_end|>. <image>
    must be at cfg.image_token_id; <img>/</img> wrap each image's placeholders when the vocabulary has them."""

    def __init__(self, path, vocab_size, image_token_id):
        try:
            import transformers
        except ImportError:
            raise SystemExit(f"{path} is an HF tokenizer, which needs transformers: pip install -e '.[hf]'") from None
        if not os.path.exists(path):
            raise SystemExit(f"--tokenizer {path}: no such file or directory")
        try:
            self.tok = transformers.AutoTokenizer.from_pretrained(path) if os.path.isdir(path) else \
                transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        except Exception as e:   # whatever transformers or tokenizers raise on what is no tokenizer
            why = "no tokenizer files in it" if os.path.isdir(path) and not any(
                f.startswith("tokenizer") for f in os.listdir(path)) else " ".join(str(e).split())
            raise SystemExit(f"--tokenizer {path}: not a tokenizer ({why}). Give an HF tokenizer directory "
                             "(tokenizer.json, tokenizer_config.json) or a tokenizer.json file") from None
        vocab = self.tok.get_vocab()
        self.special = {t: vocab[t] for t in SPECIALS + ("<image>",) if t in vocab}
        self.template = self.tok.chat_template
        if isinstance(self.template, dict):   # named templates: the default one renders chats
            self.template = self.template.get("default")
        need = ["<image>"] + ([] if self.template else ["<|im_start|>", "<|im_end|>"])
        missing = [t for t in need if t not in self.special]
        if missing:
            raise SystemExit(f"tokenizer {path} lacks the special tokens {missing}"
                             + ("" if self.template else " (it has no chat template, so chats use ChatML)"))
        if self.special["<image>"] != image_token_id:
            raise SystemExit(f"tokenizer {path}: <image> is id {self.special['<image>']}, the model's image_token_id "
                             f"is {image_token_id}; pass --image-token-id {self.special['<image>']}")
        if len(self.tok) > vocab_size:
            raise SystemExit(f"tokenizer {path} has {len(self.tok)} ids > vocab_size {vocab_size}")
        # bos / eos / pad: the tokenizer's own, else <s> / </s> / <pad> in its vocabulary, else eos falls back to
        # <|endoftext|> or <|im_end|> and pad to eos (no bos then)
        for name, declared in (("<s>", self.tok.bos_token_id), ("</s>", self.tok.eos_token_id),
                               ("<pad>", self.tok.pad_token_id)):
            if declared is not None:
                self.special[name] = declared
        if "</s>" not in self.special:
            eos = vocab.get("<|endoftext|>", self.special.get("<|im_end|>"))
            if eos is None:
                raise SystemExit(f"tokenizer {path} has no end-of-text token (eos_token, </s>, <|endoftext|> or "
                                 "<|im_end|>)")
            self.special["</s>"] = eos
        self.special.setdefault("<pad>", self.special["</s>"])
        digest = hashlib.sha256(json.dumps([self.tok.get_vocab(), self.template, sorted(self.special.items())],
                                           sort_keys=True).encode())
        self.fingerprint = "hf-" + digest.hexdigest()[:16]

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def render(self, messages):
        """Chat template -> (ids, trained mask): assistant tokens by the template's {% generation %} markers when it
        has them, else by the assistant messages' spans (the text each adds after the generation prompt)."""
        apply = lambda msgs, **kw: self.tok.apply_chat_template(msgs, tokenize=False, **kw)   # noqa: E731
        text = apply(messages)
        if re.search(r"{%-?\s*generation\s*-?%}", self.template):
            out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                head, upto = apply(messages[:i], add_generation_prompt=True), apply(messages[:i + 1])
                if not (upto.startswith(head) and text.startswith(upto)):
                    raise Bad("the chat template does not render this chat prefix by prefix, so assistant turns "
                              "cannot be located; add {% generation %} markers to it")
                spans.append((len(head), len(upto)))
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def save(self, out_dir):
        self.tok.save_pretrained(out_dir)


def load_tokenizer(path, cfg):
    return HFTokenizer(path, cfg.vocab_size, cfg.image_token_id) if path else \
        ByteTokenizer(cfg.vocab_size, cfg.image_token_id)


# ---------------------------------------------------------------- one document

def _open_image(path, pixels, verify=False):
    """-> ((H, W), uint8 [3, H, W] RGB or None). Without pixels only the header is read (when indexing, the image
    is decoded in full too: a truncated file fails here, at file:line); the size comes from the header either way,
    so all ranks agree."""
    from PIL import Image
    try:
        with Image.open(path) as im:
            size = (im.height, im.width)
            if not pixels:
                if verify:
                    im.load()
                return size, None
            rgb = np.asarray(im.convert("RGB"))
    except FileNotFoundError:
        raise Bad(f"missing image {path}") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise Bad(f"undecodable image {getattr(path, 'name', path)}: {e}") from None
    return size, torch.from_numpy(rgb.copy()).permute(2, 0, 1)


def _part(part):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return "text", part["text"]
    if kind == "image" and isinstance(part.get("image"), (str, bytes)):   # bytes: stored in the record
        return "image", part["image"]
    frames = part.get("video") if kind == "video" else None
    if isinstance(frames, str) or isinstance(frames, list) and frames and all(isinstance(f, str) for f in frames):
        return "video", frames
    url = part.get(kind) if kind in ("image_url", "video_url") else None
    url = url.get("url") if isinstance(url, dict) else url
    if isinstance(url, str):
        return kind[:5], url
    raise Bad(f"bad content part {str(part)[:80]} (expected type text, image, image_url, video or video_url)")


class Encoder:
    """Turns one JSONL object into (token ids, target mask, images) with the chat template and the token budget."""

    def __init__(self, tok, cfg, train_on="assistant", overlong="error"):
        self.tok, self.cfg, self.train_on, self.sp, self.overlong = tok, cfg, train_on, tok.special, overlong
        self.n_truncated = 0                         # documents truncated so far (the index counts them)
        self.fingerprint = json.dumps([tok.fingerprint, train_on, cfg.seq_len, cfg.vit_patch, cfg.min_num_patches,
                                       cfg.max_num_patches, cfg.vocab_size, cfg.image_token_id, overlong,
                                       cfg.video_temporal_patch, cfg.video_target_patches, cfg.video_fps,
                                       cfg.max_frames])

    def pieces(self, obj):
        """-> [(token ids, trained: bool or one per id) | (image reference | ("video", reference), trained)] in
        stream order."""
        if not isinstance(obj, dict):
            raise Bad("a line must hold a JSON object")
        sp, enc = self.sp, self.tok.encode
        if "messages" in obj:
            return self.chat(obj["messages"])
        if "text" in obj:
            if not isinstance(obj["text"], str) or not obj["text"]:
                raise Bad("'text' must be a non-empty string")
            bos = [sp["<s>"]] if "<s>" in sp else []
            return [(bos, False), (enc(obj["text"]) + [sp["</s>"]], True)]
        if "input_ids" in obj:
            ids, mask = obj["input_ids"], obj.get("loss_mask")
            V = self.cfg.vocab_size
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < V for i in ids):
                raise Bad(f"'input_ids' must be a non-empty list of ids in [0, {V})")
            if mask is None:
                mask = [1] * len(ids)
            if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
                raise Bad("'loss_mask' must be a list of 0/1 as long as 'input_ids'")
            return [(ids, [bool(m) for m in mask])]
        raise Bad("expected a 'messages', 'text' or 'input_ids' field")

    def chat(self, messages):
        """Messages -> pieces: by the tokenizer's chat template when it has one, else by ChatML written here
        (headers trained only under --train-on all, each turn's <|im_end|> trained with its turn)."""
        everything = self.train_on == "all"
        turns = self._turns(messages)
        if getattr(self.tok, "template", None):   # a video takes an image's place in the template (vision.md §11)
            conv = [{"role": r, "content": c if isinstance(c, str) else [
                {"type": "text", "text": x} if kind == "text" else {"type": "image"} for kind, x in c]}
                for r, c in turns]
            ids, mask = self.tok.render(conv)
            images = [x if kind == "image" else (kind, x) for _, c in turns if not isinstance(c, str)
                      for kind, x in c if kind != "text"]
            at = [t for t, i in enumerate(ids) if i == self.cfg.image_token_id]
            if len(at) != len(images):
                raise Bad(f"the chat template rendered {len(at)} <image> tokens for {len(images)} images")
            out, prev = [], 0
            for t, ref in zip(at + [len(ids)], images + [None]):
                out.append((ids[prev:t], [everything or m for m in mask[prev:t]]))
                if ref is not None:
                    out.append((ref, everything or mask[t]))
                prev = t + 1
            return out
        sp, enc, out = self.sp, self.tok.encode, []
        for role, content in turns:
            train = everything or role == "assistant"
            out.append(([sp["<|im_start|>"]] + enc(role + "\n"), everything))
            for kind, x in [("text", content)] if isinstance(content, str) else content:
                out.append((enc(x) if kind == "text" else x if kind == "image" else (kind, x), train))
            out.append(([sp["<|im_end|>"]], train))      # trained: the model learns to end its turn
            out.append((enc("\n"), everything))
        return out

    @staticmethod
    def _turns(messages):
        """Checked messages -> [(role, str | [("text", str) | ("image" | "video", reference)])]. Image parts:
        {"type": "image", "image": PATH} or OpenAI's {"type": "image_url", "image_url": {"url": PATH | data: URL}};
        video parts alike ("video": PATH or a list of frame paths, "video_url")."""
        if not isinstance(messages, list) or not messages:
            raise Bad("'messages' must be a non-empty list")
        turns = []
        for m in messages:
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ROLES:
                raise Bad(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
            content = m.get("content")
            if not isinstance(content, (str, list)):
                raise Bad(f"{role} content must be a string or a list of parts")
            parts = content if isinstance(content, str) else [_part(p) for p in content]
            filled = bool(content.strip()) if isinstance(content, str) else \
                any(kind != "text" or x.strip() for kind, x in parts)
            if role == "assistant" and not filled:      # would train the model to answer with nothing
                raise Bad("empty assistant turn")
            turns.append((role, parts))
        return turns

    def video(self, ref, base_dir, pixels, verify=False):
        """A video part -> (grid (th, tw), the label ids before each tubelet, tubelets [3t, th*p, tw*p] or None
        without pixels). A file's header alone gives what the token count needs (docs/vision.md §11)."""
        cfg, t = self.cfg, self.cfg.video_temporal_patch
        if not t:
            raise SystemExit("video data needs a tower with a video embedder. Pass --video-temporal-patch 2 (Nano "
                             "Omni's tubelets) or --load an Omni checkpoint")
        if isinstance(ref, list):   # frame images, no rate
            srcs = [formats.image_source(r, base_dir) for r in ref]
            sizes = {_open_image(src, False, verify)[0] for src in srcs}
            if len(sizes) > 1:
                raise Bad(f"the frames of a video differ in size: {sorted(sizes)}")
            n, fps, size = len(ref), None, sizes.pop()
        else:
            src = formats.image_source(ref, base_dir)
            n, fps, size = video.probe(src)
        at = video.sample_indices(n, fps, cfg.video_fps, cfg.max_frames)
        th, tw = video.canvas(*size, cfg.video_target_patches)
        heads = [self.tok.encode(s) for s in video.labels(at, fps, t)]
        if not pixels:
            return (th, tw), heads, None
        if isinstance(ref, list):
            frames = torch.stack([_open_image(srcs[k], True)[1] for k in at])
        else:
            if hasattr(src, "seek"):   # a data: URL's bytes, read once by probe
                src.seek(0)
            frames = video.decode(src, at)
        return (th, tw), heads, video.tubelets(frames, th, tw, cfg.vit_patch, t)

    def _visual(self, heads, grid, runs=None, at=0):
        """The ids of an image (heads [[]]) or of a video's tubelets (a label before each) of patch grid `grid`:
        each head, then <img>, a placeholder per projected row and </img>, tubelets joined by a newline. runs: the
        [start, end) of each <img>..</img> is appended to it, counted from `at`."""
        sp, (th, tw) = self.sp, grid
        run = [sp["<img>"]] * ("<img>" in sp) + [self.cfg.image_token_id] * (th * tw // 4) + \
            [sp["</img>"]] * ("</img>" in sp)
        out, nl = [], self.tok.encode("\n") if len(heads) > 1 else []
        for g, head in enumerate(heads):
            out += (nl if g else []) + head
            if runs is not None:
                runs.append((at + len(out), at + len(out) + len(run)))
            out += run
        return out

    def encode(self, obj, base_dir, pixels, verify=False):
        """-> (ids, mask, images): mask[t] = token t is a target; images: normalised tensors (images [3, H, W], video
        tubelets [3t, H, W]), or None without pixels. A video's tokens count as text; the images share the room
        the text leaves in seq_len (docs/vision.md §8, §11)."""
        cfg, p = self.cfg, self.cfg.vit_patch
        pieces = self.pieces(obj)
        wrap = len(self._visual([[]], (0, 0)))   # <img> </img> around an image's placeholders
        videos = {k: self.video(x[1], base_dir, pixels, verify) for k, (x, _) in enumerate(pieces)
                  if isinstance(x, tuple)}
        paths = [formats.image_source(x, base_dir) for x, _ in pieces if isinstance(x, (str, bytes))]
        n_video = sum(len(self._visual(heads, grid)) for grid, heads, _ in videos.values())
        n_text = sum(len(x) for x, _ in pieces if isinstance(x, list)) + wrap * len(paths)
        if any(cfg.image_token_id in x for x, _ in pieces if isinstance(x, list)):
            raise Bad("text holds the image token; its placeholders would not match the images")
        opened = [_open_image(path, pixels, verify) for path in paths]
        grids = iter(radio.compute_params([size for size, _ in opened], max(cfg.seq_len - n_text - n_video, 0),
                                          cfg.min_num_patches, cfg.max_num_patches, p))
        opened = iter(opened)
        ids, mask, images, runs = [], [], [], []      # runs: [start, end) of each image's or tubelet's tokens
        for k, (x, train) in enumerate(pieces):
            if not isinstance(x, list):
                if k in videos:
                    (th, tw), heads, tubes = videos[k]
                else:
                    (th, tw), heads = next(grids), [[]]
                    tubes = [radio.resize(next(opened)[1], th, tw, p)] if pixels else None
                visual = self._visual(heads, (th, tw), runs, len(ids))
                ids += visual
                mask += [train] * len(visual)   # image ids are never targets anyway (labels rule in make_row)
                if pixels:
                    images += tubes
            else:
                ids += x
                mask += train if isinstance(train, list) else [train] * len(x)
        n, long = len(ids), len(ids) > cfg.seq_len
        if long and self.overlong != "truncate":
            raise Overlong(f"{n} tokens is longer than seq_len {cfg.seq_len} (see --overlong)", n)
        if long:
            ids, mask, kept = formats.truncate(ids, mask, runs, cfg.seq_len)
            images = images[:kept]
        if not any(m and t != cfg.image_token_id for t, m in zip(ids[1:], mask[1:])):
            raise Overlong("no tokens to train on in its first seq_len tokens", n) if long else \
                Bad("no tokens to train on")
        self.n_truncated += long
        return ids, mask, images if pixels else None


def make_row(docs, cfg, pad_id, packed):
    """Documents [(ids, mask, images)] -> one Sample of seq_len tokens. Labels never cross a document boundary
    (each document's last token predicts nothing) and never ask for an image id (docs/vision.md §9)."""
    ids, labels, seq, images = [], [], [], []
    for d, (t, m, ims) in enumerate(docs):
        t, m = torch.tensor(t, dtype=torch.long), torch.tensor(m, dtype=torch.bool)
        target = t[1:]
        labels += [torch.where(m[1:] & (target != cfg.image_token_id), target, -100), torch.tensor([-100])]
        ids.append(t)
        seq.append(torch.full_like(t, d))
        images = None if ims is None or images is None else images + ims
    pad = cfg.seq_len - sum(len(t) for t in ids)
    ids.append(torch.full((pad,), pad_id))
    labels.append(torch.full((pad,), -100))
    seq.append(torch.full((pad,), len(docs)))    # padding is a document of its own: nothing attends into it
    return Sample(torch.cat(ids), torch.cat(labels), images, torch.cat(seq) if packed else None, pad)


# ---------------------------------------------------------------- the dataset

class Blend:
    """Megatron's greedy blending: index i goes to the source furthest behind its share, argmax_s w_s (i+1) - n_s.
    Deterministic, and every prefix is within one sample of the exact ratios. Built lazily in blocks."""

    def __init__(self, weights):
        self.w = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.counts = np.zeros(len(weights))
        self.source, self.draw = np.zeros(0, np.int64), np.zeros(0, np.int64)

    def __call__(self, i):
        """-> (source, how many earlier indices drew from that source)."""
        if len(self.w) == 1:
            return 0, i
        while i >= len(self.source):
            n, start = max(4096, len(self.source)), len(self.source)
            src, draw = np.empty(n, np.int64), np.empty(n, np.int64)
            for j in range(n):
                s = int(np.argmax(self.w * (start + j + 1) - self.counts))
                src[j], draw[j] = s, self.counts[s]
                self.counts[s] += 1
            self.source, self.draw = np.concatenate([self.source, src]), np.concatenate([self.draw, draw])
        return int(self.source[i]), int(self.draw[i])


def _remember(cache, key, value, most):   # cache[key] = value, the oldest entries beyond `most` dropped
    while len(cache) >= most:
        cache.pop(next(iter(cache)))
    cache[key] = value


class RealData:
    """JSONL sources [(weight, path, index)] -> Samples by global index (see the module docstring)."""

    def __init__(self, sources, encoder, seed, pack=False, name="train"):
        self.sources, self.enc, self.seed, self.pack, self.cfg = sources, encoder, seed, pack, encoder.cfg
        self.blend = Blend([w for w, _, _ in sources])
        # per source its 2 latest epochs' orders, 8 latest windows (a blend draws from each shard in turn)
        self.perms, self.windows = [{} for _ in sources], [{} for _ in sources]
        self.row_ends = [[0] for _ in sources]      # packed rows of source s: rows up to the end of each window
        packer = pack and f"{packing.NAME}/{packing.WINDOW}"   # a run resumed under another packer says so (Loader)
        self.fingerprint = hashlib.sha256(json.dumps(
            [name, seed, packer, encoder.fingerprint, [(w, os.path.abspath(p), int(idx["offsets"].sum()),
                                                        len(idx["offsets"])) for w, p, idx in sources]]
        ).encode()).hexdigest()[:16]

    def __getitem__(self, i):
        return self.sample(i)

    def __len__(self):
        """One pass over the data: every document once (unpacked), the rows that pack them all (packed: the rows of
        each source's first epoch, whose last window holds the epoch's last n mod packing.WINDOW documents, or a whole
        window's); exact for one source, the sum of the sources' counts for a blend."""
        total = 0
        for s, (_, _, idx) in enumerate(self.sources):
            n = len(idx["offsets"])
            total += self.rows_before(s, -(-n // packing.WINDOW)) if self.pack else n
        return total

    def perm(self, s, epoch):
        """Source s's documents in the order of its stream's epoch `epoch`: a seeded permutation."""
        if epoch not in self.perms[s]:
            key = hashlib.sha256(f"{self.seed}/{s}/{epoch}".encode()).digest()[:8]
            g = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
            perm = torch.randperm(len(self.sources[s][2]["offsets"]), generator=g).numpy()
            _remember(self.perms[s], epoch, perm.astype(np.int32 if len(perm) < 2 ** 31 else np.int64), 2)
        return self.perms[s][epoch]

    def doc(self, s, position):
        """Document (row in source s's index) at `position` of s's stream."""
        n = len(self.sources[s][2]["offsets"])
        return int(self.perm(s, position // n)[position % n])

    def window(self, s, w):
        """The packed rows (lists of documents) of window w of source s: an epoch is cut into windows of packing.WINDOW
        consecutive stream positions, the last one shorter, so no row holds a document twice (memory.tower_load)."""
        if w not in self.windows[s]:
            per_epoch = -(-len(self.sources[s][2]["offsets"]) // packing.WINDOW)
            first = w % per_epoch * packing.WINDOW
            docs = self.perm(s, w // per_epoch)[first:first + packing.WINDOW]
            rows = packing.best_fit_decreasing(self.sources[s][2]["lengths"][docs].tolist(), self.cfg.seq_len)
            _remember(self.windows[s], w, [[int(docs[i]) for i in row] for row in rows], 8)
        return self.windows[s][w]

    def rows_before(self, s, w):
        """Packed rows of source s before its window w."""
        ends = self.row_ends[s]
        while len(ends) <= w:
            ends.append(ends[-1] + len(self.window(s, len(ends) - 1)))
        return ends[w]

    def row(self, s, k):
        """Documents of packed row k of source s: the rows of its windows in order, so row k depends on nothing but
        k (every document fits a row alone: indexing)."""
        ends = self.row_ends[s]
        while ends[-1] <= k:
            self.rows_before(s, len(ends))             # extends ends by a window
        w = bisect.bisect_right(ends, k) - 1
        return self.window(s, w)[k - ends[w]]

    def load(self, s, d, pixels):
        _, path, idx = self.sources[s]
        where = formats.where(path, int(idx["lines"][d]), idx["kind"])
        try:
            ids, mask, images = self.enc.encode(formats.read(path, idx, d), os.path.dirname(os.path.abspath(path)),
                                                pixels)
        except Bad as e:   # e.g. an image that passed the header check but does not decode
            raise BadSample(f"{where}: {e}") from None
        if len(ids) != idx["lengths"][d]:
            raise BadSample(f"{where}: {len(ids)} tokens, the index says {idx['lengths'][d]}; file changed?")
        return ids, mask, images

    def sizes(self, i):
        """(non-padding tokens, patches of each image) of sample i from the index alone (a document's images share
        its patches evenly: the index keeps their sum)."""
        s, k = self.blend(i)
        idx = self.sources[s][2]
        docs = self.row(s, k) if self.pack else [self.doc(s, k)]
        patches = []
        for d in docs:
            n = int(idx["images"][d])
            q, r = divmod(4 * int(idx["image_tokens"][d]), max(n, 1))
            patches += [q + 1] * r + [q] * (n - r)
        return sum(int(idx["lengths"][d]) for d in docs), patches

    def sample(self, i, pixels=True):
        """Sample i; without pixels (language-only ranks) images are not decoded and Sample.images is None."""
        s, k = self.blend(i)
        docs = self.row(s, k) if self.pack else [self.doc(s, k)]
        return make_row([self.load(s, d, pixels) for d in docs], self.cfg, self.enc.sp["<pad>"], self.pack)


def build(cfg, tokenizer, verbose=True, train=None):
    """(train data, eval data or None) of the run's --data, --eval-data, --eval-frac, --train-on, --pack,
    --skip-bad-samples, --overlong and --data-columns, tokenized by `tokenizer` (load_tokenizer's). `train`:
    training data not read from files (mock.py), beside --eval-data."""
    enc = Encoder(tokenizer, cfg, cfg.train_on, cfg.overlong)
    columns = formats.parse_columns(cfg.data_columns)

    def sources(spec):   # the files of one entry share its weight by their document counts
        out = []
        for w, entry in formats.parse_blend(spec):
            files = formats.expand(entry)
            idx = [formats.index_file(p, enc, columns, cfg.skip_bad_samples, verbose) for p in files]
            total = sum(len(i["offsets"]) for i in idx)
            out += [(w * len(i["offsets"]) / total, p, i) for p, i in zip(files, idx)]
        return out

    if train is not None:
        return train, RealData(sources(cfg.eval_data), enc, cfg.seed, cfg.pack, "eval")
    train = sources(cfg.data)
    if cfg.eval_data:
        return RealData(train, enc, cfg.seed, cfg.pack), RealData(sources(cfg.eval_data), enc, cfg.seed,
                                                                      cfg.pack, "eval")
    if not cfg.eval_frac:
        if cfg.eval_every:
            raise SystemExit("--eval-every with real data needs --eval-data or --eval-frac")
        return RealData(train, enc, cfg.seed, cfg.pack), None
    head, tail = [], []                              # the last eval_frac of every file is held out
    for w, p, idx in train:
        n = len(idx["offsets"])
        cut = n - max(1, int(n * cfg.eval_frac))
        if cut < 1:
            raise SystemExit(f"{p}: {n} documents are too few to hold out --eval-frac {cfg.eval_frac}")
        keys = ("offsets", "lines", "lengths", "image_tokens", "images")
        head.append((w, p, {**idx, **{k: idx[k][:cut] for k in keys}}))
        tail.append((w, p, {**idx, **{k: idx[k][cut:] for k in keys}}))
    return RealData(head, enc, cfg.seed, cfg.pack), RealData(tail, enc, cfg.seed, cfg.pack, "eval")


class EvalSet:
    """The first n samples of a data set, then copies of sample 0 without loss tokens up to whole global
    micro-batches (spm samples): what every evaluation scores, whatever the layout."""

    def __init__(self, ds, n, spm):
        self.ds, self.n, self.size = ds, n, -(-n // spm) * spm
        self.fingerprint = f"{ds.fingerprint}-first{n}"

    def __len__(self):
        return self.size

    def sizes(self, i):
        return sizes(self.ds, i if i < self.n else 0)

    def sample(self, i, pixels=True):
        if i < self.n:
            return self.ds.sample(i, pixels)
        s = self.ds.sample(0, pixels)
        return Sample(s.input_ids, torch.full_like(s.labels, -100), s.images, s.seq_idx, s.n_pad)


# ---------------------------------------------------------------- loading ahead, per rank

class _Microbatches(torch.utils.data.Dataset):
    def __init__(self, ds, offsets, pixels, spm, order):
        self.ds, self.offsets, self.pixels, self.spm, self.order = ds, offsets, pixels, spm, order

    def slots(self, first):
        return self.order(first) if self.order is not None else range(first, first + self.spm)

    def __getitem__(self, first):
        out, slots = {}, self.slots(first)
        for o in self.offsets:   # in the rank's own process without workers: the watchdog sees each sample come
            out[slots[o]] = self.ds.sample(slots[o], self.pixels)
            watchdog.progress()
        return out


def _identity(x):
    return x


def _leave_signals_to_the_rank(worker_id):
    """A DataLoader worker ignores SIGINT, SIGTERM and SIGHUP: they reach it too (Ctrl-C and a closed terminal signal
    the terminal's process group, torchrun the rank's), and a worker ended by one would end the rank with an error
    before its signal save (failsafe.py). The rank ends its workers when it exits."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


class Loader:
    """The samples one rank owns, built ahead by DataLoader workers: step(base, n_micro) -> {global index: Sample}
    of the micro-batches starting at base, base + spm, ... `offsets`: the rank's positions in a micro-batch; which
    sample sits at each position is slots(first): index order, or `order`'s (lanes.Lanes: by cost). Asked for a
    position it did not expect (resume, a restarted eval), it restarts its stream there. state_dict() holds the
    next global sample index: one number serves every language lane, each lane's own samples follow from it."""

    def __init__(self, ds, offsets, samples_per_microbatch, pixels=True, num_workers=0, pin=False, order=None):
        self.ds, self.offsets, self.spm, self.pixels = ds, list(offsets), samples_per_microbatch, pixels
        self.num_workers, self.pin, self.next, self.it, self.order = num_workers, pin, 0, None, order
        self.source = _Microbatches(ds, self.offsets, pixels, samples_per_microbatch, order)
        self.slots = self.source.slots   # the global indices at each position of the micro-batch from sample `first`

    def step(self, base, n_micro):
        if self.it is None or base != self.next:
            self.it = iter(torch.utils.data.DataLoader(
                self.source, batch_size=None,
                sampler=itertools.count(base, self.spm), num_workers=self.num_workers, collate_fn=_identity,
                worker_init_fn=_leave_signals_to_the_rank, prefetch_factor=4 if self.num_workers else None,
                pin_memory=self.pin))
        out = {}
        for _ in range(n_micro):   # large images take long: each micro-batch that arrives is progress (watchdog)
            out.update(next(self.it))
            watchdog.progress()
        self.next = base + n_micro * self.spm
        return out

    def state_dict(self):
        return {"next_sample": self.next, "fingerprint": self.ds.fingerprint}

    def load_state_dict(self, state):
        if state.get("fingerprint") != self.ds.fingerprint:
            print(f"data: resuming on different data ({state.get('fingerprint')} -> {self.ds.fingerprint})",
                  flush=True)
        self.next, self.it = int(state["next_sample"]), None


# ---------------------------------------------------------------- collate

def collate_text(samples):
    """-> input_ids [B, L], labels [B, L], seq_idx [B, L] or None (no sample packed), valid [B, L] bool or None
    (no padding) (language side)."""
    seq = valid = None
    if any(s.seq_idx is not None for s in samples):
        seq = torch.stack([s.seq_idx if s.seq_idx is not None else torch.zeros_like(s.input_ids) for s in samples])
    if any(s.n_pad for s in samples):
        L = samples[0].input_ids.shape[0]
        valid = torch.stack([torch.arange(L) < L - s.n_pad for s in samples])
    return torch.stack([s.input_ids for s in samples]), torch.stack([s.labels for s in samples]), seq, valid


def collate_images(samples, cfg, move=None):
    """-> packed patch rows [Σ t*h*w, 3p²], grids [(h, w)], image rows per sample, frames [t] per item (vision side):
    an image is t = 1, a video tubelet [3t, H, W] gives each patch's t frame vectors as t consecutive rows
    (radio.VisionModel.embed). The sample's token budget fixed each size, so placeholders and rows agree.
    move: applied to each image before it is cut into patches (vlm.encode: to the GPU, where the permutation is a
    kernel; on the host it is strided copies of every pixel, while the GPU waits for them at a step's start)."""
    p, patches, grids, rows, frames = cfg.vit_patch, [], [], [], []
    for s in samples:
        n = 0
        for img in s.images:
            h, w, t = img.shape[1] // p, img.shape[2] // p, img.shape[0] // 3
            img = move(img) if move is not None else img
            patches.append(radio.patchify(img, p).reshape(h * w * t, 3 * p * p))
            grids.append((h, w))
            frames.append(t)
            n += h * w // 4
        rows.append(n)
    packed = torch.cat(patches) if patches else torch.zeros(0, 3 * p * p)
    return packed, grids, rows, frames
