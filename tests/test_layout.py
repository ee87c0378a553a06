"""layout.py's choice of a layout by memory and bytes moved, checked against memory.plan; its refusals."""
import dataclasses

import pytest
import torch

import cli
import config
import layout
import memory

GIB = memory.GIB
H100 = 80 * GIB


def dims(lay):
    return (lay.colocated, lay.vision_tp, lay.vision_dp, lay.lm_tp, lay.lm_dp, lay.lm_ep, lay.lm_etp, lay.lm_cp)


def choose(cfg, world, capacity=H100, cuda=True):
    """plan()'s choice and its one line, checked against every candidate: it fits, and it is the reference layout
    or no fitting colocated layout moves fewer bytes (a tie goes to the smaller tp, cp, ep, etp; layouts with cp > 1
    count only when none without fits)."""
    said = []
    lay = layout.plan(cfg, world, capacity, cuda=cuda, say=said.append)
    plans = {c: memory.plan(cfg, c, cuda) for c in layout.candidates(cfg, world)}
    assert memory.fits(plans[lay], capacity) is None
    if lay != layout.reference(cfg, world):
        fitting = [c for c, rows in plans.items() if c.colocated and memory.fits(rows, capacity) is None]
        fitting = [c for c in fitting if c.lm_cp == 1] or fitting                # cp only where nothing else fits
        key = {c: (layout.bytes_moved(cfg, c, cuda), c.lm_tp, c.lm_cp, c.lm_ep, c.lm_etp) for c in fitting}
        assert all(key[lay] < key[c] for c in fitting if c != lay)
    assert len(said) == 1 and lay.describe() in said[0], said
    return lay, plans[lay], said[0]


def peak(rows):
    return round(max(r["peak"] for r in rows.values()) / GIB, 2)


def test_nano_on_8_and_16_ranks():
    cfg = config.resolve("nano")
    assert cfg.activation_checkpointing and "nano" not in config.REFERENCE_LAYOUTS
    lay, rows, said = choose(cfg, 8)
    assert dims(lay) == (True, 2, 4, 2, 4, 8, 1, 1) and lay.lm_edp == 1
    assert peak(rows) == 71.30 and rows["vision"] == rows["language"]     # within 92 % of 79.2 GiB (an H100)
    assert "planned peak 71.3 GiB per rank of 80.0 GiB" in said and "of the 4 colocated layouts that fit" in said
    # the others that fit: experts over ep x etp (the same expert bytes a rank) send rows over etp as well; with cp
    # 2 or 4 in place of dp as many fit again, but cp is weighed only where nothing without it fits
    fitting = [c for c in layout.candidates(cfg, 8) if memory.fits(memory.plan(cfg, c), H100) is None]
    assert sorted((c.lm_tp, c.lm_ep, c.lm_etp) for c in fitting if c.lm_cp == 1) == [(2, 1, 8), (2, 2, 4), (2, 4, 2),
                                                                                    (2, 8, 1)]
    assert len(fitting) == 12 and sorted({c.lm_cp for c in fitting}) == [1, 2, 4]
    assert memory.fits(rows, 79.21 * GIB) is None   # an "80 GB" H100's total_memory
    lay, rows, _ = choose(cfg, 16)
    assert dims(lay) == (True, 2, 8, 2, 8, 16, 1, 1) and peak(rows) == 42.18
    # tp is 1 or 2 only: tp must divide Nano's 2 KV heads; tp 1 needs cp, as its global batch of 8 has 8 lanes at most
    assert sorted({(c.lm_tp, c.lm_cp) for c in layout.candidates(cfg, 16)}) == [(1, 2), (1, 4), (1, 8), (2, 1), (2, 2),
                                                                               (2, 4)]


def test_20l_reference_on_8_ranks_colocated_on_16():
    cfg = config.resolve("20l")
    lay, rows, said = choose(cfg, 8)
    assert dims(lay) == (False, 2, 2, 2, 2, 4, 1, 1) and peak(rows) == 60.41 and "reference layout" in said
    lay, rows, said = choose(cfg, 16)
    assert dims(lay) == (True, 2, 8, 2, 8, 16, 1, 1) and peak(rows) == 27.74 and "fewest bytes" in said


def test_tiny_on_1_2_4_ranks():
    cfg = config.resolve("tiny")
    lay, _, said = choose(cfg, 1)
    assert dims(lay) == (True, 1, 1, 1, 1, 1, 1, 1) and "the only colocated layout that fits" in said
    lay, _, _ = choose(cfg, 2)
    assert dims(lay) == (True, 1, 2, 1, 2, 1, 1, 1)       # colocated dp, as without a capacity
    lay, _, _ = choose(cfg, 4)
    assert dims(lay) == (False, 1, 2, 1, 2, 1, 1, 1)      # the reference layout
    lay, _, _ = choose(cfg, 2, capacity=memory.capacity(torch.device("cpu")), cuda=False)
    assert dims(lay) == (True, 1, 2, 1, 2, 1, 1, 1)


def test_bytes_moved_by_hand():
    """tiny with one attention and one MoE layer (T 96 tokens of D 64, top 2 of 8 experts), stage 2 (the tower is
    frozen: forward only), global batch 8 on 2 ranks."""
    cfg = cli.config_of(["--preset", "tiny", "--hybrid-override-pattern", "*E"])
    T, D = 96, 64
    at = {(c.lm_tp, c.lm_ep, c.lm_etp): c for c in layout.candidates(cfg, 2) if c.lm_cp == 1}
    # tp2 ep2 (dp 1, edp 1: no gradient traffic), 8 micro-batches. A 2-rank all-reduce sends the whole buffer, an
    # all-gather or all-to-all half of it. Per micro-batch:
    tp = (2 * (2 * 1 + 1 * 0.5)      # forward + backward: each layer's all-reduce, the MoE's all-gather of rows
          + 2) * 2 * T * D           # the embedding's and lm_head's all-reduces, of bf16 T x D
    ep = 2 * 2 * 0.5 * 2 * (T * 2 // 2) * D   # forward + backward: dispatch + combine of T k / tp bf16 rows
    vision = 2 * 2 * 1 * 2 * 18 * 32          # 2 blocks x 2 all-reduces, forward only, of S 18 x C 32 bf16
    assert (tp, ep, vision) == (86016, 24576, 4608)
    assert layout.bytes_moved(cfg, at[2, 2, 1]) == 8 * (tp + ep + vision) == 921600
    # tp1 ep1 dp2: no activations move; every trained parameter (language 86720 dense + 32768 expert, projector
    # 128 + 128 x 128 + 64 x 128) reduce-scatters its fp32 gradient and all-gathers its bf16 weight: 6 / 2 bytes
    assert layout.bytes_moved(cfg, at[1, 1, 1]) == 3 * (86720 + 32768 + 24704) == 432576
    plain = dataclasses.replace(cfg, distributed_optimizer=False)     # an fp32 all-reduce: 2 x 4 / 2 bytes
    assert layout.bytes_moved(plain, at[1, 1, 1]) == 4 * (86720 + 32768 + 24704)
    lay = layout.plan(cfg, 2, H100)
    assert (lay.lm_tp, lay.lm_ep, lay.lm_etp) == (1, 1, 1)
    checkpointed = dataclasses.replace(cfg, activation_checkpointing=True)   # one forward more: tp and ep x 3 / 2
    assert layout.bytes_moved(checkpointed, at[2, 2, 1]) == 8 * ((3 * 2.5 + 2) * 2 * T * D + 1.5 * ep + vision)
    # cp2 (dp 1): per micro-batch and attention layer pass a rank's K and V (48 tokens x 2 KV heads of 16, bf16)
    # to the other; the gradients reduce over dp x cp = 2 as at dp2
    (cp2,) = [c for c in layout.candidates(cfg, 2) if (c.lm_cp, c.lm_ep, c.lm_etp) == (2, 1, 1)]
    kv = 2 * (T // 2) * 2 * 2 * 16
    assert layout.bytes_moved(cfg, cp2) == 8 * 2 * kv + 432576 == 530880


def test_none_fits_names_the_fix():
    nano = config.resolve("nano")
    with pytest.raises(SystemExit) as e:
        layout.plan(nano, 4, H100)
    msg = str(e.value)
    assert msg.startswith("no layout of preset nano on 4 ranks fits 80.0 GiB per rank (the closest: colocated layout "
                          "on 4 ranks: vision 4 (tp2 x cp2 x dp1), language 4 (tp2 x cp2 x dp1 x pp1; experts etp1 x "
                          "ep4 x edp1) needs 127.2 GiB per rank at its training peak (weights, gradients, optimizer "
                          "state, activations), over the 92 % of the 80.0 GiB a rank has that it may use). "
                          "8 such ranks would fit, or --lora-rank 8 (trains adapters only) would on these 4"), msg
    assert "\n" not in msg and "--dry-run" in msg
    said = []       # the dry run (strict=False): the same line, and the closest layout to show the plan of
    lay = layout.plan(nano, 4, H100, say=said.append, strict=False)
    assert said == [msg] and dims(lay) == (True, 2, 1, 2, 1, 4, 1, 2)
    layout.plan(dataclasses.replace(nano, lora_rank=8), 4, H100)          # both fixes hold by the same plan
    layout.plan(nano, 8, H100)
    no_ckpt = dataclasses.replace(nano, activation_checkpointing=False)
    with pytest.raises(SystemExit) as e:
        layout.plan(no_ckpt, 8, H100)
    msg = str(e.value)
    assert "on 8 ranks fits 80.0 GiB" in msg and "needs 79.4 GiB per rank" in msg and "tp2 x cp4" in msg, msg
    assert "--activation-checkpointing would fit" in msg and "\n" not in msg, msg


def test_given_layout_that_does_not_fit_is_refused():
    cfg = cli.config_of(["--preset", "nano", "--colocated", "--lm-tp", "2", "--lm-ep", "4"])
    with pytest.raises(SystemExit) as e:
        layout.plan(cfg, 8, H100)
    msg = str(e.value)
    assert msg.startswith("this layout does not fit: colocated layout on 8 ranks") and "needs 98.7 GiB per rank at " \
        "its training peak (weights, gradients, optimizer state, activations), over the 92 % of the 80.0 GiB a rank " \
        "has that it may use. Use more ranks" in msg, msg
    assert dims(layout.plan(cfg, 8, H100, strict=False)) == (True, 2, 4, 2, 4, 4, 1, 1)   # the dry run shows it
    assert dims(layout.plan(cfg, 8)) == (True, 2, 4, 2, 4, 4, 1, 1)                       # no capacity: no check
    ok = cli.config_of(["--preset", "nano", "--colocated", "--lm-tp", "2", "--lm-ep", "8"])
    assert layout.plan(ok, 8, H100) == layout.plan(config.resolve("nano"), 8, H100)


def test_without_capacity_unchanged():
    """No capacity: the reference layout on its world size, else colocated dp (tests/test_parallel.py has more)."""
    assert dims(layout.plan(config.resolve("nano"), 8)) == (True, 1, 8, 1, 8, 1, 1, 1)
    assert dims(layout.plan(config.resolve("20l"), 8)) == (False, 2, 2, 2, 2, 4, 1, 1)
    assert dims(layout.plan(config.resolve("tiny"), 2)) == (True, 1, 2, 1, 2, 1, 1, 1)
    with pytest.raises(SystemExit, match="global_batch 8 is not divisible"):   # nothing valid: the same error
        layout.plan(config.resolve("tiny"), 3, H100)


def test_sizes_that_do_not_divide_name_what_would():
    """tp, ep and etp that do not divide what they split: the nearest sizes that would, the vocabulary's padding."""
    cfg = dataclasses.replace(config.resolve("tiny"), vocab_size=339)
    lay = layout.Layout(world=4, colocated=True, vision_tp=3, vision_dp=1, lm_tp=2, lm_dp=2, lm_ep=3, lm_etp=3,
                        global_batch=2)
    with pytest.raises(SystemExit) as e:
        layout.check_layout(lay, cfg)
    msg = str(e.value)
    for part in ("lm_tp 2 does not divide vocab_size 339 (--vocab-size 340 would pad it); --lm-tp 1 would divide "
                 "every size it splits",
                 "vision_tp 3 does not divide vit_heads 4; vision_tp 3 does not divide vit_mlp 64; --vision-tp 2 or 4 "
                 "would divide every size it splits",
                 "lm_ep 3 does not divide n_routed_experts 8 (--lm-ep 2 or 4 would)",
                 "lm_etp 3 does not divide moe_intermediate_size 32 (--lm-etp 2 or 4 would)"):
        assert part in msg, msg
    assert "\n" not in msg


def test_a_tower_trained_by_any_flag_is_planned_as_training():
    """--train-layers that trains the tower's patch embedder only: the tower runs a backward (it keeps its
    activations and, on vision tp > 1, all-reduces), as under --stage 3; the frozen tower of stage 2 keeps none."""
    cfg = config.resolve("tiny")
    lay = layout.Layout(1, True, 1, 1, 1, 1, global_batch=cfg.global_batch)
    frozen, stage3 = (memory.vision_activation_bytes(dataclasses.replace(cfg, stage=s), lay) for s in (2, 3))
    embedder = dataclasses.replace(cfg, train_layers=r"^vision\.(embedder|mlp1)\.|^language\.")
    assert memory.vision_activation_bytes(embedder, lay) == stage3 > frozen
