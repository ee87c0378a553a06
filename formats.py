"""Where documents come from (docs/data.md §2): files (JSONL, JSON arrays, parquet shards), the record shapes people
store chats in, made data.py's forms (to_record), and the one-pass index of every file. A JSON array is read element
by element and parquet in record batches, so memory never depends on the dataset's size.
"""
import array
import base64
import contextlib
import functools
import glob
import hashlib
import io
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch.distributed as dist
from tqdm import tqdm

import watchdog

LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
COLUMNS = {"messages": ("messages", "conversations", "text"), "images": ("images", "image")}
SUFFIXES = (".jsonl", ".json", ".parquet")
MAX_LOGGED = 5  # bad records whose reasons are printed per file under --skip-bad-samples
INDEX_VERSION = 2   # what an index holds (2: each document's image tokens and images); part of its cache's key
SPACE = re.compile(r"\s*")


class BadSample(ValueError):
    """A bad input record; the message starts with file:line (file:row N for parquet)."""


class Bad(Exception):
    """The reason a document is bad, before its file and line are known."""


class Overlong(Bad):
    """A document longer than seq_len (of `tokens` tokens): an error, a counted skip or truncated, by --overlong."""

    def __init__(self, message, tokens):
        super().__init__(message)
        self.tokens = tokens


# ---------------------------------------------------------------- files

def parse_blend(spec):
    """"a.jsonl" -> [(1.0, "a.jsonl")];  "0.7:a.jsonl,0.3:b/*.parquet" -> [(0.7, "a.jsonl"), (0.3, "b/*.parquet")]."""
    out = []
    for item in spec.split(","):
        head, colon, tail = item.partition(":")
        weight, path = (head, tail.strip()) if colon and not os.path.exists(item.strip()) else ("1", item.strip())
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not (math.isfinite(w) and w > 0) or not path:
            raise SystemExit(f"bad data entry {item!r}: weight {weight!r} is not a finite number > 0. Write "
                             "WEIGHT:PATH, e.g. 0.7:a.jsonl,0.3:b.jsonl")
        out.append((w, path))
    return out


def expand(entry):
    """A --data path, directory or glob -> its files, sorted."""
    if os.path.isdir(entry):
        files = [os.path.join(entry, f) for f in sorted(os.listdir(entry)) if f.endswith(SUFFIXES)]
    else:
        files = sorted(glob.glob(entry)) if glob.has_magic(entry) else [entry] * os.path.exists(entry)
    if not files:
        what = f"directory {entry} holds no {'/'.join(SUFFIXES)} files" if os.path.isdir(entry) else \
            f"data file {entry} does not exist"
        raise SystemExit(f"{what}. Check the path (relative to {os.getcwd()})")
    return files


def parse_columns(spec):
    """"messages=conv,images=img" -> {"messages": "conv", "images": "img"} (None: the defaults)."""
    out = {}
    for item in spec.split(",") if spec else []:
        role, _, name = item.partition("=")
        if role.strip() not in COLUMNS or not name.strip():
            raise SystemExit(f"bad --data-columns entry {item!r}: expected messages=NAME or images=NAME")
        out[role.strip()] = name.strip()
    return out


def _kind(path):
    if path.endswith(".parquet"):
        return "parquet"
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return "array" if head.startswith(b"[") else "lines"


@contextlib.contextmanager
def _reading(path, bad=False):
    """Reading data file `path`: an OSError or a pyarrow error ends the run with one line, or with bad=True (a file
    that changed after indexing) is the record's Bad."""
    try:
        yield
    except Exception as e:
        pa = sys.modules.get("pyarrow")   # imported if it raised
        if not (isinstance(e, OSError) or pa is not None and isinstance(e, pa.ArrowException)):
            raise
        cause = " ".join(str(getattr(e, "strerror", None) or e).split()).rstrip(".")
        if bad:
            raise Bad(f"cannot read the file ({cause})") from None
        raise SystemExit(f"{path}: cannot read ({cause}). Fix or remove the file, or leave it out of --data / "
                         "--eval-data") from None


def where(path, line, kind):   # file:line, or file:row N (from 0) in parquet
    return f"{path}:row {line}" if kind == "parquet" else f"{path}:{line}"


def _parse(raw):
    try:
        return to_record(json.loads(raw))
    except ValueError as e:                          # JSONDecodeError and UnicodeDecodeError
        raise Bad(f"malformed JSON: {e}") from None


def _array_scan(f, path):
    """(byte offset, line, raw bytes) of each element of a top-level JSON array, read 1 MiB at a time. Decoded as
    latin-1 (a char per byte) only to find the bounds: UTF-8 never puts an ASCII byte inside a multi-byte character."""
    dec, text, base, pos, line, eof = json.JSONDecoder(), "", 0, 0, 1, False

    def more(n=1 << 20):                             # drop what is consumed, read on
        nonlocal text, base, pos, eof
        chunk = f.read(max(n, len(text) - pos))
        text, base, pos, eof = text[pos:] + chunk.decode("latin-1"), base + pos, 0, not chunk

    def skip(expected):                              # whitespace, then one of `expected` -> that char
        nonlocal pos, line
        while True:
            end = SPACE.match(text, pos).end()
            line, pos = line + text.count("\n", pos, end), end
            if pos < len(text) or eof:
                break
            more()
        if pos == len(text) or text[pos] not in expected:
            raise BadSample(f"{path}:{line}: malformed JSON array (expected one of {expected!r})")
        return text[pos]

    skip("[")
    pos += 1
    while True:
        if skip("]{") == "]":
            return
        try:
            _, end = dec.raw_decode(text, pos)
        except ValueError:
            if eof:
                raise BadSample(f"{path}:{line}: malformed JSON array element") from None
            more(len(text))
            continue
        yield base + pos, line, text[pos:end].encode("latin-1")
        line, pos = line + text.count("\n", pos, end), end
        if skip(",]") == "]":
            return
        pos += 1


@functools.lru_cache(maxsize=64)
def _parquet(path, pid):
    """(ParquetFile, first row of each row group); per process: DataLoader workers must not share file handles."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"{path}: reading parquet needs pyarrow: pip install -e '.[parquet]'") from None
    pf = pq.ParquetFile(path)
    rows = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
    return pf, np.cumsum([0] + rows)


@functools.lru_cache(maxsize=4)
def _row_group(path, pid, i, columns):
    return _parquet(path, pid)[0].read_row_group(i, columns=list(columns))


def _resolve_columns(path, wanted):
    """-> (messages column, images column or "") of this parquet file."""
    names = _parquet(path, os.getpid())[0].schema_arrow.names
    out = []
    for role, defaults in COLUMNS.items():
        found = wanted[role] if wanted.get(role) in names else next((n for n in defaults if n in names), "")
        if role in wanted and found != wanted[role] or role == "messages" and not found:
            raise SystemExit(f"{path}: no column {wanted.get(role, ' or '.join(defaults))} (it has {names}); "
                             "name yours with --data-columns messages=NAME,images=NAME")
        out.append(found)
    return tuple(out)


def _from_row(row, columns):
    turns, images = row[columns[0]], row[columns[1]] if columns[1] else None
    if turns is None:
        raise Bad(f"no {columns[0]} in this row")
    record = {"text": turns} if isinstance(turns, str) else {"messages": turns}
    return to_record({**record, "images": images} if images is not None else record)


def scan(path, kind, columns):
    """-> iterator of (key, line, record()): key finds the record again (read), line (parquet: row) names it;
    record() returns it in data.py's form or raises Bad."""
    with _reading(path):
        if kind == "parquet":
            batches = _parquet(path, os.getpid())[0].iter_batches(256, columns=[c for c in columns if c])
            row = 0
            for batch in batches:                    # streamed: memory never depends on the file's size
                for r in batch.to_pylist():
                    yield row, row, functools.partial(_from_row, r, columns)
                    row += 1
            return
        with open(path, "rb") as f:
            if kind == "array":
                for offset, line, raw in _array_scan(f, path):
                    yield offset, line, functools.partial(_parse, raw)
                return
            offset = 0
            for line, raw in enumerate(f, 1):
                if raw.strip():
                    yield offset, line, functools.partial(_parse, raw)
                offset += len(raw)


def read(path, idx, d):
    """Record d of an index of `path` (raises Bad)."""
    key, kind = int(idx["offsets"][d]), str(idx["kind"])
    with _reading(path, bad=True):
        if kind == "parquet":
            pid, cols = os.getpid(), tuple(str(c) for c in idx["columns"])
            _, starts = _parquet(path, pid)
            g = int(np.searchsorted(starts, key, side="right")) - 1
            table = _row_group(path, pid, g, tuple(c for c in cols if c))
            return _from_row(table.slice(key - int(starts[g]), 1).to_pylist()[0], cols)
        with open(path, "rb") as f:
            f.seek(key)
            if kind == "lines":
                return _parse(f.readline())
            raw, n = b"", 1 << 16
            while True:
                chunk = f.read(n)
                raw += chunk
                try:
                    return _parse(raw[:json.JSONDecoder().raw_decode(raw.decode("latin-1"))[1]])
                except ValueError:
                    if not chunk:
                        raise Bad("malformed JSON array element") from None
                n *= 2


# ---------------------------------------------------------------- records

def _image(entry):
    """An image entry -> a path (str) or encoded bytes."""
    if isinstance(entry, dict):
        entry = entry.get("bytes") or entry.get("path")
    if isinstance(entry, (str, bytes)) and entry:
        return entry
    raise Bad(f"bad image entry {str(entry)[:80]} (expected a path, bytes or {{'bytes': ..., 'path': ...}})")


def to_record(obj):
    """A decoded record -> data.py's form: LLaVA conversations become messages; with images beside the messages,
    each <image> in a text (and its newline) and each image part without a reference takes the next of them."""
    if not isinstance(obj, dict):
        return obj
    turns = obj.get("conversations", obj.get("messages"))
    llava = isinstance(turns, list) and turns and isinstance(turns[0], dict) and "from" in turns[0]
    if not llava and ("images" not in obj or not isinstance(turns, list)):
        return obj
    images, messages, k = obj.get("image", obj.get("images")), [], 0
    images = [] if images is None else [_image(e) for e in (images if isinstance(images, list) else [images])]
    for m in turns:
        m = _llava_turn(m) if llava else m
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str) and "<image>" in content:
            pieces = re.split(r"<image>\n?", content)
            content = [{"type": "text", "text": pieces[0]}] * bool(pieces[0])
            for text in pieces[1:]:
                content += [{"type": "image"}] + [{"type": "text", "text": text}] * bool(text)
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image" and not p.get("image"):
                    p, k = {"type": "image", "image": images[k] if k < len(images) else None}, k + 1
                parts.append(p)
            m = {**m, "content": parts}
        messages.append(m)
    if k != len(images):
        raise Bad(f"{k} image places (<image> or image parts) for {len(images)} images")
    return {"messages": messages}


def _llava_turn(t):
    role, value = (LLAVA_ROLES.get(t.get("from")), t.get("value")) if isinstance(t, dict) else (None, None)
    if role is None or not isinstance(value, str):
        raise Bad(f"bad conversation turn {str(t)[:80]} (expected from: human/gpt/system and a string value)")
    return {"role": role, "content": value}


def image_source(ref, base_dir):
    """An image reference -> what PIL opens: a path (relative to the data file), or bytes (a data: URL's, stored)."""
    if isinstance(ref, bytes):
        return _named(ref, "embedded image")
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if not head.endswith(";base64"):
            raise Bad(f"image data URL {ref[:40]}...: only base64 data URLs are supported")
        try:
            return _named(base64.b64decode(payload, validate=True), f"data URL {ref[:40]}...")
        except ValueError as e:
            raise Bad(f"image data URL {ref[:40]}...: bad base64 ({e})") from None
    if re.match(r"^[a-z]+://", ref):
        raise Bad(f"image {ref}: remote URLs are not fetched; download it and give its path")
    return os.path.join(base_dir, ref)


def _named(raw, name):
    f = io.BytesIO(raw)
    f.name = name   # what error messages call it
    return f


def truncate(ids, mask, runs, seq_len):
    """The first seq_len tokens of a document, ending before an image run [a, b) that does not fit. -> (ids, mask,
    images kept)."""
    cut, kept = seq_len, len(runs)
    for k, (a, b) in enumerate(runs):
        if b > seq_len:
            cut, kept = min(a, seq_len), k
            break
    return ids[:cut], mask[:cut], kept


# ---------------------------------------------------------------- the index

def index_file(path, encoder, columns=None, skip_bad=False, verbose=True):
    """One pass over a file: every good record's key, line, token length, image tokens and images (a tubelet counts
    as one). Cached beside the file, keyed by everything that changes lengths or validity; local rank 0 indexes,
    the node's others wait for it (_Shared); in a read-only directory every rank indexes for itself."""
    with _reading(path):
        st = os.stat(path)
    key = hashlib.sha256(json.dumps([INDEX_VERSION, os.path.abspath(path), st.st_size, st.st_mtime_ns,
                                     encoder.fingerprint, skip_bad, sorted((columns or {}).items())]).encode()
                         ).hexdigest()[:16]
    cache = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{key}.idx.npz")
    shared = _Shared(cache) if os.access(os.path.dirname(os.path.abspath(path)), os.W_OK) else None
    if shared is not None and not shared.owner:
        shared.wait(path)
    if os.path.exists(cache):
        with np.load(cache) as z:
            idx = {k: z[k] for k in z.files}
    else:
        try:
            idx = _index(path, encoder, columns or {}, skip_bad, verbose and st.st_size >= 2 ** 24)
            if shared is not None:
                _write_cache(path, cache, idx)
        except (SystemExit, BadSample) as e:   # the waiting ranks end with this message too
            if shared is not None:
                shared.fail(str(e.code if isinstance(e, SystemExit) else f"{e}. Fix the line or pass "
                                "--skip-bad-samples"))
            raise
    counts = [f"{int(idx['truncated'])} truncated to seq_len"] * bool(idx["truncated"]) + \
        [f"skipped {len(idx['overlong'])} over-long"] * bool(len(idx["overlong"])) + \
        [f"skipped {len(idx['bad'])} bad line(s)"] * bool(len(idx["bad"]))
    if verbose and counts:
        reasons = list(idx["bad"][:MAX_LOGGED]) + list(idx["overlong"][:MAX_LOGGED])   # none for truncations
        print(f"{path}: {len(idx['offsets'])} documents, " + ", ".join(counts) +
              ("; first reasons:\n  " + "\n  ".join(reasons) if reasons else ""), flush=True)
    if not len(idx["offsets"]):
        raise SystemExit(f"{path}: no usable documents")
    return idx


def _write_cache(path, cache, idx):
    """Atomically (readers never see half a file); a failed write (a full disk) is an error, leaving nothing."""
    tmp = f"{cache}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **idx)
        os.replace(tmp, cache)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise SystemExit(f"{path}: cannot write its index cache {cache} ({type(e).__name__}: {e.strerror or e}). "
                         f"Free space in {os.path.dirname(os.path.abspath(cache))}, or make it read-only (every "
                         "rank then indexes for itself)") from None


class _Shared:
    """Local rank 0's indexing of one file, through the process group's store: it writes the cache or a failure
    message; a waiting rank ends with that message, or its own when local rank 0 is gone, rather than wait forever."""

    def __init__(self, cache):
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        self.owner = store is None or int(os.environ.get("LOCAL_RANK", 0)) == 0
        self.store, self.cache = store, cache
        self.key = f"index/{os.environ.get('GROUP_RANK', '0')}/{os.path.abspath(cache)}"
        if store is not None and self.owner:
            store.set(self.key + "/pid", str(os.getpid()))

    def fail(self, message):
        if self.store is not None:
            self.store.set(self.key + "/failed", message)

    def wait(self, path):
        while not os.path.exists(self.cache):
            if self.store.check([self.key + "/failed"]):
                raise SystemExit(self.store.get(self.key + "/failed").decode())
            if self.store.check([self.key + "/pid"]):
                pid = int(self.store.get(self.key + "/pid"))
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    raise SystemExit(f"{path}: local rank 0 (pid {pid}) ended before it indexed the file; its "
                                     "output says why") from None
            time.sleep(0.2)


def _index(path, encoder, columns, skip_bad, progress):
    """The index of one file (index_file); over-long documents under --overlong error end it once all are counted."""
    base = os.path.dirname(os.path.abspath(path))
    with _reading(path):
        kind = _kind(path)
        cols = _resolve_columns(path, columns) if kind == "parquet" else ()
    rows, bad, overlong, truncated = array.array("q"), [], [], encoder.n_truncated
    too_long = []                                    # (tokens, line) of each over-long document under --overlong error
    for key, line, record in tqdm(scan(path, kind, cols), f"indexing {path}", unit=" records", disable=not progress):
        watchdog.progress()   # a large file takes long, record by record: the watchdog sees it move (set-up)
        try:
            ids, _, _ = encoder.encode(record(), base, pixels=False, verify=True)
            image = np.asarray(ids) == encoder.cfg.image_token_id   # an image's placeholders are one run
            rows.extend((key, line, len(ids), int(image.sum()), int((image[1:] & ~image[:-1]).sum() + image[0])))
        except Bad as e:
            skip_long = isinstance(e, Overlong) and encoder.overlong != "error"
            if skip_bad or skip_long:
                (overlong if skip_long else bad).append(f"{where(path, line, kind)}: {e}")
            elif isinstance(e, Overlong):
                too_long.append((e.tokens, line))
            else:
                raise BadSample(f"{where(path, line, kind)}: {e}") from None
    if too_long:
        raise SystemExit(_overlong_message(path, kind, too_long, encoder.cfg.seq_len))
    a = np.frombuffer(rows, dtype=np.int64).reshape(-1, 5)
    return dict(offsets=a[:, 0], lines=a[:, 1], lengths=a[:, 2], image_tokens=a[:, 3], images=a[:, 4],
                bad=np.array(bad, dtype=str), kind=np.array(kind),
                overlong=np.array(overlong, dtype=str), truncated=np.array(encoder.n_truncated - truncated),
                columns=np.array(cols, dtype=str))


def _overlong_message(path, kind, too_long, seq_len):
    """The line on over-long documents [(tokens, line)] under --overlong error: the count, the longest, the first."""
    fix = "Raise --seq-len, or pass --overlong truncate|skip"
    (tokens, line), word = too_long[0], "row" if kind == "parquet" else "line"
    if len(too_long) == 1:
        return f"{where(path, line, kind)}: a document of {tokens} tokens is longer than seq_len {seq_len}. {fix}"
    most, at = max(too_long, key=lambda t: t[0])
    longest = f"the first and longest, {word} {at}, {most} tokens" if at == line else \
        f"the longest, {word} {at}, {most} tokens; first at {word} {line}"
    return f"{path}: {len(too_long)} documents are longer than seq_len {seq_len} ({longest}). {fix}"
