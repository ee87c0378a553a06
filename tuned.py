"""The Mamba kernels' start-up (docs/speed.md §2): mamba_ssm's fused Mamba2 function loaded without its package's
__init__ (6 s a process), one Triton cache directory, and its SSD kernels' Triton configs from TABLE (tuned.json,
bench/tune_mamba.py: {kernel: {the shape part of its autotune key: config}}, as chosen on one H100), untimed; other
shapes autotune. Only on compute capability 9.0: another GPU's limits may refuse a config. Every config computes the
same sums: the choice changes speed, never results.
"""
import importlib.util
import json
import os
import sys

# Triton keeps compiled kernels and autotune results under TRITON_CACHE_DIR. torch.compile sets it to its own
# directory in the middle of a process, when it first builds a kernel (not when its cache serves it), so one
# process's Mamba kernels landed where the next did not look. Set once, at import, before anything compiles.
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ.get("TRITON_HOME", os.path.expanduser("~")),
                                                       ".triton", "cache"))
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")   # other shapes' autotune results, kept the same way

# bench/tune_mamba.py on one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, mamba_ssm 2.3.2.post1
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned.json")) as _f:
    TABLE = json.load(_f)

_combined = None


def mamba_kernel():
    """mamba_ssm's mamba_split_conv1d_scan_combined, loaded once a process with TABLE pinned."""
    global _combined
    if _combined is None:
        if "mamba_ssm" not in sys.modules:   # the package without its __init__ (above): its modules import alone
            spec = importlib.util.find_spec("mamba_ssm")
            if spec is None:
                raise SystemExit("mamba_ssm is not installed: Mamba layers on CUDA run its fused kernels. "
                                 "pip install -e '.[gpu]'")
            sys.modules["mamba_ssm"] = importlib.util.module_from_spec(spec)
        from mamba_ssm.ops.triton.ssd_combined import mamba_split_conv1d_scan_combined
        import torch
        if torch.cuda.get_device_capability() == (9, 0):
            pin(TABLE)
        _combined = mamba_split_conv1d_scan_combined
    return _combined


def autotuners():
    """{kernel name: its triton Autotuner} over mamba_ssm's Triton modules imported so far."""
    from triton.runtime.autotuner import Autotuner
    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("mamba_ssm.ops.triton"):
            found.update({k: v for k, v in vars(module).items() if isinstance(v, Autotuner)})
    return found


def chosen():
    """{(kernel name, shape): config text} of what the autotuners hold so far in this process; a shape is the
    autotune key's values without its dtypes (the first of its dtype variants)."""
    found = {}
    for name, tuner in autotuners().items():
        for key, config in tuner.cache.items():
            found.setdefault((name, _shape(v for v in key if not str(v).startswith("torch."))), str(config))
    return found


def pin(table):
    """Each kernel in table runs its tuned config for a tuned shape (the key's values, dtypes left out), untimed."""
    for name, tuner in autotuners().items():
        by_text = {str(c): c for c in tuner.configs}
        chosen = {shape: by_text[text] for shape, text in table.get(name, {}).items() if text in by_text}
        if chosen:
            tuner.early_config_prune = _prune_to(chosen, tuner.keys, tuner.early_config_prune)
            _time_no_lone_config(tuner)


def _prune_to(chosen, keys, before):
    def prune(configs, nargs, **kwargs):
        args = {**nargs, **kwargs}
        shape = _shape(args[k] for k in keys if k in args)
        if shape in chosen:
            return [chosen[shape]]
        return before(configs, nargs, **kwargs) if before else configs
    return prune


def _time_no_lone_config(tuner):
    """Triton 3.6 times even a lone config its pruning leaves (>= 125 ms a kernel, every process for configs with a
    pre_hook); triton after PR #10413 does not. Here too: do_bench returns zeros without launching when the last
    pruning left one config. Relies on the tuner's do_bench attribute; where it cannot be set, nothing changes."""
    prune, bench = tuner.early_config_prune, getattr(tuner, "do_bench", None)
    if prune is None or not callable(bench):
        return
    lone = False

    def pruned(configs, nargs, **kwargs):
        nonlocal lone
        kept = prune(configs, nargs, **kwargs)
        lone = len(kept) == 1
        return kept

    def do_bench(kernel_call, *args, **kwargs):
        if lone:   # a timing nothing is compared with
            quantiles = kwargs.get("quantiles")
            return [0.0] * len(quantiles) if quantiles else 0.0
        return bench(kernel_call, *args, **kwargs)

    try:
        tuner.do_bench = do_bench
    except AttributeError:
        return
    tuner.early_config_prune = pruned


def _shape(values):
    """TABLE's key of a shape: the autotune key's values (dtypes left out), comma-joined."""
    return ",".join(str(v) for v in values)
