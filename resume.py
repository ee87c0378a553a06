"""What a command line continues, and the one Config it runs with (docs/checkpoints.md §1, §2, §4): a fresh run, a
fresh run from released weights (--load HF_DIR), a new run from saved weights (--load CKPT --finetune), or CKPT's
run resumed (--load CKPT): a checkpoint is its run, so its record applies with the flags given, but those that would
change the model. A line whose --save holds a complete checkpoint resumes it or is refused (_requeue); a run never
saves over later steps.
"""
import dataclasses
import os
import tempfile
from dataclasses import dataclass, field

import torch.distributed as dist

import checkpoint
import config
import data
import hf_interop


@dataclass
class Start:
    """Where a run's weights and files come from."""
    kind: str                       # fresh | hf | weights | resume
    load: object = None             # the checkpoint's step directory, or hf_interop.HFSource
    lineage: list = field(default_factory=list)   # real paths of every --load this run came from, oldest first
    tokenizer: str = None           # where the tokenizer loads from: the checkpoint's copy when it has one
    source: str = None              # HF files to carry into checkpoints: an HF directory or a checkpoint's source/

    @property
    def weights_only(self):
        return self.kind in ("hf", "weights")


def resolve(inv, given, world, say):
    """(Config, Start) of a command line: inv its invocation flags, given the Config fields it set, world the
    number of ranks. say: rank 0's print."""
    load, requeued = _requeue(inv, given, say)
    if load is None:
        cfg = config.resolve(given.get("preset", config.Config.preset), given)
        return cfg, Start("fresh", tokenizer=cfg.tokenizer)
    if hf_interop.is_hf_dir(load):
        return _from_hf(load, given, say)
    step_dir = call(checkpoint.pin, load, say)   # until set-up has read it (train.setup)
    record = call(checkpoint.saved_config, step_dir)
    meta = call(checkpoint.read_json, os.path.join(step_dir, checkpoint.META_NAME))
    lineage = list(meta.get("run", {}).get("lineage", []))
    source = os.path.join(step_dir, checkpoint.SOURCE_DIR)
    finetune = inv.finetune and not requeued
    start = Start("weights" if finetune else "resume", step_dir, lineage,
                  source=source if os.path.isdir(source) else None)
    if finetune:
        keep = config.MODEL_FIELDS + ("tokenizer",) + (("lora_rank", "lora_alpha", "lora_targets")
                                                       if record.lora_rank else ())
        _refuse(record, given, keep, f"--load {load} --finetune takes the model from the checkpoint")
        values = {k: getattr(record, k) for k in keep}
        cfg = config.resolve(given.get("preset", record.preset), {**given, **values})
    else:
        _refuse(record, given, config.FIXED_ON_RESUME, f"--load {load} resumes its run")
        # the run goes on saving where it was loaded from (a copy of a run saves into the copy)
        saved = record = dataclasses.replace(record, save=_save_dir(load, step_dir))
        if meta.get("ranks") != world or any(k in given for k in config.LAYOUT_FIELDS):
            # a layout saved on another number of ranks cannot apply; layout flags given replace it as a whole
            record = dataclasses.replace(record, **{k: None for k in config.LAYOUT_FIELDS})
        cfg = config.from_values(dataclasses.asdict(record), given)
        changed = config.changes(saved, cfg)   # against the run as saved: its layout too
        if changed:
            say(f"--load {load}: changed from the checkpoint's run: " + "; ".join(
                f"--{config.flag(k)} {_shown(k, old)} -> {_shown(k, new)}" for k, old, new in changed))
        later = [d for d in checkpoint.complete_steps(cfg.save) if int(d[5:]) > meta.get("step", 0)] \
            if cfg.save is not None and not inv.eval_only else []
        if later:
            raise SystemExit(f"--load {load} would continue in {cfg.save}, which holds later steps ("
                             f"{', '.join(later[:3])}{', ...' if len(later) > 3 else ''}) that it would replace. "
                             f"Pass --save NEW_DIR to branch into a new directory, or --load {cfg.save} to continue "
                             "from the newest step")
    if _real(load) not in lineage and not _inside(load, cfg.save):   # a run saved elsewhere than it came from
        lineage.append(_real(load))
    start.tokenizer = _tokenizer(cfg, step_dir, given.get("tokenizer"), load)
    return cfg, start


def agree(start):
    """Every rank loads rank 0's step: each chose the newest before the ranks met (resolve), and a run still saving
    into --load may have committed a step in between. Rank 0's stays pinned until every rank has loaded it."""
    if not isinstance(start.load, str) or not dist.is_initialized():
        return
    chosen = [start.load]
    dist.broadcast_object_list(chosen, 0)
    if chosen[0] == start.load:
        return
    step_dir = call(checkpoint.pin, chosen[0])
    if call(checkpoint.saved_config, step_dir) != call(checkpoint.saved_config, start.load):
        raise SystemExit(f"{os.path.dirname(step_dir)} changed while this run started: rank 0 loads "
                         f"{os.path.basename(step_dir)}, rank {dist.get_rank()} chose {os.path.basename(start.load)}, "
                         "whose run record differs. Run the command again")
    for name in ("tokenizer", "source"):   # the run's files: those of the step loaded
        path = getattr(start, name)
        if path is not None and path.startswith(start.load + os.sep):
            setattr(start, name, step_dir + path[len(start.load):])
    start.load = step_dir


def _shown(field, value):   # an unset layout field is the chooser's
    return "chosen" if value is None and field in config.LAYOUT_FIELDS else value


def _requeue(inv, given, say):
    """(what to load, whether it is --save's run resumed by (ii) or (iii)): --load as given, or, when --save DIR holds
    a complete checkpoint, DIR's newest complete step if the line is that run's:
      (i)   --load is DIR or one of its step directories (that step; --finetune there is refused: a new run would
            save over DIR's),
      (ii)  --load is where the run came from (its lineage; a --finetune line so resumes its fine-tune), or
      (iii) no --load, the run started fresh and the line describes its model (config.MODEL_FIELDS and the preset);
    any other line is refused in one line naming what differs."""
    save, load = given.get("save"), inv.load
    if save is None or inv.eval_only:
        return load, False
    step_dir, note = checkpoint.newest(save)
    if step_dir is None:
        if load is not None and _real(load) == _real(save):
            say(f"--load {load}: no checkpoint there yet: starting fresh; a later attempt of the same command "
                "resumes from it")
            return None, False
        return load, False
    meta = call(checkpoint.read_json, os.path.join(step_dir, checkpoint.META_NAME))
    lineage, step = meta.get("run", {}).get("lineage", []), meta.get("step")
    if load is not None and _inside(load, save):   # (i)
        if inv.finetune:
            raise SystemExit(f"--load {load} --finetune would start a new run in --save {save}, which holds step "
                             f"{step} of its own run; pass --save NEW_DIR for the new run, or drop --finetune to "
                             "continue that run")
        return load, False
    why = [f"started from {lineage[0]}" if lineage else "started fresh"]
    if load is None:
        record = call(checkpoint.saved_config, step_dir)
        line = config.resolve(given.get("preset", config.Config.preset), given)
        differ = [f"{k} {getattr(record, k)}, the line's {getattr(line, k)}" for k in ("preset",) + config.MODEL_FIELDS
                  if getattr(record, k) != getattr(line, k)]
        why += differ[:3] + ["..."] * (len(differ) > 3) + ["this line starts fresh"] * bool(lineage)
    else:
        differ = []
        why.append(f"this line starts from --load {load}")
    if (load is None and not lineage and not differ) or (load is not None and _real(load) in lineage):   # (iii), (ii)
        if note:
            say(f"--save {save}: {note}")
        say(f"--save {save} holds step {step} of this run: resuming from it" + ("" if load is None else
            f", not from --load {load} (where the run started)"))
        return step_dir if note else save, True
    raise SystemExit(f"--save {save} holds step {step} of {'a run of another model' if differ else 'another run'} "
                     f"({'; '.join(why)}); choose another --save, or --load {save} to continue that run")


def _from_hf(hf_dir, given, say):
    shape = sorted(k for k in given if k in config.MODEL_FIELDS and k != "image_token_id")
    if shape:
        raise SystemExit(f"--load {hf_dir} is an HF directory: the model's shape comes from its config.json; drop "
                         f"{', '.join('--' + config.flag(k) for k in shape)}")
    preset = given.get("preset", config.Config.preset)
    source = call(hf_interop.HFSource, hf_dir, preset, given.get("image_token_id"), seed=given.get(
        "seed", config.Config.seed), say=say)
    tokenizer = given.get("tokenizer")
    if tokenizer is None and os.path.exists(os.path.join(hf_dir, "tokenizer_config.json")):
        tokenizer = hf_dir
    values = {k: getattr(source.cfg, k) for k in config.MODEL_FIELDS}
    cfg = config.resolve(preset, {**given, **values, "tokenizer": tokenizer})
    say(f"--load {hf_dir}: HF {'VLM' if source.omni else 'language model'}, fields HF does not carry from --preset "
        f"{preset}, tokenizer {tokenizer or 'byte-level (the default)'}")
    return cfg, Start("hf", source, [_real(hf_dir)], tokenizer, hf_dir)


def _refuse(record, given, fields, why):
    """One line naming every given flag that differs from the record in `fields` (the tokenizer: by content)."""
    bad = [f"--{config.flag(k)} {given[k]} (the checkpoint's: {getattr(record, k)})" for k in fields
           if k in given and k != "tokenizer" and given[k] != getattr(record, k)]
    if bad:
        raise SystemExit(f"{why}, whose {'value differs' if len(bad) == 1 else 'values differ'}: {', '.join(bad)}. "
                         "Drop these flags (the checkpoint is the run), or start a new run")


def _tokenizer(cfg, step_dir, flag, load):
    """Where the run's tokenizer loads from: the checkpoint's copy; a --tokenizer given must have equal content."""
    copy = os.path.join(step_dir, checkpoint.TOKENIZER_DIR)
    have = copy if os.path.isdir(copy) else cfg.tokenizer
    if have is not None and not os.path.exists(have):
        raise SystemExit(f"--load {load}: the run's tokenizer {have} is gone and the checkpoint holds no copy; pass "
                         "--tokenizer with the same tokenizer")
    if flag is not None and (have is None or _real(flag) != _real(have)):
        ours, theirs = data.load_tokenizer(have, cfg).fingerprint, data.load_tokenizer(flag, cfg).fingerprint
        if ours != theirs:
            raise SystemExit(f"--tokenizer {flag} is not the tokenizer --load {load} was trained with "
                             f"({have or 'the byte-level one'}): its token ids would mean other text. Drop "
                             "--tokenizer (the checkpoint keeps its own)")
    return have


def write_run_files(step_dir, tokenizer, source):
    """The run's files in a step directory (rank 0, before the step is committed)."""
    if hasattr(tokenizer, "save"):
        tokenizer.save(os.path.join(step_dir, checkpoint.TOKENIZER_DIR))
    if source is not None:
        hf_interop.copy_source(source, os.path.join(step_dir, checkpoint.SOURCE_DIR))


def run_source(cfg, start):
    """The HF files this run's next save copies (copy_source): those of its newest step in --save once it has them,
    else Start.source (the HF directory, or those of the step it was loaded from: borrowed)."""
    step_dir = checkpoint.newest(cfg.save)[0]
    own = step_dir and os.path.join(step_dir, checkpoint.SOURCE_DIR)
    return own if own and os.path.isdir(own) else start.source


def borrowed(cfg, start):
    """Whether this run's saves copy HF files from a step of another save directory until they have a copy of their
    own (a branch or fine-tune of a run that may prune that step meanwhile: rank 0 keeps it pinned till then)."""
    return start.kind in ("resume", "weights") and None not in (cfg.save, start.source) and \
        not _inside(start.source, cfg.save)


def run_file_names(tokenizer, source):
    """The paths in a step directory that write_run_files writes (the Saver checks their length before step 1)."""
    names = []
    if hasattr(tokenizer, "save"):
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save(tmp)
            names += [os.path.join(checkpoint.TOKENIZER_DIR, os.path.relpath(os.path.join(d, f), tmp))
                      for d, _, files in os.walk(tmp) for f in files]
    if source is not None:
        names += [os.path.join(checkpoint.SOURCE_DIR, n) for n in os.listdir(source) if os.path.isfile(
            os.path.join(source, n)) and not hf_interop.WEIGHT_FILES.search(n)]
        carried = os.path.exists(os.path.join(source, hf_interop.CARRIED_NAME))   # linked, else written (+ .tmp)
        names.append(os.path.join(checkpoint.SOURCE_DIR, hf_interop.CARRIED_NAME + ("" if carried else ".tmp")))
    return names


def call(fn, *args, **kwargs):
    """fn's checkpoint errors (a missing or mismatched checkpoint) as user errors."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"{e}. Check --load (a save directory or DIR/step_N of a run of this model)") from None


def _save_dir(load, step_dir):   # --load itself, or the parent of a step directory
    if not checkpoint.complete(load):
        return load
    parent = os.path.dirname(os.path.abspath(step_dir))
    return parent if checkpoint.STEP.fullmatch(os.path.basename(os.path.abspath(step_dir))) else None


def _real(path):
    return os.path.realpath(path)


def _inside(path, root):   # `path` is `root` or lies in it
    return root is not None and (_real(path) + os.sep).startswith(_real(root) + os.sep)
