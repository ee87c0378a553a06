"""Checkpoints: save, bit-exact resume, async save and resharding for any training layout, and HF NemotronH
export / import. One format, written by training (sharded) and by the offline tools (full tensors: save_model).

  DIR/latest             "step_00000006", written last and atomically (tmp + fsync + rename)
  DIR/step_00000006/
    model.{module}.{shard}.safetensors  module: vision | language; shard: tp{t} for dense tensors (replicated ones
                         and buffers such as the expert bias in tp0 only) or ep{e}-etp{x} for routed experts. Full
                         names ("language.backbone.…"); written by the dp-rank-0 replica (edp 0 for experts).
    optim.{module}.{shard}.safetensors  AdamW state of trainable parameters, sharded like them: NAME.exp_avg,
                         NAME.exp_avg_sq, NAME.step. Frozen parameters have none.
    rank_00003.json      global rank 3: RNG states (python, numpy, torch CPU / CUDA) and its data-loader state
    config.json          the resolved Config
    meta.json            written after every rank's files, so without it a step is an interrupted save: counters
                         (step, good_steps, consumed_samples, skipped; the LR schedule is a function of them and of
                         the saved `scheduler` args), layout, data position of every language lane, train args,
                         every tensor's full shape / dtype / sharding, every file's tensors with their crc32.
Loading assembles a tensor from the saved slices (comm.unshard; the saving layout is in meta.json) and keeps this
rank's slice (comm.shard): any layout loads any other, and with an unchanged layout a rank reads only its own files.
Every read is checked (file, tensor, shape, dtype, crc32; model config): errors name the file and the tensor.
HF: the original names (decoder.md §9), equal to ours except that routed experts are stored one tensor per expert
(`mixer.experts.{j}.up_proj.weight` [F, D]) where we stack them for grouped GEMM (`mixer.experts.up_proj` [E, F, D]).
CLI:  python checkpoint.py export-hf --load CKPT --out HF_DIR  |  import-hf --hf HF_DIR --out CKPT
"""
import argparse
import dataclasses
import glob
import json
import math
import os
import random
import re
import shutil
import sys
import threading
import zlib

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import comm
import config
import model
import parallel
import radio

WEIGHTS_NAME, INDEX_NAME, CONFIG_NAME, META_NAME = "model.safetensors", "model.safetensors.index.json", \
    "config.json", "meta.json"
VISION_NAME = "vision.safetensors"   # export-hf: vision tower + projector under HF Nemotron-VL names
DEFAULT_SHARD_BYTES = 5 * 10**9      # HF's classic default shard size
FORMAT = "hetero-vlm-checkpoint/1"
FRESH = {"step": 0, "good_steps": 0, "consumed_samples": 0, "skipped": 0}
LM_PREFIX, LM_ROOTS = "language.", ("backbone.", "lm_head.")   # full names: "vision." / "language." + module key

# Config fields: HF name -> our name. Everything else in Config is ours alone (training, vision, layout).
HF_SAME = ("vocab_size", "hidden_size", "hybrid_override_pattern", "num_attention_heads", "num_key_value_heads",
           "head_dim", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
           "chunk_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
           "moe_shared_expert_intermediate_size", "intermediate_size", "routed_scaling_factor")
HF_RENAMED = {"layer_norm_epsilon": "norm_eps", "initializer_range": "init_std"}
LANGUAGE_FIELDS = HF_SAME + tuple(HF_RENAMED.values())
# HF switches whose value is baked into our model; import refuses any other value (absent = HF default = this).
HF_FIXED = dict(use_conv_bias=True, mamba_proj_bias=False, use_bias=False, attention_bias=False, mlp_bias=False,
                n_shared_experts=1, mlp_hidden_act="relu2", mamba_hidden_act="silu", n_group=1, topk_group=1,
                norm_topk_prob=True, residual_in_fp32=False, tie_word_embeddings=False, moe_latent_size=None,
                sliding_window=None)
# Written for completeness (Nano's values, decoder.md §2.1), not read back. time_step_* only drive HF's init.
# Caveat: HF's torch Mamba path clamps dt at time_step_min; ours, the CUDA kernels and Megatron do not.
HF_INFO = dict(time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, expand=2, bos_token_id=1,
               eos_token_id=2, pad_token_id=0, mamba_ssm_cache_dtype="float32", attention_dropout=0.0,
               hidden_dropout=0.0, num_logits_to_keep=1, use_mamba_kernels=True, rescale_prenorm_residual=True)
HF_LAYER_TYPES = {"linear_attention": "M", "full_attention": "*", "moe": "E", "mlp": "-"}   # transformers 5.x
STACKED_KEY = re.compile(r"^(.+\.mixer\.experts)\.(up_proj|down_proj)$")                 # ours
EXPERT_KEY = re.compile(r"^(.+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")    # HF, one per expert

# A checkpoint loads only into a run with equal model fields (data, optimizer and layout fields may change).
MODEL_FIELDS = LANGUAGE_FIELDS + ("vision", "vit_hidden", "vit_depth", "vit_heads", "vit_mlp", "vit_patch",
                                  "vit_cpe_grid", "class_token_len", "projector_hidden", "image_token_id")
GRID_FIELDS = ("world", "colocated", "vision_tp", "vision_dp", "lm_tp", "lm_dp", "lm_ep", "lm_etp")


# ---------------------------------------------------------------- names, slices, files

def _sizes(lay):
    """Slices per module and shard kind under a layout."""
    return {"vision": {"tp": lay.vision_tp}, "language": {"tp": lay.lm_tp, "ep": lay.lm_ep, "etp": lay.lm_etp}}


def _shard_file(kind, name, shards, coords):
    """The file (kind: model | optim) holding the slice at `coords` of tensor `name`, sharded by `shards`."""
    kinds = {s[0] for s in shards}
    at = {k: coords.get(k, 0) if k in kinds else 0 for k in ("tp", "ep", "etp")}
    tag = f"ep{at['ep']}-etp{at['etp']}" if "ep" in kinds else f"tp{at['tp']}"
    return f"{kind}.{name.split('.', 1)[0]}.{tag}.safetensors"


def _entries(par, modules):
    """(full name, parameter or persistent buffer, its ModuleGroups, its coords, its module's slice counts)."""
    for prefix, module in modules.items():
        groups, sizes = par.vision if prefix == "vision" else par.lm, _sizes(par.layout)[prefix]
        coords = {k: getattr(groups, f"{k}_rank") for k in ("tp", "ep", "etp")}
        for name, t in module.state_dict(keep_vars=True).items():
            yield f"{prefix}.{name}", t, groups, coords, sizes


def _dtype(t):
    return str(t.dtype).removeprefix("torch.")


def _crc(t):
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _write(path, obj):
    """Atomic and durable: tmp file, fsync, rename, fsync the directory, so a reader sees the old file or the
    whole new one. obj: {key: tensor} for *.safetensors, a str, or JSON data. (The crash test makes it hang.)"""
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


def _read_latest(root):
    path = os.path.join(root, "latest")
    return open(path).read().strip() if os.path.exists(path) else None


# ---------------------------------------------------------------- save

def _snapshot(par, modules, opt, copy):
    """This rank's unique slices as CPU tensors -> ({file: {key: tensor}}, {name: spec}). copy: clone (async)."""
    trained = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else set()
    cpu = (lambda t: t.detach().to("cpu", copy=True)) if copy else (lambda t: t.detach().cpu())
    files, specs = {}, {}
    for name, t, groups, coords, sizes in _entries(par, modules):
        if not parallel._unique_here(t, groups):   # the copy the grad norm counts: dp / edp rank 0, one per slice
            continue
        shards = [list(s) for s in getattr(t, "shards", ())]
        shape = comm.full_shape(t.shape, shards, sizes)
        specs[name] = {"shape": shape, "dtype": _dtype(t), "shards": shards, "optim": id(t) in trained}
        files.setdefault(_shard_file("model", name, shards, coords), {})[name] = cpu(t)
        if id(t) in trained:   # AdamW creates state at the first gradient: until then it is zeros and step 0
            st, out = opt.state.get(t, {}), files.setdefault(_shard_file("optim", name, shards, coords), {})
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{key}"] = cpu(st[key]) if key in st else torch.zeros(t.shape, dtype=t.dtype)
            out[f"{name}.step"] = cpu(st["step"]).float() if "step" in st else torch.tensor(0.0)
    return files, specs


def _rng_state():
    py, npy = random.getstate(), np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]], "numpy": [npy[0], npy[1].tolist(), *npy[2:]],
            "torch": torch.get_rng_state().tolist(),
            "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []}


def _set_rng_state(s):
    random.setstate((s["python"][0], tuple(s["python"][1]), s["python"][2]))
    np.random.set_state((s["numpy"][0], np.array(s["numpy"][1], dtype=np.uint32), *s["numpy"][2:]))
    torch.set_rng_state(torch.tensor(s["torch"], dtype=torch.uint8))
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(c, dtype=torch.uint8) for c in s["cuda"]])


def _write_files(step_dir, files):
    """{file: {key: tensor}} into step_dir -> {file: {key: crc32}}."""
    for fname, tensors in files.items():
        _write(os.path.join(step_dir, fname), tensors)
    return {fname: {k: _crc(v) for k, v in tensors.items()} for fname, tensors in files.items()}


class Saver:
    """ROOT/step_N when train.py asks (--save-every, the last step, a stop signal). Collective: all ranks call it
    after the same step. Sync: save() returns with the checkpoint complete. Async: save() copies the tensors to CPU
    and a thread writes them; after_step() commits once every rank is done (close() waits): meta.json, `latest`,
    --keep-last pruning. At most one save in flight; a failed write is reported (sync: raised), `latest` stays."""

    def __init__(self, root, par, cfg, modules, opt, args, data=None):
        self.root, self.par, self.cfg, self.modules, self.opt, self.args, self.data = \
            root, par, cfg, modules, opt, args, data
        self.rank, self.pending = dist.get_rank(), None
        os.makedirs(root, exist_ok=True)

    def after_step(self, step, counters, last):
        if (self.args.save_every and step % self.args.save_every == 0) or last:
            self.save(step, counters)
        elif self.pending is not None:   # one small all-reduce per step while an async save is in flight
            done = torch.tensor([int(not self.pending[3].is_alive())], device=parallel._device())
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                self.close()

    def save(self, step, counters):
        self.close()
        name, lay, lm, world = f"step_{step:08d}", self.par.layout, self.par.lm, dist.get_world_size()
        step_dir = os.path.join(self.root, name)
        if self.rank == 0:   # a leftover of an interrupted or abandoned run is replaced
            if _read_latest(self.root) == name:
                os.remove(os.path.join(self.root, "latest"))
            shutil.rmtree(step_dir, ignore_errors=True)
            os.makedirs(step_dir)
        dist.barrier()
        files, specs = _snapshot(self.par, self.modules, self.opt, copy=self.args.async_save)
        data_state = self.data.state_dict() if hasattr(self.data, "state_dict") else None   # JSON-serialisable
        rank_state, lanes = {"rank": self.rank, "rng": _rng_state(), "data": data_state}, [None] * world
        dist.all_gather_object(lanes, None if lm is None or lm.tp_rank else {   # every language lane's position
            "lane": lm.dp_rank, "next_sample": counters["consumed_samples"] + lm.dp_rank * lay.micro_batch,
            "state": data_state})
        args = vars(self.args)   # the LR schedule is a function of counters and these `scheduler` args
        meta = {"format": FORMAT, "step": step, "counters": dict(counters), "ranks": world, "args": args,
                "scheduler": {k: v for k, v in args.items() if "lr" in k or k in ("steps", "train_samples")},
                "layout": dataclasses.asdict(lay), "layout_text": lay.describe(), "sizes": _sizes(lay),
                "data": {"consumed_samples": counters["consumed_samples"],
                         "lanes": sorted((x for x in lanes if x), key=lambda x: x["lane"])}}
        result = {}

        def write():
            try:
                result["manifest"] = _write_files(step_dir, files)
                _write(os.path.join(step_dir, f"rank_{self.rank:05d}.json"), rank_state)
            except BaseException as e:   # reported on every rank by close()
                result["error"] = f"rank {self.rank}: {type(e).__name__}: {e}"
        thread = threading.Thread(target=write, daemon=True) if self.args.async_save else None
        self.pending = (step_dir, meta, specs, thread, result)
        if thread is None:
            write()
            self.close()
        else:
            thread.start()

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
            msg = f"checkpoint {step_dir} FAILED, `latest` stays {_read_latest(self.root)}: " + "; ".join(errors)
            if not self.args.async_save:
                raise RuntimeError(msg)
            if self.rank == 0:
                print(msg, file=sys.stderr, flush=True)
        elif self.rank == 0:
            meta["tensors"] = {k: v for _, _, s in reports for k, v in sorted(s.items())}
            meta["files"] = {k: v for _, m, _ in reports for k, v in sorted(m.items())}
            _write(os.path.join(step_dir, CONFIG_NAME), dataclasses.asdict(self.cfg))
            _write(os.path.join(step_dir, META_NAME), meta)
            _write(os.path.join(self.root, "latest"), os.path.basename(step_dir) + "\n")
            if self.args.keep_last:   # the newest K up to this one; later ones (an abandoned run) are left alone
                older = sorted(d for d in os.listdir(self.root) if re.fullmatch(r"step_\d{8}", d)
                               and d <= os.path.basename(step_dir))
                for d in older[:-self.args.keep_last]:
                    shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)
            print(f"saved checkpoint {step_dir}", flush=True)


def save_model(path, cfg, state_dict):
    """Weights only, full tensors under full names ("language.…", "vision.…"), e.g. import-hf's output: no layout,
    optimizer or RNG. load_model, export-hf and train.py --load [--finetune] read it like any checkpoint."""
    files, specs = {}, {}
    for k, v in state_dict.items():
        if k.split(".", 1)[0] not in ("vision", "language"):
            raise ValueError(f"{k}: checkpoint names start with 'vision.' or 'language.'")
        files.setdefault(_shard_file("model", k, [], {}), {})[k] = v.detach().cpu()
        specs[k] = {"shape": list(v.shape), "dtype": _dtype(v), "shards": [], "optim": False}
    os.makedirs(path, exist_ok=True)   # files of an earlier save here are ignored: meta.json lists the files
    _write(os.path.join(path, CONFIG_NAME), dataclasses.asdict(cfg))
    _write(os.path.join(path, META_NAME), {
        "format": FORMAT, "step": 0, "counters": FRESH, "layout": None, "ranks": 0, "tensors": specs,
        "sizes": {"vision": {"tp": 1}, "language": {"tp": 1, "ep": 1, "etp": 1}}, "files": _write_files(path, files)})


# ---------------------------------------------------------------- load

def resolve(path):
    """A save directory (follows `latest`) or a step directory -> the step directory, which must be complete."""
    step_dir = os.path.join(path, _read_latest(path)) if _read_latest(path) else path
    if not os.path.exists(os.path.join(step_dir, META_NAME)):
        raise FileNotFoundError(f"{os.path.join(step_dir, META_NAME)}: missing: {step_dir} is not a complete "
                                "checkpoint (an interrupted save, or a save directory without `latest`)")
    return step_dir


def saved_config(path, overrides=None):
    """The Config of a checkpoint (save or step directory), with --FIELD overrides (train.py --eval-only)."""
    path = os.path.join(resolve(path), CONFIG_NAME)
    with open(path) as f:   # a missing file raises FileNotFoundError naming it
        values = json.load(f)
    fields = {f.name: f for f in dataclasses.fields(config.Config)}
    if set(values) - set(fields):
        raise ValueError(f"{path}: unknown config fields {sorted(set(values) - set(fields))}")
    cfg = config.Config(**values)   # fields added to Config later keep their defaults
    for k, v in (overrides or {}).items():
        if k not in fields:
            raise SystemExit(f"unknown config field {k!r}")
        setattr(cfg, k, config._parse(fields[k], v))
    config.check(cfg)
    return cfg


class Reader:
    """Tensors of one checkpoint, full or as a slice of any layout; every read checked against meta.json."""

    def __init__(self, path):
        self.dir = resolve(path)
        with open(os.path.join(self.dir, META_NAME)) as f:
            self.meta = json.load(f)
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{self.dir}/{META_NAME}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.cfg, self.tensors, self.handles = saved_config(self.dir), self.meta["tensors"], {}

    def read(self, name, suffix="", kind="model", shards=(), coords=None, sizes=None):
        """Tensor `name` + suffix (".exp_avg", ...): full, or with `shards` (a live parameter's .shards) the slice
        at `coords` of a layout with `sizes` slices per kind."""
        if name not in self.tensors:
            raise ValueError(f"{self.dir}/{META_NAME}: missing tensor {name}")
        spec, key = self.tensors[name], name + suffix
        saved, saved_sizes = [tuple(s) for s in spec["shards"]], self.meta["sizes"][name.split(".", 1)[0]]
        if suffix == ".step":   # a scalar, stored with every slice
            return self._get(_shard_file(kind, key, saved, {}), key, [], "float32")
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
        return self._get(_shard_file(kind, key, spec["shards"], coords), key, shape, spec["dtype"])

    def _get(self, fname, key, shape, dtype):
        path, crc = os.path.join(self.dir, fname), self.meta["files"].get(fname, {}).get(key)
        if crc is None:
            raise ValueError(f"{path}: tensor {key} is not listed in {META_NAME}")
        try:
            if fname not in self.handles:
                self.handles[fname] = safe_open(path, framework="pt")
            t = self.handles[fname].get_tensor(key)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: missing (holds tensor {key})") from None
        except Exception as e:   # truncated, a broken header, the tensor absent, ...
            raise ValueError(f"{path}: tensor {key}: unreadable ({e})") from None
        if list(t.shape) != list(shape) or _dtype(t) != dtype:
            raise ValueError(f"{path}: tensor {key} is {_dtype(t)} {list(t.shape)}, {META_NAME} says {dtype} "
                             f"{list(shape)}")
        if _crc(t) != crc:
            raise ValueError(f"{path}: tensor {key}: checksum mismatch (the file was modified or is corrupt)")
        return t


def load(path, par, modules, opt=None, cfg=None, data=None, *, load_optim=True, load_rng=True, finetune=False):
    """Load a checkpoint of any layout into this rank's modules, AdamW state, RNG and data state -> counters
    (FRESH with finetune: weights only). No collectives: each rank reads what it needs."""
    r, rank, lay = Reader(path), dist.get_rank(), par.layout
    say = (lambda msg: print(f"checkpoint: {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    bad = [f"{k} is {getattr(r.cfg, k)!r} in the checkpoint, {getattr(cfg, k)!r} in this run"
           for k in MODEL_FIELDS if cfg is not None and getattr(r.cfg, k) != getattr(cfg, k)]
    if bad:
        raise ValueError(f"{r.dir}/{CONFIG_NAME}: config mismatch: " + "; ".join(bad))
    absent = [m for m in modules if not any(n.startswith(m + ".") for n in r.tensors)]
    if absent and not finetune:
        raise ValueError(f"{r.dir}: holds no {absent} tensors (--finetune starts such a module from its init)")
    entries = [e for e in _entries(par, modules) if e[0].split(".", 1)[0] not in absent]
    extra = sorted(set(n for n in r.tensors if n.split(".", 1)[0] in modules) - {e[0] for e in entries})
    if extra:
        raise ValueError(f"{r.dir}/{META_NAME}: unexpected tensors {extra[:5]} (not in this run's model)")
    with torch.no_grad():
        for name, t, _, coords, sizes in entries:
            x = r.read(name, shards=getattr(t, "shards", ()), coords=coords, sizes=sizes)
            if x.shape != t.shape or (x.dtype != t.dtype and not finetune):
                raise ValueError(f"{r.dir}/{META_NAME}: tensor {name} ({r.tensors[name]['dtype']} "
                                 f"{r.tensors[name]['shape']}) does not fit this run's {_dtype(t)} {list(t.shape)}")
            t.copy_(x)
    if opt is not None and load_optim and not finetune:
        _load_optimizer(r, opt, entries, say)
    saved = r.meta["layout"]
    rank_state = None
    if saved and r.meta["ranks"] and all(saved[k] == getattr(lay, k) for k in GRID_FIELDS) and not finetune:
        with open(os.path.join(r.dir, f"rank_{rank:05d}.json")) as f:
            rank_state = json.load(f)
    if load_rng and not finetune and rank_state is not None:
        _set_rng_state(rank_state["rng"])
    elif load_rng and not finetune:
        say(f"saved under another layout ({r.meta.get('layout_text')}): RNG not restored (as --no-load-rng)")
    if hasattr(data, "load_state_dict") and not finetune:   # the data loader's own position, if it keeps one
        lanes = r.meta.get("data", {}).get("lanes") or [{}]
        state = rank_state["data"] if rank_state is not None else lanes[0].get("state")
        if state is not None:
            data.load_state_dict(state)
    say(f"loaded {r.dir} (step {r.meta['step']}{', weights only' if finetune else ''}) into {lay.describe()}"
        + (f"; {absent} not in it: initialised as usual" if absent else ""))
    return dict(FRESH) if finetune else dict(r.meta["counters"])


def _load_optimizer(r, opt, entries, say):
    by_id = {id(t): (name, coords, sizes) for name, t, _, coords, sizes in entries}
    sd, fresh = opt.state_dict(), []
    sd["state"] = {}
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        name, coords, sizes = by_id[id(p)]
        if not r.tensors[name]["optim"]:
            fresh.append(name)
            continue
        where = dict(kind="optim", shards=getattr(p, "shards", ()), coords=coords, sizes=sizes)
        sd["state"][i] = {"step": r.read(name, ".step", "optim"), "exp_avg": r.read(name, ".exp_avg", **where),
                          "exp_avg_sq": r.read(name, ".exp_avg_sq", **where)}
    opt.load_state_dict(sd)
    if fresh:
        say(f"{len(fresh)} trainable tensors had no optimizer state (frozen when saved), e.g. {fresh[0]}: fresh AdamW")


def load_model(path):
    """-> (Config, {full name: full tensor}) from any checkpoint (any layout, or save_model's)."""
    r = Reader(path)
    return r.cfg, {name: r.read(name) for name in r.tensors}


def load_into(module, state_dict, source):
    """Strict load with shapes checked first, so the error names the file and the tensors."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_tensors(state_dict, expected, source)
    module.load_state_dict(state_dict, strict=True)


def check_tensors(state_dict, expected, source, file_of=None):
    """Same names and shapes as `expected` ({name: shape}), or a ValueError listing every offender."""
    file_of = file_of or {}
    errors = [f"{source}: missing tensor {k}" for k in expected if k not in state_dict]
    errors += [f"{file_of.get(k, source)}: unexpected tensor {k}" for k in state_dict if k not in expected]
    errors += [f"{file_of.get(k, source)}: tensor {k} has shape {list(v.shape)}, expected {list(expected[k])}"
               for k, v in state_dict.items() if k in expected and tuple(v.shape) != tuple(expected[k])]
    if errors:
        raise ValueError(f"{len(errors)} checkpoint error(s):\n  " + "\n  ".join(errors))


def language_state_dict(state_dict, prefix=LM_PREFIX):
    """The language model's entries of a full-model state dict, prefix stripped."""
    return {k[len(prefix):]: v for k, v in state_dict.items()
            if k.startswith(prefix) and k[len(prefix):].startswith(LM_ROOTS)}


def lm_shapes(cfg):
    """{name: shape} of LanguageModel(cfg)'s state dict, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        lm = model.LanguageModel(cfg)
    return {k: tuple(v.shape) for k, v in lm.state_dict().items()}


# ---------------------------------------------------------------- HF export

def export_hf(cfg, lm_state_dict, out_dir, max_shard_bytes=DEFAULT_SHARD_BYTES, dtype=None):
    """Write an HF `nemotron_h` directory (config.json + safetensors, sharded above max_shard_bytes).

    lm_state_dict: LanguageModel names (strip any VLM prefix first, see language_state_dict). dtype casts the
    floating tensors, except the expert bias, which stays fp32 as HF keeps it (_keep_in_fp32_modules_strict).
    """
    check_tensors(lm_state_dict, lm_shapes(cfg), "export_hf(lm_state_dict)")
    tensors = {}
    for k, v in lm_state_dict.items():
        v = v.detach().cpu()
        if k.endswith("e_score_correction_bias"):
            v = v.float()
        elif dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        m = STACKED_KEY.match(k)
        if m:   # views; each shard copies its own slice at write time
            tensors.update({f"{m[1]}.{j}.{m[2]}.weight": w for j, w in enumerate(v.unbind(0))})
        else:
            tensors[k] = v
    os.makedirs(out_dir, exist_ok=True)
    torch_dtype = str(tensors["backbone.embeddings.weight"].dtype).removeprefix("torch.")
    _write(os.path.join(out_dir, CONFIG_NAME), hf_config(cfg, torch_dtype))
    _write_shards(tensors, out_dir, max_shard_bytes)


def hf_config(cfg, torch_dtype="bfloat16"):
    hf = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "torch_dtype": torch_dtype,
          "num_hidden_layers": len(cfg.hybrid_override_pattern), "max_position_embeddings": cfg.seq_len}
    hf.update({k: getattr(cfg, k) for k in HF_SAME}, **HF_FIXED, **HF_INFO)
    hf.update({h: getattr(cfg, ours) for h, ours in HF_RENAMED.items()})
    return dict(sorted(hf.items()))


def _write_shards(tensors, out_dir, max_shard_bytes):
    """Greedy in key order. One shard -> model.safetensors; more -> model-0000k-of-0000n + index."""
    for stale in glob.glob(os.path.join(out_dir, "model*.safetensors*")):
        os.remove(stale)   # a loader would otherwise pick up shards or the index of an earlier export
    shards, size = [[]], 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    names = [WEIGHTS_NAME] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for keys, name in zip(shards, names):   # clone: unbound expert views share storage, safetensors refuses that
        save_file({k: tensors[k].contiguous().clone() for k in keys}, os.path.join(out_dir, name),
                  metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        weight_map = {k: name for keys, name in zip(shards, names) for k in keys}
        _write(os.path.join(out_dir, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})


# ---------------------------------------------------------------- HF import

def import_hf(hf_dir, preset="nano"):
    """-> (Config, LanguageModel state dict) from an HF `nemotron_h` directory (single file or sharded).

    Non-language Config fields come from `preset`. `mtp.*` keys are ignored (HF ignores them too). Besides the
    original names (`backbone.`, one tensor per expert) this accepts transformers' in-memory names (`model.`,
    stacked experts), which are our names under another root.
    """
    cfg_file = os.path.join(hf_dir, CONFIG_NAME)
    with open(cfg_file) as f:   # a missing file raises FileNotFoundError naming it
        cfg = config_from_hf(json.load(f), cfg_file, preset)
    raw, file_of = _read_hf_tensors(hf_dir)
    root = lambda k: "backbone." + k[len("model."):] if k.startswith("model.") else k   # noqa: E731
    raw = {root(k): v for k, v in raw.items() if not k.startswith("mtp.")}
    file_of = {root(k): f for k, f in file_of.items()}
    expected = lm_shapes(cfg)
    state_dict = _stack_experts(raw, file_of, expected, cfg.n_routed_experts)
    check_tensors(state_dict, expected, hf_dir, file_of)
    return cfg, state_dict


def config_from_hf(hf, source="config.json", preset="nano"):
    if hf.get("model_type", "nemotron_h") != "nemotron_h":
        raise ValueError(f"{source}: model_type {hf['model_type']!r}, expected 'nemotron_h'")
    errors = [f"{k}={hf[k]!r} (this model implements {v!r})" for k, v in HF_FIXED.items() if k in hf and hf[k] != v]
    # HF writes infinity as {"__float__": "Infinity"}
    lo, hi = (float(x["__float__"] if isinstance(x, dict) else x) for x in hf.get("time_step_limit", (0, math.inf)))
    if lo > 0 or hi != math.inf:   # a dt clamp our model does not apply
        errors.append(f"time_step_limit=[{lo}, {hi}] (this model implements [0, inf])")
    if "layers_block_type" in hf:  # transformers 5.x writes this list instead of the pattern string
        pattern = "".join(HF_LAYER_TYPES.get(t, "?") for t in hf["layers_block_type"])
    else:
        pattern = hf.get("hybrid_override_pattern", config.resolve(preset).hybrid_override_pattern)
    if set(pattern) - set("M*E-"):
        errors.append(f"layer pattern {pattern!r} (layers_block_type {hf.get('layers_block_type')}): only M * E -")
    if "num_hidden_layers" in hf and hf["num_hidden_layers"] != len(pattern):
        errors.append(f"num_hidden_layers={hf['num_hidden_layers']} but the pattern has {len(pattern)} layers")
    if errors:
        raise ValueError(f"{source}: unsupported: " + "; ".join(errors))
    types = {f.name: f.type for f in dataclasses.fields(config.Config)}
    overrides = {k: types[k](hf[k]) for k in HF_SAME if k in hf and k != "hybrid_override_pattern"}
    overrides.update({ours: types[ours](hf[h]) for h, ours in HF_RENAMED.items() if h in hf})
    overrides["hybrid_override_pattern"] = pattern
    return config.resolve(preset, overrides)


def _read_hf_tensors(hf_dir):
    """-> ({key: tensor}, {key: file}) from model.safetensors or the shards named in the index."""
    index = os.path.join(hf_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(hf_dir, WEIGHTS_NAME)):
        files = [WEIGHTS_NAME]
    else:
        raise FileNotFoundError(f"{hf_dir}: neither {WEIGHTS_NAME} nor {INDEX_NAME} found")
    tensors, file_of = {}, {}
    for name in files:
        path = os.path.join(hf_dir, name)
        for k, v in load_file(path).items():   # a missing shard raises FileNotFoundError naming it
            if k in tensors:
                raise ValueError(f"{path}: tensor {k} is also in {file_of[k]}")
            tensors[k], file_of[k] = v, path
    return tensors, file_of   # keys listed in the index but absent show up as missing in the strict check


def _stack_experts(raw, file_of, expected, num_experts):
    """Per-expert HF tensors -> our stacked [E, ...] tensors; every expert 0..E-1 present, shapes checked."""
    out, groups = {}, {}
    for k, v in raw.items():
        m = EXPERT_KEY.match(k)
        if m:
            groups.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = k
        else:
            out[k] = v
    errors = []
    for name, by_expert in groups.items():
        keys = [by_expert.get(j) for j in range(num_experts)]
        base, proj = name.rsplit(".", 1)
        errors += [f"{base}.{j}.{proj}.weight missing" for j, k in enumerate(keys) if k is None]
        errors += [f"{file_of[k]}: unexpected tensor {k} (n_routed_experts={num_experts})"
                   for j, k in by_expert.items() if j >= num_experts]
        want = expected.get(name, (None,))[1:]   # a name not expected at all is reported by the strict check
        errors += [f"{file_of[k]}: tensor {k} has shape {list(raw[k].shape)}, expected {list(want)}"
                   for k in keys if k is not None and name in expected and tuple(raw[k].shape) != want]
        if not errors:
            out[name] = torch.stack([raw[k] for k in keys])
            file_of[name] = file_of[keys[0]]
    if errors:
        raise ValueError(f"{len(errors)} checkpoint error(s):\n  " + "\n  ".join(errors))
    return out


def export(path, out_dir, max_shard_bytes=DEFAULT_SHARD_BYTES, dtype=None):
    """export-hf: a checkpoint of any layout -> the language model as HF nemotron_h (export_hf) and the vision
    tower + projector as OUT/vision.safetensors under HF Nemotron-VL names (radio.hf_name: `vision_model.…`,
    `mlp1.{0,1,3}.weight`)."""
    cfg, sd = load_model(path)
    export_hf(cfg, language_state_dict(sd), out_dir, max_shard_bytes, dtype)
    vision = {radio.hf_name(k[len("vision."):]): v.to(dtype) if dtype and v.is_floating_point() else v
              for k, v in sd.items() if k.startswith("vision.")}
    if vision:
        _write(os.path.join(out_dir, VISION_NAME), vision)


# ---------------------------------------------------------------- CLI

def main(argv=None):
    p = argparse.ArgumentParser(description="Convert between our checkpoints and HF directories.")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-hf", help="checkpoint (any layout) -> HF nemotron_h dir + vision.safetensors")
    e.add_argument("--load", required=True, help="a save directory (uses `latest`) or a step directory")
    e.add_argument("--out", required=True)
    e.add_argument("--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES)
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast (default: keep dtypes)")
    i = sub.add_parser("import-hf", help="HF nemotron_h dir (config.json + safetensors) -> our checkpoint dir")
    i.add_argument("--hf", required=True)
    i.add_argument("--out", required=True)
    i.add_argument("--preset", default="nano", help="preset for the fields HF does not carry")
    args = p.parse_args(argv)
    if args.cmd == "export-hf":
        export(args.load, args.out, args.max_shard_bytes, getattr(torch, args.dtype) if args.dtype else None)
    else:
        cfg, sd = import_hf(args.hf, args.preset)
        save_model(args.out, cfg, {LM_PREFIX + k: v for k, v in sd.items()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
