"""init.py: modules built on the meta device and materialised one parameter at a time hold exactly the fp32 init
on the CPU (every parameter drawn whole by name, this rank's slice kept) in every layout, LoRA adapters and the
routers' expert biases included; a load draws nothing it then overwrites; the dtypes it gives on CUDA hold the
bytes memory.py plans (the CUDA set-up peak itself: tests/test_gpu.py::test_set_up_peak_is_bf16_weights_plus_one_draw)."""
import hashlib
import types

import pytest
import torch

import cli
import comm
import layout
import lora
import memory
import model
import optim
import parallel
import train
from radio import VisionModel
from tests.spawn import run_distributed
from tests.test_train import full_state

ADAPTERS = ["--lora-rank", "4", "--lora-targets", r"(q_proj|in_proj|out_proj|up_proj|down_proj|mlp1\.1)$"]
LATENT_MTP = ["--moe-latent-size", "32", "--num-nextn-predict-layers", "1"]
SMALL = ["--preset", "small", "--seq-len", "128", "--mock-image-size", "64"]
# sha256 (16 hex digits) of every initial tensor, drawn by the code before init.py (commit a2b2a4a: each module
# built in fp32, model.init_weights, lora.apply drawing its A matrices), in any layout
PINNED = {"tiny": "43d6e8033a54d26f", "tiny lora": "c8b809a1b4a246c6", "tiny latent mtp": "0f3139676d1aab46",
          "small": "076d63f1f8691b5f"}
CASES = {"tiny": ["--preset", "tiny"], "tiny lora": ["--preset", "tiny", *ADAPTERS],
         "tiny latent mtp": ["--preset", "tiny", *LATENT_MTP], "small": SMALL}


def digest(state):
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def reference(argv):
    """{full name: tensor} of the whole model in one process, fp32 on the CPU, each module built in full and drawn
    by its own init (VisionModel.reset_parameters, model.init_weights), the adapters drawn by name."""
    cfg = cli.config_of(argv)
    modules = {"vision": VisionModel(cfg), "language": model.LanguageModel(cfg)}
    model.init_weights(modules["language"], cfg.seed + model.SEED, {}, cfg)
    if cfg.lora_rank:
        lora.apply(modules, cfg)
    out = {}
    for key, m in modules.items():
        for name, p in m.named_parameters():
            if "lora_" in name:
                p.data = comm.draw(f"{key}.{name}", cfg.seed + lora.SEED, p.shape, lora.rule(name))
            out[f"{key}.{name}"] = p.detach()
        out.update({f"{key}.{n}": b for n, b in m.named_buffers() if n.endswith("e_score_correction_bias")})
    return out


def _set_up(rank, world, argv):
    """The modules train.main sets up (no step), as full tensors."""
    _, modules = train.main(list(argv) + ["--steps", "0"])
    return full_state(modules)


@pytest.mark.parametrize("case,layout,world", [
    ("tiny", [], 1), ("tiny", ["--colocated", "--lm-tp", "2", "--lm-ep", "2"], 2),
    ("tiny", ["--colocated", "--lm-ep", "2", "--lm-etp", "2"], 4),
    ("tiny lora", ["--colocated", "--lm-tp", "2", "--lm-ep", "2"], 2),
    ("tiny latent mtp", ["--colocated", "--lm-tp", "2"], 2),
    ("small", ["--colocated", "--lm-tp", "2", "--lm-ep", "2"], 2)])
@pytest.mark.slow
def test_materialised_init_equals_the_fp32_init_bit_for_bit(case, layout, world):
    ref = reference(CASES[case])
    assert digest(ref) == PINNED[case]
    for got in run_distributed(_set_up, world, CASES[case] + layout, timeout=120.0):
        assert got.keys() == ref.keys()
        for k, t in ref.items():
            assert got[k].dtype == t.dtype == torch.float32 and torch.equal(got[k], t), k


def _draws_of(rank, world, argv):
    """The names comm.draw draws while train.main sets up `argv`."""
    drawn, real = [], comm.draw

    def counting(name, *args, **kwargs):
        drawn.append(name)
        return real(name, *args, **kwargs)
    comm.draw = counting
    try:
        train.main(list(argv) + ["--steps", "0"])
    finally:
        comm.draw = real
    return drawn


@pytest.mark.slow
def test_a_load_draws_only_what_it_lacks(tmp_path):
    """Resuming draws nothing; a LoRA fine-tune from the saved weights draws its adapters alone."""
    save = str(tmp_path / "run")
    run_distributed(lambda r, w: train.main(["--preset", "tiny", "--steps", "1", "--save", save])[0], 1)
    assert run_distributed(_draws_of, 1, ["--load", save, "--steps", "2"])[0] == []
    drawn = run_distributed(_draws_of, 1, ["--load", save, "--finetune", *ADAPTERS])[0]
    assert drawn and all(".lora_" in n for n in drawn), drawn
    fresh = run_distributed(_draws_of, 1, ["--preset", "tiny", *ADAPTERS])[0]
    assert sorted(drawn) == sorted(n for n in fresh if ".lora_" in n)


def test_digest_has_teeth():
    """The pinned digests see one bit of one tensor, and a seed."""
    ref = reference(CASES["tiny"])
    ref["language.lm_head.weight"] = ref["language.lm_head.weight"].clone()
    ref["language.lm_head.weight"].view(torch.int32)[0, 0] ^= 1
    assert digest(ref) != PINNED["tiny"]
    assert digest(reference(CASES["tiny"] + ["--seed", "1235"])) != PINNED["tiny"]


@pytest.mark.parametrize("extra", [[], ["--activation-checkpointing"], ["--lora-rank", "4"], ["--stage", "3"],
                                   ["--no-distributed-optimizer"]])
def test_cuda_dtypes_are_the_plans(extra):
    """The dtypes init.py allocates on CUDA (optim.weight_dtypes) hold the bytes memory.py plans for the weights of
    one colocated rank: bf16, except trained weights optim keeps fp32 (experts at edp 1 under activation
    checkpointing; everything with the plain optimizer)."""
    cfg = cli.config_of(["--preset", "tiny", *extra])
    modules = memory.sizing_model(cfg)
    one_rank = types.SimpleNamespace(vision=parallel.ModuleGroups("vision"), lm=parallel.ModuleGroups("lm"))
    dtypes = optim.weight_dtypes(one_rank, modules["vision"], modules["language"], cfg, torch.device("cuda"))
    size = {torch.bfloat16: 2, torch.float32: 4}
    allocated = sum(p.numel() * size[dtypes[id(p)]] for m in modules.values() for p in m.parameters())
    assert allocated == memory.plan(cfg, layout.plan(cfg, 1))["language"]["weights"]
    fp32 = {dtypes[id(p)] == torch.float32 for m in modules.values() for p in m.parameters()}
    assert fp32 == ({True} if extra == ["--no-distributed-optimizer"] else
                    {True, False} if extra == ["--activation-checkpointing"] else {False})
