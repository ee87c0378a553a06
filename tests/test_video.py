"""Video (docs/vision.md §11): the tower's tubelet embedder and the VLM's logits on a batch with a video, an image
and text == transformers' nemotron_h_omni (fp32 CPU); tubelets, canvas, frame sampling, decoding and the text
around tubelets == transformers' video processor code (called directly: its class needs torchvision, absent
here); video records by hand (files, frame lists, video_url, --video-fps / --max-frames), headers-only indexing,
bad videos; hetero training with videos == one process, resume bit-exact; FLOPs and memory plan count tubelets.
Test videos are written by PyAV in the test (PNG frames in .mov: lossless, so frames are known exactly)."""
import base64
import dataclasses
import json
import os
import types

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import config
import data
import formats
import hf_interop
import memory
import model
import radio
import train
import video
import vlm
from tests.spawn import run_distributed
from tests.test_hf_omni import IMAGE_ID, image, omni, our_logits  # noqa: F401 (omni: a fixture)
from tests.test_train import assert_states_match

av = pytest.importorskip("av")
transformers = pytest.importorskip("transformers")
from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import (  # noqa: E402
    NemotronH_Omni_Reasoning_V3Processor as OmniProcessor)
from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (  # noqa: E402
    NemotronH_Omni_Reasoning_V3VideoProcessor as OmniVideoProcessor)
from transformers.video_utils import VideoMetadata, default_sample_indices_fn, read_video_pyav  # noqa: E402

TINY = ["--preset", "tiny", "--video-temporal-patch", "2", "--video-target-patches", "16", "--global-batch", "4",
        "--lr-decay-iters", "6"]


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    torch.nn.utils.skip_init(torch.nn.Linear, 1, 1)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def frames_of(n, h, w, seed):
    """uint8 [n, h, w, 3] random frames."""
    return torch.randint(0, 256, (n, h, w, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def write_video(path, frames_FHW3, fps=4):
    """A lossless (PNG-coded) .mov of these frames."""
    with av.open(str(path), "w") as c:
        st = c.add_stream("png", rate=fps)
        st.height, st.width, st.pix_fmt = frames_FHW3.shape[1], frames_FHW3.shape[2], "rgb24"
        for f in frames_FHW3.numpy():
            for packet in st.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(packet)
        for packet in st.encode():
            c.mux(packet)
    return str(path)


def video_processor(target=16):
    """transformers' Omni video processor's own methods on a stand-in instance (the class wants torchvision)."""
    vp = types.SimpleNamespace(norm_mean=list(radio.CLIP_MEAN), norm_std=list(radio.CLIP_STD), patch_size=16,
                               downsample_ratio=0.5, video_target_num_patches=target, video_maintain_aspect_ratio=True,
                               temporal_patch_size=2, _downsample_factor=2)
    vp._compute_target_patches = lambda h, w: OmniVideoProcessor._compute_target_patches(vp, h, w)
    vp.preprocess = lambda videos: OmniVideoProcessor._preprocess(vp, videos)
    return vp


# ---------------------------------------------------------------- the model == transformers

@pytest.mark.slow
def test_video_forward_equals_transformers(omni, tmp_path):
    """One batch of three samples through our tower and LM: a video (3 frames: 2 tubelets, the second padded with
    the last frame), an image, text only; each row's logits == transformers on that sample alone (its forward
    takes images or videos per call, not both: both modalities use the image token)."""
    d, hf = omni
    cfg, sd = hf_interop.import_hf(d, preset="tiny")
    th, tw = video.canvas(40, 56, 24)
    assert (th, tw) == (4, 6)
    tubes = video.tubelets(frames_of(3, 40, 56, 0).permute(0, 3, 1, 2), th, tw, 16, 2)
    assert [tuple(t.shape) for t in tubes] == [(6, 64, 96)] * 2 and torch.equal(tubes[1][:3], tubes[1][3:])
    img = radio.normalize(image(16 * 4, 16 * 2, 9))
    g = torch.Generator().manual_seed(5)
    text = lambda n: torch.randint(0, 256, (n,), generator=g)   # noqa: E731
    run = lambda n: torch.full((n,), IMAGE_ID)                  # noqa: E731
    L = 30
    s_video = torch.cat([text(4), run(6), text(3), run(6), text(L - 19)])
    s_image = torch.cat([text(6), run(2), text(L - 8)])
    ids = torch.stack([s_video, s_image, text(L)])
    samples = [types.SimpleNamespace(images=i) for i in (tubes, [img], [])]
    _, grids, rows, frames = data.collate_images(samples, cfg)
    assert (grids, rows, frames) == ([(4, 6), (4, 6), (4, 2)], [12, 2, 0], [2, 2, 1])

    def theirs(m):
        with torch.no_grad():
            return torch.cat([m(input_ids=ids[:1], pixel_values_videos=torch.stack(tubes)[None]).logits,
                              m(input_ids=ids[1:2], pixel_values=radio.patchify(img, 16),
                                image_grid_hw=torch.tensor([[4, 2]])).logits, m(input_ids=ids[2:]).logits])

    got, want = our_logits(cfg, sd, ids, samples), theirs(hf)
    assert got.std() > 0.05 and (got - want).abs().max() < 1e-5
    # teeth: the video moves the logits, and through the video embedder (not the image one)
    plain = ids[:1].clone()
    plain[plain == IMAGE_ID] = 7
    with torch.no_grad():
        assert (hf(input_ids=plain).logits - want[:1]).abs().max() > 1e-2
    other = {**sd, "vision.video_embedder.weight": sd["vision.video_embedder.weight"] * 0.5}
    moved = our_logits(cfg, other, ids, samples)
    assert (moved[0] - got[0]).abs().max() > 1e-2 and torch.equal(moved[1:], got[1:])
    # export writes the video embedder we hold (a parameter, not a carried tensor): transformers reads it back
    hf_interop.export_hf(cfg, other, tmp_path / "out")
    back = transformers.NemotronH_Omni_Reasoning_V3.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert (theirs(back) - moved).abs().max() < 1e-5


def test_gpu_branch_of_attention_embeds_videos_alike():
    """The CUDA path's per-item attention ("loop") == the CPU mask path on a tubelet + image micro-batch."""
    cfg = config.resolve("tiny", {"video_temporal_patch": "2"})
    tower = radio.VisionModel(cfg).eval()
    tubes = video.tubelets(frames_of(4, 32, 32, 1).permute(0, 3, 1, 2), 2, 2, 16, 2)
    samples = [types.SimpleNamespace(images=tubes + [radio.normalize(image(32, 64, 2))])]
    with torch.no_grad():
        mask, _ = vlm.encode(tower, samples, cfg)
        real = radio.packed_attention
        radio.packed_attention = lambda q, k, v, lens, mode=None: real(q, k, v, lens, "loop")
        try:
            loop, _ = vlm.encode(tower, samples, cfg)
        finally:
            radio.packed_attention = real
    assert mask.shape == (1 + 1 + 2, cfg.hidden_size) and (mask - loop).abs().max() < 1e-5


# ---------------------------------------------------------------- preprocessing == transformers' processor code

def test_canvas_tubelets_and_sampling_equal_transformers():
    vp = video_processor()
    for target in (16, 24, 100, 1024):
        vp.video_target_num_patches = target
        for h, w in ((40, 56), (32, 32), (480, 640), (720, 1280), (100, 30), (9, 500)):
            assert video.canvas(h, w, target) == vp._compute_target_patches(h, w)[::-1], (target, h, w)
    vp.video_target_num_patches = 24
    clip = frames_of(5, 40, 56, 3).permute(0, 3, 1, 2)
    want = vp.preprocess([clip])["pixel_values_videos"][0]          # [3 tubelets, 6, 64, 96]
    got = torch.stack(video.tubelets(clip, 4, 6, 16, 2))
    assert want.shape == got.shape == (3, 6, 64, 96)
    # we normalise, then resize (radio.resize); transformers resizes, then normalises: equal up to rounding
    assert (got - want).abs().max() < 1e-5 and torch.equal(got[2, :3], got[2, 3:])
    for n, fps, want_fps, most in ((10, 5.0, 2, 0), (10, 5.0, 0, 3), (300, 30.0, 1, 0), (300, 29.97, 2, 8),
                                   (7, 4.0, 0, 0), (3, 30.0, 1, 0)):
        k = min(max(1, int(n / fps * want_fps)) if want_fps else n, most or n)
        ref = default_sample_indices_fn(VideoMetadata(total_num_frames=n, fps=fps), num_frames=k)
        assert video.sample_indices(n, fps, want_fps, most) == ref.tolist(), (n, fps, want_fps, most)
    assert video.sample_indices(10, 5.0, 2, 0) == [0, 2, 5, 7]                  # by hand: 4 frames of 2 s at 2 fps


def test_decode_equals_transformers_read_video_pyav(tmp_path):
    clip = frames_of(6, 32, 48, 4)
    path = write_video(tmp_path / "v.mov", clip, fps=3)
    assert video.probe(path) == (6, 3.0, (32, 48))
    at = video.sample_indices(6, 3.0, 2, 0)
    theirs, meta = read_video_pyav(path, lambda metadata, **kw: np.array(at))
    ours = video.decode(path, at)
    assert at == [0, 1, 3, 4] and torch.equal(ours, torch.from_numpy(theirs).permute(0, 3, 1, 2))
    assert torch.equal(ours, clip[at].permute(0, 3, 1, 2))                     # lossless: the frames written


def test_video_tokens_equal_transformers_processor(omni, tmp_path):
    """The tokens of a chat with a video: transformers' processor text (the template's slot for the video replaced
    by its replace_video_token: 'Frame k sampled at S seconds' labels, <img> + <image> x n + </img> per tubelet,
    newline-joined), tokenized by the same tokenizer; and the pixel values its video processor makes."""
    d, _ = omni
    cfg = dataclasses.replace(hf_interop.HFSource(d, "tiny", say=lambda m: None).cfg, video_target_patches=24,
                              video_fps=2.0, seq_len=400)
    tok = data.load_tokenizer(str(d), cfg)
    enc = data.Encoder(tok, cfg)
    clip = frames_of(9, 40, 56, 5)
    write_video(tmp_path / "v.mov", clip, fps=3)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what?"}, {"type": "video", "video": "v.mov"}]},
            {"role": "assistant", "content": "a cat."}]
    ids, mask, tubes = enc.encode({"messages": msgs}, str(tmp_path), pixels=True)

    at = default_sample_indices_fn(VideoMetadata(total_num_frames=9, fps=3.0), fps=2.0)      # 6 frames
    vp = video_processor(24)
    pv = vp.preprocess([clip[at].permute(0, 3, 1, 2)])["pixel_values_videos"]
    assert (torch.stack(tubes)[None] - pv).abs().max() < 1e-5
    stand_in = types.SimpleNamespace(video_processor=vp, image_start_token="<img>", image_token="<image>",
                                     image_end_token="</img>", video_temporal_patch_dim=2)
    expand = OmniProcessor.replace_video_token(stand_in, {
        "num_frames": [len(at)], "pixel_values_videos": pv,
        "video_metadata": [VideoMetadata(total_num_frames=9, fps=3.0, frames_indices=at)]}, 0)
    assert expand.startswith("Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.33 seconds: <img><image>")
    conv = [{"role": "user", "content": [{"type": "text", "text": "what?"}, {"type": "image"}]},
            {"role": "assistant", "content": "a cat."}]
    text = tok.tok.apply_chat_template(conv, tokenize=False).replace("<image>", expand)
    assert tok.tok.encode(text, add_special_tokens=False) == ids
    assert sum(mask) == len(tok.encode("a cat.<|im_end|>\n"))                   # the loss: the answer alone


# ---------------------------------------------------------------- data by hand

def _jsonl(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _chat(part, answer="ok"):
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": answer}]}


def test_video_record_by_hand(tmp_path):
    """Byte tokenizer (ChatML): a 5-frame 32x48 video at 4 fps on a 16-patch canvas (2 x 4 patches: 2 tokens a
    tubelet), sampled 3 frames -> 2 tubelets; as a file, as video_url, as a list of frame images (no rate: no
    timestamps); --video-fps and --max-frames choose the frames."""
    from PIL import Image
    clip = frames_of(5, 32, 48, 6)
    write_video(tmp_path / "v.mov", clip, fps=4)
    for i, f in enumerate(clip.numpy()):
        Image.fromarray(f).save(tmp_path / f"f{i}.png")
    cfg = config.resolve("tiny", {"video_temporal_patch": "2", "video_target_patches": "16", "max_frames": "3",
                                  "seq_len": "256"})
    enc = data.Encoder(data.load_tokenizer(None, cfg), cfg)
    sp = enc.sp
    ids, mask, tubes = enc.encode(_chat({"type": "video", "video": "v.mov"}), str(tmp_path), pixels=True)
    b = lambda s: list(s.encode())   # noqa: E731
    run = [sp["<img>"], cfg.image_token_id, cfg.image_token_id, sp["</img>"]]
    want = [sp["<|im_start|>"]] + b("user\n") + b("Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.25 "
                                                  "seconds: ") + run + b("\nFrame 3 sampled at 0.75 seconds: ") + \
        run + b("hi") + [sp["<|im_end|>"]] + b("\n") + [sp["<|im_start|>"]] + b("assistant\n") + b("ok") + \
        [sp["<|im_end|>"]] + b("\n")
    assert ids == want                                                   # frames 0, 1, 3 of 5 (i * 5 // 3)
    frames = clip[[0, 1, 3]].permute(0, 3, 1, 2)
    assert len(tubes) == 2 and torch.equal(tubes[0], torch.cat([radio.resize(frames[0], 2, 4, 16),
                                                                radio.resize(frames[1], 2, 4, 16)]))
    assert torch.equal(tubes[1], torch.cat([radio.resize(frames[2], 2, 4, 16)] * 2))
    assert enc.encode(_chat({"type": "video", "video": "v.mov"}), str(tmp_path), pixels=False)[0] == ids
    url = enc.encode(_chat({"type": "video_url", "video_url": {"url": "v.mov"}}), str(tmp_path), pixels=True)
    assert url[0] == ids and all(torch.equal(a, c) for a, c in zip(url[2], tubes))
    inline = "data:video/quicktime;base64," + base64.b64encode((tmp_path / "v.mov").read_bytes()).decode()
    url = enc.encode(_chat({"type": "video_url", "video_url": {"url": inline}}), str(tmp_path), pixels=True)
    assert url[0] == ids and all(torch.equal(a, c) for a, c in zip(url[2], tubes))
    listed = enc.encode(_chat({"type": "video", "video": [f"f{i}.png" for i in range(5)]}), str(tmp_path), True)
    assert bytes(i for i in listed[0] if i < 256).decode().count("Frame 1 and frame 2: ") == 1
    assert all(torch.equal(a, c) for a, c in zip(listed[2], tubes))      # the same frames, so the same tubelets
    # a sample: the video's rows through collate, 2 per tubelet, as its placeholders
    s = data.make_row([(ids, mask, tubes)], cfg, sp["<pad>"], packed=False)
    patches, grids, rows, frames = data.collate_images([s], cfg)
    assert patches.shape == (2 * 2 * 8, 768) and grids == [(2, 4)] * 2 and frames == [2, 2]
    assert rows == [int((s.input_ids == cfg.image_token_id).sum())] == [4]
    for flags, frames_kept in (({"video_fps": "2", "max_frames": "0"}, 2), ({"max_frames": "0"}, 5),
                               ({"video_fps": "100", "max_frames": "4"}, 4)):
        c = dataclasses.replace(cfg, **{k: type(getattr(cfg, k))(v) for k, v in flags.items()})
        e = data.Encoder(data.load_tokenizer(None, c), c)
        out = bytes(i for i in e.encode(_chat({"type": "video", "video": "v.mov"}), str(tmp_path), False)[0]
                    if i < 256).decode()
        assert f"rame {frames_kept} sampled" in out and f"rame {frames_kept + 1} " not in out, (flags, out)
    # the video's tokens count as text: an image beside it gets the room left, seq_len - 23 (ChatML) - 73 (the
    # video's 69-byte label, <img>, 2 tokens, </img>) - 2 (the image's <img></img>): at 128, 30 tokens = 120 patches,
    # so the 128 x 128 px image keeps its 8 x 8 grid; at 112, 56 patches: floor(8 sqrt(56/64)) = 7 a side, made
    # even: 8 x 7 fits, 8 x 8 does not, so 8 x 6 (docs/vision.md §8)
    Image.fromarray(frames_of(1, 128, 128, 7)[0].numpy()).save(tmp_path / "i.png")
    both = {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mov"},
                                                      {"type": "image", "image": "i.png"}]},
                         {"role": "assistant", "content": "ok"}]}
    for seq_len, (h, w) in ((128, (8, 8)), (112, (8, 6))):
        small = dataclasses.replace(cfg, seq_len=seq_len, max_frames=2)
        e = data.Encoder(data.load_tokenizer(None, small), small)
        ids2, _, items = e.encode(both, str(tmp_path), pixels=True)
        assert [tuple(x.shape) for x in items] == [(6, 32, 64), (3, 16 * h, 16 * w)], seq_len
        assert len(ids2) == 23 + 73 + 2 + h * w // 4 <= seq_len


def test_bad_videos(tmp_path, capsys, monkeypatch):
    """At indexing a video's header is read, not its frames: an unreadable one is FILE:LINE (a counted skip with
    --skip-bad-samples); frames that do not decode show when the sample loads, as a BadSample naming the line.
    No PyAV, or a tower without a video embedder: one line naming the fix."""
    write_video(tmp_path / "ok.mov", frames_of(4, 32, 32, 8))
    (tmp_path / "junk.mov").write_bytes(b"\0" * 500)
    lines = [_chat({"type": "video", "video": n}, a) for n, a in (("ok.mov", "aa"), ("junk.mov", "bb"),
                                                                   ("ok.mov", "cc"), ("gone.mov", "dd"))]
    path = _jsonl(tmp_path / "v.jsonl", lines)
    cfg = config.resolve("tiny", {"video_temporal_patch": "2", "video_target_patches": "16", "data": path,
                                  "seed": "7", "seq_len": "256"})
    tok = data.load_tokenizer(None, cfg)
    with pytest.raises(data.BadSample, match=f"^{path}:2: unreadable video .*junk.mov"):
        data.build(cfg, tok)
    decoded = []
    real = video.decode
    monkeypatch.setattr(video, "decode", lambda *a: decoded.append(a) or real(*a))
    ds, _ = data.build(dataclasses.replace(cfg, skip_bad_samples=True), tok)
    assert f"{path}: 2 documents, skipped 2 bad line(s)" in capsys.readouterr().out and not decoded
    assert "missing video" in " ".join(ds.sources[0][2]["bad"])
    assert ds.sample(0, pixels=False).images is None and not decoded          # language ranks decode nothing
    ds.sample(0)
    assert len(decoded) == 1                                                  # the vision rank does
    raw = (tmp_path / "ok.mov").read_bytes()                                  # damaged after indexing
    (tmp_path / "ok.mov").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(data.BadSample, match=f"^{path}:[13]: (undecodable|unreadable) video .*ok.mov"):
        ds.sample(0)
    monkeypatch.setattr(video, "_av", lambda: (_ for _ in ()).throw(SystemExit(
        "video data needs PyAV. Install it: pip install -e '.[video]'")))
    with pytest.raises(SystemExit, match=r"needs PyAV. Install it: pip install -e '.\[video\]'"):
        data.Encoder(tok, cfg).encode(lines[0], str(tmp_path), pixels=False)
    import builtins
    real_import = builtins.__import__
    monkeypatch.undo()
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "av" else real_import(name, *a, **k))
    with pytest.raises(SystemExit, match=r"^video data needs PyAV. Install it: pip install -e '.\[video\]'$"):
        video.probe(str(tmp_path / "ok.mov"))
    monkeypatch.undo()
    no_embedder = dataclasses.replace(cfg, video_temporal_patch=0)
    with pytest.raises(SystemExit, match="video data needs a tower with a video embedder. Pass "
                                         "--video-temporal-patch 2"):
        data.Encoder(tok, no_embedder).encode(lines[0], str(tmp_path), pixels=False)


def test_video_without_a_frame_size(tmp_path, capsys):
    """A real file whose header counts its frames but gives no frame size (its sample entry says 0 x 0 and its frames
    are no PNGs, so probing cannot decode one to learn it; the canvas divided by zero): FILE:LINE at indexing, a
    counted skip with --skip-bad-samples. A codec FFmpeg does not know: a Bad line too."""
    raw = bytearray(open(write_video(tmp_path / "ok.mov", frames_of(4, 32, 32, 8)), "rb").read())
    entry = raw.find(b"stsd") + 12                  # the box's type, version and flags, entry count: its sample entry
    raw[entry + 32:entry + 36] = bytes(4)           # whose width and height follow 32 bytes of other fields
    (tmp_path / "nosize.mov").write_bytes(bytes(raw).replace(b"\x89PNG", b"\0PNG"))
    assert video.probe(str(tmp_path / "ok.mov"))[2] == (32, 32)
    raw[entry + 4:entry + 8] = b"xxxx"              # its codec: one FFmpeg does not know (it had no codec context)
    (tmp_path / "nocodec.mov").write_bytes(raw)
    with pytest.raises(formats.Bad, match="^undecodable video .*nocodec.mov: FFmpeg has no decoder for its codec$"):
        video.probe(str(tmp_path / "nocodec.mov"))
    path = _jsonl(tmp_path / "v.jsonl", [_chat({"type": "video", "video": n}, a) for n, a in (("ok.mov", "aa"),
                                                                                              ("nosize.mov", "bb"))])
    cfg = config.resolve("tiny", {"video_temporal_patch": "2", "video_target_patches": "16", "data": path,
                                  "seq_len": "256"})
    tok = data.load_tokenizer(None, cfg)
    with pytest.raises(data.BadSample, match=f"^{path}:2: video .*nosize.mov: its header gives no frame size$"):
        data.build(cfg, tok)
    ds, _ = data.build(dataclasses.replace(cfg, skip_bad_samples=True), tok)
    assert f"{path}: 1 documents, skipped 1 bad line(s)" in capsys.readouterr().out


def test_video_damaged_after_indexing_is_skipped_on_every_rank(tmp_path, capfd):
    """Hetero on 2 ranks (vision 0, language 1): a video broken after indexing fails where it is read, and the step
    blanks that sample on both ranks, reported with its file:line, as a damaged image is (failsafe.SkipBad)."""
    for name in "abc":
        write_video(tmp_path / f"{name}.mov", frames_of(2, 32, 32, ord(name)))
    path = _jsonl(tmp_path / "v.jsonl", [_chat({"type": "video", "video": f"{n}.mov"}, n * 2) for n in "abc"])
    argv = TINY + ["--vision-dp", "1", "--lm-dp", "1", "--data", path, "--skip-bad-samples", "--seq-len", "256",
                   "--seed", "1234"]
    cfg = config.resolve("tiny", {"video_temporal_patch": "2", "video_target_patches": "16", "data": path,
                                  "seed": "1234", "seq_len": "256", "skip_bad_samples": "true"})
    ds, _ = data.build(cfg, data.load_tokenizer(None, cfg))                   # the index cache
    raw = (tmp_path / "b.mov").read_bytes()
    (tmp_path / "b.mov").write_bytes(raw[: len(raw) // 2])
    bad = [i for i in range(8) if ds.doc(0, i) == 1]   # samples of the 2 steps that draw b.mov's line
    results = run_distributed(_train, 2, argv + ["--steps", "2"], timeout=120.0)
    assert all(loss is not None for loss, _ in results[1][0]) and len(results[0][0]) == 2
    out = capfd.readouterr().out
    for n, i in enumerate(bad, 1):
        assert f"skipped sample {i} ({path}:2: " in out and f"{n} skipped at load time so far" in out, out
    assert out.count("skipped at load time so far") == len(bad) >= 1 and "b.mov" in out


# ---------------------------------------------------------------- training

def _video_data(tmp_path):
    """8 chats, each a 2-4 frame video (different sizes, so different canvases) and an answer; two also carry an
    image; one is text only."""
    from PIL import Image
    lines = []
    for i in range(8):
        n, (h, w) = 2 + i % 3, ((32, 32), (32, 64), (48, 32))[i % 3]
        write_video(tmp_path / f"v{i}.mov", frames_of(n, h, w, 10 + i))
        content = [{"type": "video", "video": f"v{i}.mov"}, {"type": "text", "text": f"q{i}"}]
        if i in (2, 5):
            Image.fromarray(frames_of(1, 32, 48, 30 + i)[0].numpy()).save(tmp_path / f"i{i}.png")
            content.append({"type": "image", "image": f"i{i}.png"})
        lines.append({"messages": [{"role": "user", "content": content if i != 7 else f"q{i}"},
                                   {"role": "assistant", "content": "ab" * (1 + i % 2)}]})
    return _jsonl(tmp_path / "videos.jsonl", lines)


def _train(rank, world, argv):
    history, modules = train.main(list(argv))
    return [(h["loss"], h["grad_norm"]) for h in history], \
        {f"{k}.{n}": t.detach().clone() for k, m in modules.items() for n, t in m.state_dict().items()}


@pytest.mark.slow
def test_hetero_training_with_videos_equals_one_process_and_resumes_exactly(tmp_path):
    """--stage 3 (the tower and its video embedder train) on video data: hetero (vision dp2 on ranks 0-1,
    language dp2 on 2-3) == one process; a run stopped after 2 steps and resumed == the straight run, bit for
    bit; the video embedder moved."""
    argv = TINY + ["--data", _video_data(tmp_path), "--stage", "3", "--lr", "1e-3", "--seq-len", "256"]
    hetero = argv + ["--vision-dp", "2", "--lm-dp", "2"]   # named: the chooser may pick colocated at 4 ranks
    (one,) = run_distributed(_train, 1, argv + ["--steps", "4"], timeout=120.0)
    straight = run_distributed(_train, 4, hetero + ["--steps", "4"], timeout=120.0)
    (init,) = run_distributed(_train, 1, argv + ["--steps", "0"], timeout=120.0)
    for (a, ga), (b, gb) in zip(straight[2][0], one[0]):
        assert abs(a - b) <= 1e-5 and abs(ga - gb) <= 1e-5 * gb, (straight[2][0], one[0])
    assert_states_match({**straight[0][1], **straight[2][1]}, one[1], "hetero with videos", atol=1e-5)
    key = "vision.video_embedder.weight"
    assert (one[1][key] - init[1][key]).abs().max() > 1e-4                    # it trains (stage 3)
    save = str(tmp_path / "ckpt")
    first = run_distributed(_train, 4, hetero + ["--steps", "2", "--save", save, "--save-every", "2"], timeout=120.0)
    resumed = run_distributed(_train, 4, hetero + ["--steps", "4", "--load", save], timeout=120.0)
    for rank in range(4):
        assert first[rank][0] + resumed[rank][0] == straight[rank][0], rank
        assert sorted(resumed[rank][1]) == sorted(straight[rank][1])
        assert all(torch.equal(resumed[rank][1][k], straight[rank][1][k]) for k in straight[rank][1]), rank


def test_load_hf_omni_trains_and_exports_the_video_embedder(omni, tmp_path):
    """train.py --load of a transformers Omni directory on video data (its chat template and tokenizer): at stage 3
    the video embedder trains, at stage 2 it stays as loaded; export-hf writes the trained one, also over a video
    embedder that a checkpoint of an earlier version carried in source/carried.safetensors."""
    d, hf = omni
    original = hf.vision_model.embeddings.video_patch_projection.weight.detach().clone()
    videos = _video_data(tmp_path)
    key = "vision.video_embedder.weight"
    for stage in (2, 3):
        save = str(tmp_path / f"run{stage}")
        argv = ["--load", str(d), "--preset", "tiny", "--data", videos, "--video-target-patches", "16",
                "--global-batch", "2", "--steps", "1", "--stage", str(stage), "--lr", "1e-2", "--seq-len", "256",
                "--save", save]
        (hist, state), = run_distributed(_train, 1, argv, timeout=120.0)
        assert hist[0][0] is not None and torch.equal(state[key], original) == (stage == 2), stage
    source = os.path.join(save, "step_00000001", checkpoint.SOURCE_DIR, hf_interop.CARRIED_NAME)
    stale = {"vision_model.radio_model.model.patch_generator.video_embedder.weight": original}
    checkpoint.write_atomic(source, {**load_file(source), **stale})
    hf_interop.main(["export-hf", "--load", save, "--out", str(tmp_path / "out")])
    back = transformers.NemotronH_Omni_Reasoning_V3.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert torch.equal(back.vision_model.embeddings.video_patch_projection.weight, state[key])


def test_stage_freezes_video_embedder_with_the_tower():
    cfg = config.resolve("tiny", {"video_temporal_patch": "2"})
    tower = radio.VisionModel(cfg)
    for stage, trains in ((1, False), (2, False), (3, True)):
        model.set_trainable({"vision": tower}, stage)
        assert tower.video_embedder.weight.requires_grad == trains == tower.embedder.weight.requires_grad


def test_flops_and_memory_plan_count_video_tubelets():
    cfg = config.resolve("tiny", {"video_temporal_patch": "2", "video_target_patches": "16", "seq_len": "96"})
    C, p = cfg.vit_hidden, cfg.vit_patch
    image, tube = radio.flops(cfg, [(4, 4)], True), radio.flops(cfg, [(4, 4)], True, [2])
    assert tube - image == 3 * 2 * (16 + cfg.class_token_len) * 3 * p * p * C      # the embedder's second frame
    lay = types.SimpleNamespace(vision_micro_batch=2)
    # mock 64 px image: 16 patches a sample; a 96-token sample holds 24 tubelets of 4 x 4 patches (4 tokens each)
    assert memory.vision_tokens(dataclasses.replace(cfg, video_temporal_patch=0), lay) == (2 * (16 + 2), 2 * 4)
    assert memory.vision_tokens(cfg, lay) == (2 * 24 * (16 + 2), 2 * 24 * 4)
