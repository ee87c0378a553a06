"""Checkpoints: save (sync or async), bit-exact resume and resharding for any layout; one format, written by
training (sharded) and by the offline tools (full tensors: save_model). Who may use a directory: locks.py.

  DIR/latest             "step_00000006", written last (write_atomic)
  DIR/step_00000006/
    model.{module}.{shard}.safetensors  module: vision | language; shard: tp{t} (replicated tensors in tp0 only) or
                         ep{e}-etp{x} for routed experts, after pp{s}- at lm_pp > 1. Full names, layers by global
                         index; written by dp rank 0 (edp 0 for experts) of each stage.
    optim.{module}.{shard}.safetensors  AdamW state of trained parameters: NAME.exp_avg, NAME.exp_avg_sq, NAME.step
    rank_00003.json      global rank 3's RNG states and data-loader state
    config.json          the run record: the whole Config (resume.py)
    tokenizer/, source/  the run's HF tokenizer; the HF files export-hf carries through (hf_interop.copy_source)
    meta.json            written last, so without it a step is an interrupted save: counters, lineage, layout, the
                         lanes' data positions, every tensor's full shape / dtype / sharding (and stage), every file's
                         tensors with their crc32
A load assembles each tensor from the saved slices and keeps this rank's (comm.take_shard), so any layout loads any
other; every read is checked (file, tensor, shape, dtype, crc32), errors naming the file and the tensor.
"""
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import threading
import zlib

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

import comm
import config
import locks
import memory
import watchdog

CONFIG_NAME, META_NAME, TOKENIZER_DIR, SOURCE_DIR = "config.json", "meta.json", "tokenizer", "source"
STEP = re.compile(r"step_\d{8}")
FORMAT = "hetero-vlm-checkpoint/1"
FRESH = {"step": 0, "good_steps": 0, "consumed_samples": 0, "skipped": 0}
LM_PREFIX, LM_ROOTS = "language.", ("backbone.", "lm_head.", "mtp.")   # full names: "language." + module key
GRID_FIELDS = ("world", "colocated", "vision_tp", "vision_dp", "lm_tp", "lm_dp", "lm_ep", "lm_etp", "lm_cp",
               "lm_pp")   # a checkpoint from before pipelines has no lm_pp: 1


# ---------------------------------------------------------------- names, slices, files

def _shard_file(kind, name, shards, coords, stage=None):
    """The file (kind: model | optim) of tensor `name`'s slice at `coords`; stage None: pp 1, whose files name none."""
    kinds = {s[0] for s in shards}
    at = {k: coords.get(k, 0) if k in kinds else 0 for k in ("tp", "ep", "etp")}
    tag = f"ep{at['ep']}-etp{at['etp']}" if "ep" in kinds else f"tp{at['tp']}"
    return f"{kind}.{name.split('.', 1)[0]}.{'' if stage is None else f'pp{stage}-'}{tag}.safetensors"


def _entries(par, modules):
    """(full name, parameter or persistent buffer, its ModuleGroups, its coords, its module's slice counts)."""
    for prefix, module in modules.items():
        groups = par.vision if prefix == "vision" else par.lm
        coords, sizes = groups.shards()
        for name, t in module.state_dict(keep_vars=True).items():
            yield f"{prefix}.{name}", t, groups, coords, sizes


def dtype_name(t):
    return str(t.dtype).removeprefix("torch.")


def _crc(t):
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_atomic(path, obj):
    """Atomic and durable (tmp, fsync, rename, fsync the directory): a reader sees the old file or the whole new
    one. obj: {key: tensor} for *.safetensors, a str, or JSON data."""
    tmp = path + ".tmp"
    if path.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in obj.items()}, tmp, {"format": "pt"})
    else:
        with open(tmp, "w") as f:
            f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=1))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def read_json(path, fix=None):
    """A checkpoint's JSON file; missing or corrupt: one line naming it and `fix` (default: of a step's file)."""
    fix = fix or f"restore it, or --load an earlier step of {os.path.dirname(os.path.dirname(path))}"
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"{path}: missing; {fix}") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
        raise SystemExit(f"{path}: corrupt ({e}); {fix}") from None


def read_latest(root):
    path = os.path.join(root, "latest")
    return open(path).read().strip() if os.path.exists(path) else None


def is_checkpoint(path):
    """A step directory (holds meta.json) or a save directory (holds `latest` naming a step, or a step directory)."""
    try:
        return complete(path) or STEP.fullmatch(read_latest(path) or "") is not None or \
            any(STEP.fullmatch(d) for d in os.listdir(path))
    except OSError:   # not a directory, not readable
        return False


def enclosing(path):
    """The checkpoint directory (is_checkpoint) that `path` is or lies in (its real path), or None."""
    path = os.path.realpath(path)
    while not is_checkpoint(path):
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)
    return path


# ---------------------------------------------------------------- save

def _writes(t, m):
    """Whether this rank writes tensor t of module groups m: one copy of each slice."""
    if comm.is_expert(t):
        return m.edp_rank == 0 and comm.counted_in_replica(t, m)
    return m.dp_rank == 0 and m.cp_rank == 0 and comm.counted_in_replica(t, m)


def _snapshot(par, modules, opt, copy):
    """This rank's unique slices as CPU tensors -> ({file: {key: tensor}}, {name: spec}). copy: clone (async).
    Trained weights are saved from the optimizer's fp32 main weights (the model's may be their bf16 rounding)."""
    entries = [e for e in _entries(par, modules) if _writes(e[1], e[2])]
    states = opt.gather_state({id(e[1]) for e in entries})
    trained = {id(p) for p in opt.params()}
    files, specs = {}, {}
    for name, t, groups, coords, sizes in entries:
        shards = [list(s) for s in getattr(t, "shards", ())]
        shape = comm.full_shape(t.shape, shards, sizes)
        stage = groups.pp_rank if groups.pp_size > 1 else None   # each stage's files apart
        w = states[id(t)]["main"] if id(t) in trained else t.detach().to("cpu", copy=copy)
        specs[name] = {"shape": shape, "dtype": dtype_name(w), "shards": shards, "optim": id(t) in trained,
                       **({} if stage is None else {"pp": stage})}
        files.setdefault(_shard_file("model", name, shards, coords, stage), {})[name] = w
        if id(t) in trained:   # AdamW creates state at the first gradient: until then it is zeros and step 0
            st, out = states[id(t)], files.setdefault(_shard_file("optim", name, shards, coords, stage), {})
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{key}"] = st[key]
            out[f"{name}.step"] = st["step"]
    return files, specs


def rng_state():
    """This process's RNG: python's, numpy's, torch's CPU and current CUDA device's (touching the other devices
    would create their contexts)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(s):
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def _rng_json(s):
    py, npy = s["python"], s["numpy"]
    return {"python": [py[0], list(py[1]), py[2]], "numpy": [npy[0], npy[1].tolist(), *npy[2:]],
            "torch": s["torch"].tolist(), "cuda": None if s["cuda"] is None else s["cuda"].tolist()}


def _rng_from_json(s):
    u8 = lambda x: torch.tensor(x, dtype=torch.uint8)   # noqa: E731
    return {"python": (s["python"][0], tuple(s["python"][1]), s["python"][2]),
            "numpy": (s["numpy"][0], np.array(s["numpy"][1], dtype=np.uint32), *s["numpy"][2:]),
            "torch": u8(s["torch"]), "cuda": None if s["cuda"] is None else u8(s["cuda"])}


def _write_files(step_dir, files):
    """{file: {key: tensor}} into step_dir -> {file: {key: crc32}}."""
    for fname, tensors in files.items():
        write_atomic(os.path.join(step_dir, fname), tensors)
        watchdog.progress()   # a long save is no hang; ranks with less to write wait in close()
    return {fname: {k: _crc(v) for k, v in tensors.items()} for fname, tensors in files.items()}


class Saver:
    """cfg.save/step_N, collective: every rank calls it after the same step. Async: save() copies the tensors to
    CPU and a thread writes them; after_step() commits once every rank is done (close() waits). At most one save in
    flight. A failed write on any rank ends the run on every rank and `latest` stays. Every rank checks at the start
    that it can write there and that its paths fit the file system. run_files(step_dir): rank 0 writes the run's
    other files (tokenizer, HF source) before the commit; run_names(): their paths."""

    def __init__(self, cfg, par, modules, opt, data=None, lineage=(), run_files=None, run_names=None):
        self.root, self.par, self.cfg, self.modules, self.opt, self.data = cfg.save, par, cfg, modules, opt, data
        self.lineage, self.run_files = list(lineage), run_files
        self.rank, self.pending, self.last = dist.get_rank(), None, None
        comm.on_every_rank(self._check_writable, run_names)

    def _check_writable(self, run_names):
        try:
            os.makedirs(self.root, exist_ok=True)
            probe = os.path.join(self.root, f".write_test.rank{self.rank}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise SystemExit(locks.unwritable(self.root, self.rank, e)) from None
        names = {_shard_file("model", n, getattr(t, "shards", ()), coords, g.pp_rank if g.pp_size > 1 else None)
                 for n, t, g, coords, _ in _entries(self.par, self.modules) if _writes(t, g)}   # optim.*: as long
        names |= {f"rank_{self.rank:05d}.json"} | ({CONFIG_NAME, META_NAME} if self.rank == 0 else set())
        names = [n + ".tmp" for n in names] + (run_names() if run_names and self.rank == 0 else [])   # write_atomic
        _check_lengths(self.root, f"step_{self.cfg.steps:08d}", names)

    def after_step(self, step, counters, last):
        if (self.cfg.save_every and step % self.cfg.save_every == 0) or last:
            self.save(step, counters)
        elif self.pending is not None:   # one small all-reduce per step while an async save is in flight
            done = torch.tensor([int(not self.pending[3].is_alive())], device=comm.device())
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                self.close()

    def save(self, step, counters):
        self.close()
        if step == self.last:   # saved already (a signal right after a --save-every step)
            return
        name, lay, lm, world = f"step_{step:08d}", self.par.layout, self.par.lm, dist.get_world_size()
        step_dir = os.path.join(self.root, name)
        error = comm.on_every_rank(self._make_step_dir, step_dir)
        result = {"error": error} if error else {}   # reported on every rank by close(), like a failed write
        files, specs = _snapshot(self.par, self.modules, self.opt, copy=self.cfg.async_save)
        data_state = self.data.state_dict() if hasattr(self.data, "state_dict") else None   # JSON-serialisable
        rank_state, lanes = {"rank": self.rank, "rng": _rng_json(rng_state()), "data": data_state}, [None] * world
        dist.all_gather_object(lanes, None if lm is None or not lm.lane_lead else {   # each lane's position
            "lane": lm.dp_rank, "next_sample": counters["consumed_samples"] + lm.dp_rank * lay.micro_batch,
            "state": data_state})
        meta = {"format": FORMAT, "step": step, "counters": dict(counters), "ranks": world,
                "run": {"lineage": self.lineage}, "layout": dataclasses.asdict(lay), "layout_text": lay.describe(),
                "sizes": {"vision": {"tp": lay.vision_tp},
                          "language": {"tp": lay.lm_tp, "ep": lay.lm_ep, "etp": lay.lm_etp}},
                "data": {"consumed_samples": counters["consumed_samples"],
                         "lanes": sorted((x for x in lanes if x), key=lambda x: x["lane"])}}
        self.last = step

        def write():
            if "error" in result:
                return
            try:
                result["manifest"] = _write_files(step_dir, files)
                write_atomic(os.path.join(step_dir, f"rank_{self.rank:05d}.json"), rank_state)
            except BaseException as e:   # reported on every rank by close()
                result["error"] = f"rank {self.rank}: {type(e).__name__}: {e}"
        thread = threading.Thread(target=write, daemon=True) if self.cfg.async_save else None
        self.pending = (step_dir, meta, specs, thread, result)
        if thread is None:
            write()
            self.close()
        else:
            thread.start()

    def _make_step_dir(self, step_dir):
        """Rank 0: an interrupted save's leftover of this step is replaced; a complete step never is (only another
        run on this --save could have written it)."""
        if self.rank != 0:
            return None
        if complete(step_dir):
            raise SystemExit(f"{step_dir} is a complete checkpoint that this run would replace (is another run "
                             f"saving into {self.root}?). It is kept: choose another --save, or --load {self.root} to "
                             "continue from it")
        try:
            if read_latest(self.root) == os.path.basename(step_dir):
                os.remove(os.path.join(self.root, "latest"))
            shutil.rmtree(step_dir, ignore_errors=True)
            os.makedirs(step_dir)
        except OSError as e:
            return f"rank 0: {type(e).__name__}: {e}"
        return None

    def close(self):
        """Wait for the save in flight (if any), then commit it: meta.json, `latest`, pruning."""
        if self.pending is None:
            return
        (step_dir, meta, specs, thread, result), self.pending = self.pending, None
        if thread is not None:
            thread.join()
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (result.get("error"), result.get("manifest", {}), specs))
        errors = [e for e, _, _ in reports if e]
        if errors:
            if self.rank == 0:   # what was written of it would only fill the disk: nothing reads a step without meta
                shutil.rmtree(step_dir, ignore_errors=True)
            kept = read_latest(self.root)
            kept = f"`latest` stays {kept}" if kept else "no checkpoint was saved before it"
            raise SystemExit(f"checkpoint {step_dir} FAILED ({'; '.join(errors)}); {kept}. Free space or fix the "
                             f"permissions of {self.root}, then resume with --load {self.root}")
        if self.rank == 0:
            meta["tensors"] = {k: v for _, _, s in reports for k, v in sorted(s.items())}
            meta["files"] = {k: v for _, m, _ in reports for k, v in sorted(m.items())}
            if self.run_files is not None:
                self.run_files(step_dir)
            write_atomic(os.path.join(step_dir, CONFIG_NAME), dataclasses.asdict(self.cfg))
            write_atomic(os.path.join(step_dir, META_NAME), meta)
            write_atomic(os.path.join(self.root, "latest"), os.path.basename(step_dir) + "\n")
            if self.cfg.keep_last:   # the newest K up to this one; later ones (an abandoned run) are left alone
                older = sorted(d for d in os.listdir(self.root) if STEP.fullmatch(d)
                               and d <= os.path.basename(step_dir))
                locks.prune(self.root, older[:-self.cfg.keep_last])
            print(f"saved checkpoint {step_dir}", flush=True)
        dist.barrier()   # no rank goes on (or reports the save) before `latest` is written


def _check_lengths(root, step, names):
    """The paths `names` in step directory `step` of `root` fit its file system's limits (absolute: write_atomic
    opens them so), or one line: before the first step rather than in the first save."""
    size = lambda s: len(os.fsencode(s))   # noqa: E731
    try:
        name_max, path_max = (os.pathconf(root, k) for k in ("PC_NAME_MAX", "PC_PATH_MAX"))
    except (OSError, ValueError):   # limits the system does not tell
        return
    long = max((p for n in names for p in [step, *n.split("/")]), key=size)
    if 0 < name_max < size(long):
        raise SystemExit(f"--save {root}: a checkpoint writes {long}, a name of {size(long)} bytes, but its file "
                         f"system allows {name_max}. Choose a --save on another file system")
    name = max(names, key=size)
    path = os.path.join(os.path.abspath(root), step, name)
    if 0 < path_max <= size(path):   # the limit counts the terminating NUL
        raise SystemExit(f"--save {root}: a checkpoint writes {step}/{name} there, a path of {size(path)} bytes, but "
                         f"its file system allows {path_max - 1}. Choose a --save whose absolute path has at most "
                         f"{path_max - 3 - size(step) - size(name)} bytes")


def save_model(path, cfg, state_dict):
    """Weights only, full tensors under full names ("language.…", "vision.…"): no layout, optimizer or RNG."""
    files, specs = {}, {}
    for k, v in state_dict.items():
        if k.split(".", 1)[0] not in ("vision", "language"):
            raise ValueError(f"{k}: checkpoint names start with 'vision.' or 'language.'")
        files.setdefault(_shard_file("model", k, [], {}), {})[k] = v.detach().cpu()
        specs[k] = {"shape": list(v.shape), "dtype": dtype_name(v), "shards": [], "optim": False}
    os.makedirs(path, exist_ok=True)   # files of an earlier save here are ignored: meta.json lists the files
    write_atomic(os.path.join(path, CONFIG_NAME), dataclasses.asdict(cfg))
    write_atomic(os.path.join(path, META_NAME), {
        "format": FORMAT, "step": 0, "counters": FRESH, "layout": None, "ranks": 0, "tensors": specs,
        "sizes": {"vision": {"tp": 1}, "language": {"tp": 1, "ep": 1, "etp": 1}}, "files": _write_files(path, files)})


# ---------------------------------------------------------------- load

def complete(step_dir):
    return os.path.exists(os.path.join(step_dir, META_NAME))


def complete_steps(root):
    return sorted(d for d in os.listdir(root) if STEP.fullmatch(d) and complete(os.path.join(root, d))) \
        if os.path.isdir(root) else []


def newest(root):
    """(the newest complete step directory of `root` or None, a note when it is not `latest`): `latest` can lag
    (a save killed after its meta.json), never lead."""
    steps = complete_steps(root)
    if not steps:
        return None, None
    latest = read_latest(root)
    if latest == steps[-1]:
        return os.path.join(root, latest), None
    why = f"`latest` names {latest}" + ("" if complete(os.path.join(root, latest)) else ", not a complete "
                                        "checkpoint") if latest else "no `latest`"
    return os.path.join(root, steps[-1]), f"{why}: the newest complete step is {steps[-1]}, loading it"


def resolve(path, say=None):
    """A step directory, or a save directory (its newest complete step; `say` tells when that is not `latest`)."""
    if complete(path):
        return path
    step_dir, note = newest(path)
    if step_dir is None:
        raise FileNotFoundError(f"{os.path.join(path, META_NAME)}: missing: {path} is not a complete checkpoint, "
                                "and holds no complete step directory (an interrupted save?)")
    if note and say is not None:
        say(f"{path}: {note}")
    return step_dir


def pin(path, say=None):
    """resolve(path), pinned against --keep-last pruning until locks.unpin(); a step pruned before its pin is
    chosen again."""
    while True:
        step_dir = resolve(path, say)
        if locks.pin(step_dir):
            return step_dir


def saved_config(path, overrides=None):
    """The Config of a checkpoint (save or step directory), with --FIELD overrides."""
    step_dir = resolve(path)
    path = os.path.join(step_dir, CONFIG_NAME)
    values = read_json(path)
    config.check_record(values, path)
    values = config.upgrade_record(values, path)
    unknown = set(values) - {f.name for f in dataclasses.fields(config.Config)}
    if unknown:
        raise ValueError(f"{path}: unknown config fields {sorted(unknown)}")
    return config.from_values(values, overrides)


class Files:
    """The safetensors files one load reads: each opened on its first tensor and kept for the others it holds, all
    closed by close() at the load's end, so no file stays open (mapped) for as long as its source object lives (an
    HFSource is kept for the whole run). Read again after close(), a file opens again."""

    def __init__(self):
        self.opened, self.stack = {}, contextlib.ExitStack()

    def get(self, path, key):
        if path not in self.opened:
            self.opened[path] = self.stack.enter_context(safe_open(path, framework="pt"))
        return self.opened[path].get_tensor(key)

    def close(self):
        self.stack.close()
        self.opened.clear()


class Reader:
    """Tensors of one checkpoint, full or as a slice of any layout; its step pinned until locks.unpin(). close():
    the end of a load (Files)."""

    def __init__(self, path):
        self.dir = pin(path)
        self.meta = read_json(os.path.join(self.dir, META_NAME))
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{self.dir}/{META_NAME}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.cfg, self.tensors, self.files = saved_config(self.dir), self.meta["tensors"], Files()

    def close(self):
        self.files.close()

    def read(self, name, suffix="", kind="model", shards=(), coords=None, sizes=None):
        """Tensor `name` + suffix (".exp_avg", ...): full, or with `shards` (a live parameter's .shards) the slice
        at `coords` of a layout with `sizes` slices per kind."""
        if name not in self.tensors:
            raise ValueError(f"{self.dir}/{META_NAME}: missing tensor {name}")
        spec, key = self.tensors[name], name + suffix
        saved, saved_sizes = [tuple(s) for s in spec["shards"]], self.meta["sizes"][name.split(".", 1)[0]]
        if suffix == ".step":   # a scalar, stored with every slice
            return self._get(_shard_file(kind, key, saved, {}, spec.get("pp")), key, [], "float32")
        want = [tuple(s) for s in shards]
        if want and want == saved and all(saved_sizes[k] == sizes[k] for k, _, _ in want):   # same slicing
            return self._slice(kind, key, spec, saved_sizes, coords)
        return comm.take_shard(self._slice(kind, key, spec, saved_sizes, {}), want, coords, sizes)

    def _slice(self, kind, key, spec, sizes, coords):
        """The saved slice at `coords`; kinds missing from `coords` are assembled (comm.unshard, first kind outer)."""
        todo = [s for s in spec["shards"] if s[0] not in coords]
        if todo:
            k, dim, segments = todo[0]
            return comm.unshard([self._slice(kind, key, spec, sizes, {**coords, k: r}) for r in range(sizes[k])],
                                dim, segments)
        shape = list(spec["shape"])
        for k, dim, _ in spec["shards"]:
            shape[dim] //= sizes[k]
        return self._get(_shard_file(kind, key, spec["shards"], coords, spec.get("pp")), key, shape, spec["dtype"])

    def _get(self, fname, key, shape, dtype):
        path, crc = os.path.join(self.dir, fname), self.meta["files"].get(fname, {}).get(key)
        if crc is None:
            raise ValueError(f"{path}: tensor {key} is not listed in {META_NAME}")
        try:
            t = self.files.get(path, key)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: missing (holds tensor {key})") from None
        except Exception as e:   # truncated, a broken header, the tensor absent, ...
            raise ValueError(f"{path}: tensor {key}: unreadable ({e})") from None
        if list(t.shape) != list(shape) or dtype_name(t) != dtype:
            raise ValueError(f"{path}: tensor {key} is {dtype_name(t)} {list(t.shape)}, {META_NAME} says {dtype} "
                             f"{list(shape)}")
        if _crc(t) != crc:
            raise ValueError(f"{path}: tensor {key}: checksum mismatch (the file was modified or is corrupt)")
        return t


def load(path, par, modules, opt=None, cfg=None, data=None, *, load_optim=True, load_rng=True, finetune=False):
    """Load a checkpoint (a path, or a source that reads alike: hf_interop.HFSource) into this rank's modules, AdamW
    state, RNG and data state -> counters (FRESH with finetune: weights only). No collectives."""
    r = path if hasattr(path, "read") else Reader(path)
    rank, lay = dist.get_rank(), par.layout
    say = (lambda msg: print(f"checkpoint: {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    bad = [f"{k} is {getattr(r.cfg, k)!r} in the checkpoint, {getattr(cfg, k)!r} in this run"
           for k in config.MODEL_FIELDS if cfg is not None and getattr(r.cfg, k) != getattr(cfg, k)]
    if bad:
        raise ValueError(f"{r.dir}/{CONFIG_NAME}: config mismatch: " + "; ".join(bad))
    absent = [m for m in modules if not any(n.startswith(m + ".") for n in r.tensors)]
    if absent and not finetune:
        raise ValueError(f"{r.dir}: holds no {absent} tensors (--finetune starts such a module from its init)")
    entries = [e for e in _entries(par, modules) if e[0].split(".", 1)[0] not in absent
               and (e[0] in r.tensors or "lora_" not in e[0])]   # LoRA on a base checkpoint: adapters start fresh
    # against the whole model: a pipeline stage's modules hold their stage's part, the checkpoint all of it
    whole = memory.sizing_model(cfg or r.cfg)
    extra = sorted({n for n in r.tensors if n.split(".", 1)[0] in modules}
                   - {f"{k}.{n}" for k in modules for n in whole[k].state_dict()})
    if extra:
        raise ValueError(f"{r.dir}/{META_NAME}: unexpected tensors {extra[:5]} (not in this run's model)")
    params = opt.params() if opt is not None else []
    trained, mains, states = {id(p) for p in params}, {}, None
    with contextlib.closing(r), torch.no_grad():   # each file opened once for all its tensors, closed after
        for name, t, _, coords, sizes in entries:
            watchdog.progress()   # reading weights can take long: no hang
            x = r.read(name, shards=getattr(t, "shards", ()), coords=coords, sizes=sizes)
            same_kind = x.dtype == t.dtype or (x.is_floating_point() and t.is_floating_point())  # bf16 <-> fp32
            if x.shape != t.shape or not (same_kind or finetune):
                raise ValueError(f"{r.dir}/{META_NAME}: tensor {name} ({r.tensors[name]['dtype']} "
                                 f"{r.tensors[name]['shape']}) does not fit this run's {dtype_name(t)} {list(t.shape)}")
            t.copy_(x)
            if id(t) in trained:
                mains[id(t)] = x
        if opt is not None and load_optim and not finetune:
            states, fresh = _optimizer_states(r, params, entries)
            if fresh:
                say(f"{len(fresh)} trainable tensors had no optimizer state (frozen when saved), e.g. {fresh[0]}: "
                    "fresh AdamW")
    if opt is not None:   # its fp32 main weights from the checkpoint's (not from the model's possibly bf16 copy)
        opt.load(mains, states)
    saved, rank_state = r.meta["layout"], None
    if load_rng and not finetune:
        if saved and r.meta["ranks"] and all(saved.get(k, 1) == getattr(lay, k) for k in GRID_FIELDS):
            rank_state = read_json(os.path.join(r.dir, f"rank_{rank:05d}.json"), "restore it, or resume with "
                                   "--no-load-rng (RNG and data-loader state then start afresh)")
            set_rng_state(_rng_from_json(rank_state["rng"]))
        else:
            say(f"saved under another layout ({r.meta.get('layout_text')}): RNG not restored (as --no-load-rng)")
    if hasattr(data, "load_state_dict") and not finetune:   # the data loader's own position, if it keeps one
        lanes = r.meta.get("data", {}).get("lanes") or [{}]
        state = rank_state["data"] if rank_state is not None else lanes[0].get("state")
        if state is not None:
            data.load_state_dict(state)
    say(f"loaded {r.dir} (step {r.meta['step']}{', weights only' if finetune else ''}) into {lay.describe()}"
        + (f"; {absent} not in it: initialised as usual" if absent else ""))
    return dict(FRESH) if finetune else dict(r.meta["counters"])


def _optimizer_states(r, params, entries):
    """{id(param): {"step", "exp_avg", "exp_avg_sq"}} of this rank's slices, and the names saved without state."""
    by_id = {id(t): (name, coords, sizes) for name, t, _, coords, sizes in entries}
    states, fresh = {}, []
    for p in params:
        name, coords, sizes = by_id.get(id(p), (None, None, None))
        if name is None or not r.tensors[name]["optim"]:
            fresh.append(name or "a new LoRA adapter")
            continue
        where = dict(kind="optim", shards=getattr(p, "shards", ()), coords=coords, sizes=sizes)
        # a copy of the step: AdamW keeps that tensor on the CPU, and a tensor read maps its whole file (safetensors
        # reads without copying), which would then stay mapped, a pruned step's disk held, for the run's life
        states[id(p)] = {"step": r.read(name, ".step", "optim").clone(), "exp_avg": r.read(name, ".exp_avg", **where),
                         "exp_avg_sq": r.read(name, ".exp_avg_sq", **where)}
    return states, fresh


def load_model(path):
    """-> (Config, {full name: full tensor}) from any checkpoint (any layout, or save_model's)."""
    with contextlib.closing(Reader(path)) as r:
        return r.cfg, {name: r.read(name) for name in r.tensors}


def check_tensors(state_dict, expected, source):
    """Same names and shapes as `expected` ({name: shape}), or a ValueError listing every offender."""
    errors = [f"{source}: missing tensor {k}" for k in expected if k not in state_dict]
    errors += [f"{source}: unexpected tensor {k}" for k in state_dict if k not in expected]
    errors += [f"{source}: tensor {k} has shape {list(v.shape)}, expected {list(expected[k])}"
               for k, v in state_dict.items() if k in expected and tuple(v.shape) != tuple(expected[k])]
    raise_errors(errors)


def raise_errors(errors, shown=3):
    """One ValueError, one line, naming the first offenders and how many there are (a config.json whose sizes are
    not its weights' is wrong in many places at once)."""
    if errors:
        more = f"; and {len(errors) - shown} more" if len(errors) > shown else ""
        raise ValueError(f"{len(errors)} checkpoint error(s): " + "; ".join(errors[:shown]) + more)


def language_state_dict(state_dict):
    """The language model's entries of a full-model state dict, "language." stripped."""
    n = len(LM_PREFIX)
    return {k[n:]: v for k, v in state_dict.items() if k.startswith(LM_PREFIX) and k[n:].startswith(LM_ROOTS)}
