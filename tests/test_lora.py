"""LoRA (lora.py) on gloo: only adapters train, tp2 / ep2 equals one process, resume is bit-exact, the merged
export computes the adapted model's logits, --adapters-only writes the adapters alone."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import cli
import hf_interop
import lora
import model
import train
from tests.spawn import run_distributed
from tests import test_train
from tests.test_train import assert_step_matches, full_state

# every default target: attention, Mamba in/out, dense MLP, shared experts, routed experts; the projector and the
# tower's row-parallel layers
LORA = ["--preset", "tiny", "--global-batch", "4", "--lr", "1e-2", "--lr-schedule", "constant", "--lora-rank", "4",
        "--lora-alpha", "8", "--lora-targets", lora.TARGETS[:-2] + r"|mlp1\.(1|3)|attn\.proj|mlp\.fc2)$"]


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def _train(rank, world, argv):
    history, modules = train.main(list(argv))
    return [h["loss"] for h in history], full_state(modules)


@pytest.fixture(scope="module")
def one_process():
    (init,) = run_distributed(_train, 1, LORA + ["--steps", "0"])
    (after,) = run_distributed(_train, 1, LORA + ["--steps", "3"])
    return init, after


@pytest.mark.slow
def test_only_adapters_train(one_process):
    (_, init), (losses, after) = one_process
    adapters = [k for k in after if "lora_" in k]
    assert {k.rsplit(".", 1)[-1] for k in adapters} == {"lora_A", "lora_B", "lora_up_A", "lora_up_B",
                                                        "lora_down_A", "lora_down_B"}
    assert any(k.startswith("vision.mlp1.") for k in adapters) and any(".experts." in k for k in adapters)
    assert any(k.endswith("attn.proj.lora_B") for k in adapters) and any(k.endswith("mlp.fc2.lora_A") for k in adapters)
    for k in after:   # the expert biases too: LoRA leaves the base as loaded (lora.py)
        moved = not torch.equal(after[k], init[k])
        assert moved == ("lora_" in k), k
    assert all(init[k].abs().max() == 0 for k in adapters if k.endswith("B"))   # B starts at zero
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("latent", [[], ["--moe-latent-size", "16"]], ids=["moe", "latent-moe"])
@pytest.mark.slow
def test_tp2_ep2_equals_one_process(latent):
    """One step (as tests/test_train.py's layouts): the loss, the adapters' reduced gradients and the updated
    weights equal one process's. (Over more steps AdamW amplifies last-bit differences of near-zero gradients.)
    latent-moe: adapters on LatentMoE's projections too, whose gradients are partial per tp rank."""
    one = LORA + ["--steps", "1", "--lr", "3e-4"] + latent       # test_train.ONE_STEP's lr
    (ref,) = run_distributed(test_train._train, 1, one)
    results = run_distributed(test_train._train, 4, one + ["--colocated", "--lm-tp", "2", "--lm-ep", "2",
                                                             "--vision-tp", "2"], timeout=90.0)
    assert_step_matches(results, ref, "lora tp2 ep2, vision tp2")
    assert all(g.abs().max() > 0 for k, g in ref[2].items() if "lora_" in k and k.endswith("B"))   # A: 0, as B = 0


@pytest.mark.slow
def test_resume_merged_export_and_adapters_only(tmp_path, one_process):
    _, (ref_losses, ref) = one_process
    save = str(tmp_path / "ckpt")
    first = run_distributed(_train, 2, LORA + ["--steps", "2", "--save", save, "--colocated", "--lm-dp", "2"])
    resumed = run_distributed(_train, 2, LORA + ["--steps", "3", "--save", save, "--colocated", "--lm-dp", "2",
                                                 "--load", save])
    straight = run_distributed(_train, 2, LORA + ["--steps", "3", "--colocated", "--lm-dp", "2"])
    assert first[0][0] + resumed[0][0] == straight[0][0]
    assert all(torch.equal(straight[0][1][k], resumed[0][1][k]) for k in straight[0][1])

    # the merged weights without adapters compute the adapted model's logits
    cfg, sd = checkpoint.load_model(save)
    merged = checkpoint.language_state_dict(lora.merge(sd, 8.0))
    plain = model.LanguageModel(cfg)
    plain.load_state_dict(merged)
    adapted = model.LanguageModel(cfg)
    lora.apply({"language": adapted}, cli.config_of(LORA))
    adapted.load_state_dict(checkpoint.language_state_dict(sd))
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted.logits(adapted(adapted.embed(ids))), plain.logits(plain(plain.embed(ids)))
    assert (want - got).abs().max() < 1e-5 * want.abs().max()
    base = model.LanguageModel(cfg)
    base.load_state_dict(checkpoint.language_state_dict({k: v for k, v in sd.items() if "lora_" not in k}))
    with torch.no_grad():
        assert (want - base.logits(base(base.embed(ids)))).abs().max() > 1e-3 * want.abs().max()   # adapters act

    out = str(tmp_path / "adapters")
    hf_interop.main(["export-hf", "--load", save, "--out", out, "--adapters-only"])
    adapters = load_file(os.path.join(out, "adapter_model.safetensors"))   # PEFT's format (test_peft.py)
    assert len(adapters) == len([k for k in sd if "lora_" in k])
    written = json.load(open(os.path.join(out, "adapter_config.json")))
    assert (written["peft_type"], written["r"], written["lora_alpha"]) == ("LORA", 4, 8.0)
    hf_interop.main(["export-hf", "--load", save, "--out", str(tmp_path / "hf")])   # merged: an HF directory
    assert os.path.exists(os.path.join(tmp_path, "hf", "config.json"))


def test_vision_row_parallel_adapter_applies_at_tp1():
    """attn.proj / mlp.fc2 (bias inside the GEMM at vision tp 1): an adapter there changes the layer's output by
    exactly scale * B A x (vision tp 2: test_tp2_ep2_equals_one_process)."""
    from radio import VisionModel
    cfg = train.config.resolve("tiny", dict(lora_targets=r"blocks\.0\.attn\.proj$", lora_rank=2, lora_alpha=4))
    torch.manual_seed(0)
    vision = VisionModel(cfg)
    blk = vision.blocks[0]
    x = torch.randn(20, cfg.vit_hidden)
    seen = []
    record = lambda m, inp, out: seen.append((inp[0], out))   # noqa: E731  (after LoRA's hook: the sum)
    h = blk.attn.proj.register_forward_hook(record)
    blk(x, [20])
    h.remove()
    lora.apply({"vision": vision}, cfg)
    p = blk.attn.proj
    with torch.no_grad():
        p.lora_A.normal_(), p.lora_B.normal_()
    p.register_forward_hook(record)
    blk(x, [20])
    (x0, before), (x1, after) = seen
    assert torch.equal(x0, x1) and not torch.allclose(after, before)
    assert torch.allclose(after - before, x1 @ p.lora_A.T @ p.lora_B.T * 2.0, atol=1e-5)
