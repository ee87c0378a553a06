"""Videos in the data (docs/vision.md §11), as transformers' Omni processor reads them: the header, frame sampling,
decoding (PyAV), the fixed canvas, tubelets [3t, H, W] of t frames and the text around them.

Shape suffixes: F frames   3 RGB   H, W pixels   t frames per tubelet
"""
import contextlib
import math

import numpy as np
import torch

import radio
from formats import Bad


def _av():
    try:
        import av
    except ImportError:
        raise SystemExit("video data needs PyAV. Install it: pip install -e '.[video]'") from None
    return av


def _name(src):
    return getattr(src, "name", src)


@contextlib.contextmanager
def _opened(src, failing):
    """The container of video `src`; PyAV's errors as one Bad line ("{failing} video NAME: why")."""
    av = _av()
    try:
        with av.open(src) as c:
            yield c
    except FileNotFoundError:
        raise Bad(f"missing video {_name(src)}") from None
    except (av.FFmpegError, OSError, ValueError) as e:
        raise Bad(f"{failing} video {_name(src)}: {e}") from None


def probe(src):
    """-> (frames in the file, frames per second or None, (H, W)) from the container's header alone."""
    with _opened(src, "unreadable") as c:
        if not c.streams.video:
            raise Bad(f"video {_name(src)}: no video stream")
        st = c.streams.video[0]
        fps = float(st.average_rate) if st.average_rate else None
        n = st.frames
        if not n and fps:   # containers that do not count them (Matroska): their duration x the rate
            secs = float(st.duration * st.time_base) if st.duration else (c.duration or 0) / 1e6
            n = round(secs * fps)
        if not n:
            raise Bad(f"video {_name(src)}: its header gives no frame count")
        if st.codec_context is None:
            raise Bad(f"undecodable video {_name(src)}: FFmpeg has no decoder for its codec")
        size = st.codec_context.height, st.codec_context.width
        if not all(size):   # the canvas keeps its aspect
            raise Bad(f"video {_name(src)}: its header gives no frame size")
        return int(n), fps, size


def sample_indices(n, fps, want_fps, max_frames):
    """Which of n frames to keep: transformers' default_sample_indices_fn (k evenly spaced frames) at a wanted rate
    (every frame without one or an unknown rate), at most max_frames (0: no limit)."""
    k = max(1, int(n / fps * want_fps)) if want_fps and fps else n
    k = min(k, max_frames or k, n)
    return [i * n // k for i in range(k)]


def decode(src, indices):
    """-> uint8 [F, 3, H, W] RGB of the frames at `indices` (increasing), decoding from the start as transformers'
    read_video_pyav does."""
    want, frames = set(indices), []
    with _opened(src, "undecodable") as c:
        for i, frame in enumerate(c.decode(video=0)):
            if i > indices[-1]:
                break
            if i in want:
                frames.append(frame.to_ndarray(format="rgb24"))
    if len(frames) != len(indices):
        raise Bad(f"undecodable video {_name(src)}: {len(frames)} of the {len(indices)} sampled frames decode")
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)


def canvas(H, W, target):
    """A video's patch grid (th, tw): transformers' Omni `_compute_target_patches`, its aspect kept, each side
    rounded up to even if both fit `target` together, else down (at least 2)."""
    aspect = W / max(H, 1)
    th, tw = max(round(math.sqrt(target / aspect)), 1), max(round(math.sqrt(target * aspect)), 1)
    up_h, up_w = th + th % 2, tw + tw % 2
    if up_h * up_w <= target:
        return up_h, up_w
    return max(2, th - th % 2), max(2, tw - tw % 2)


def tubelets(frames_F3HW, th, tw, p, t):
    """Frames (uint8 RGB) -> [3t, th*p, tw*p] CLIP-normalised tubelets: each frame resized as an image is
    (radio.resize), the last frame repeated up to a multiple of t, t consecutive frames stacked on the channels."""
    x = torch.stack([radio.resize(f, th, tw, p) for f in frames_F3HW])
    if len(x) % t:
        x = torch.cat([x, x[-1:].expand(t - len(x) % t, -1, -1, -1)])
    return list(x.reshape(-1, 3 * t, th * p, tw * p))


def labels(indices, fps, t):
    """The text before each tubelet: 'Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50 seconds: ', or
    'Frame 1 and frame 2: ' without a known rate."""
    ms = int(1000.0 / fps) if fps else None
    out = []
    for g in range(math.ceil(len(indices) / t)):
        parts = []
        for k in range(g * t, min(g * t + t, len(indices))):
            head = "Frame" if k == g * t else "frame"
            parts.append(f"{head} {k + 1}" + (f" sampled at {indices[k] * ms / 1000.0:.2f} seconds" if ms else ""))
        out.append(" and ".join(parts) + ": ")
    return out
