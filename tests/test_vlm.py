"""The VLM's loss on one device (vlm.py, the README's lines) is the loss a training step computes."""
import dataclasses

import pytest
import torch

import config
import init
import mock
import parallel
import train
import vlm


@pytest.mark.slow
def test_one_device_loss_is_the_first_steps_loss():
    cfg = config.resolve("tiny")
    history, _ = train.main(["--preset", "tiny", "--steps", "1"])
    modules = init.build(cfg, parallel.one_device(), torch.device("cpu"))   # the README's lines
    samples = [mock.MockData(cfg, cfg.seed)[i] for i in range(cfg.global_batch)]
    loss = vlm.loss(modules["vision"], modules["language"], samples, cfg)
    loss.backward()
    assert abs(loss.item() - history[0]["loss"]) < 1e-5
    assert modules["vision"].mlp1["1"].weight.grad.abs().sum() > 0    # the projector is in the graph
    # teeth: the same samples with their images replaced by a flat grey score otherwise
    grey = [dataclasses.replace(s, images=[torch.zeros_like(i) for i in s.images]) for s in samples]
    assert abs(vlm.loss(modules["vision"], modules["language"], grey, cfg).item() - loss.item()) > 1e-4
