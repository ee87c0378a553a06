"""lanes.py (docs/data.md §9): a step's samples by predicted cost over its lanes and micro-batches. The order is a
permutation, the same on every call, even where index order is not; the sizes it weighs are the samples' own;
a loader builds the samples its order puts at the rank's positions; and a step with samples moved by it equals
one process (every layout test of test_train.py and test_real_shaped.py runs with it too).
"""
import importlib.util
import os

import pytest

import config
import data
import lanes
import layout
import mock
from tests.test_train import ONE_STEP, assert_step_matches, run, warm_imports  # noqa: F401 (autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def grid(vision, lm, colocated, micro_batch=1, global_batch=16):
    return layout.Layout(world=lm if colocated else vision + lm, colocated=colocated, vision_tp=1, vision_dp=vision,
                         lm_tp=1, lm_dp=lm, micro_batch=micro_batch, global_batch=global_batch)


# index order puts the four images in the first micro-batch; the language work varies as packed rows do
SKEWED = [(1.0 + (i % 3) / 4, 8.0 if i < 4 else 0.5 * (i % 2)) for i in range(16)]
GRIDS = {"in place 2": grid(2, 2, True), "in place 4 mbs2": grid(4, 4, True, 2), "hetero 2 | 2": grid(2, 2, False),
         "hetero 1 | 2": grid(1, 2, False), "hetero 2 | 4": grid(2, 4, False),
         "hetero 2 | 3 mbs2": grid(2, 3, False, 2, 12), "own lanes 4 | 2 mbs2": grid(4, 2, True, 2)}


@pytest.mark.parametrize("name", list(GRIDS))
def test_the_order_is_a_deterministic_permutation_more_even_than_index_order(name):
    lay = GRIDS[name]
    work = SKEWED[:lay.global_batch]
    order = lanes.assign(lay, work)
    assert sorted(order) == list(range(len(work))) and lanes.assign(lay, list(work)) == order
    today, balanced = lanes.imbalance(lay, work), lanes.imbalance(lay, [work[o] for o in order])
    assert max(balanced) < max(today), (today, balanced)
    if lay.in_place:   # a lane runs both modules: one figure
        assert balanced[0] == balanced[1]


def test_one_sample_a_lane_pairs_the_sorted_costs():
    """Two lanes in place, one sample a lane, four micro-batches: each micro-batch waits for its larger sample, so
    the best order pairs the costs sorted (8 7 | 6 5 | 1 1 | 1 1), from an index order that pairs each large one
    with a small one."""
    lay = grid(2, 2, True, 1, 8)
    work = [(c, 0.0) for c in (1, 8, 1, 6, 7, 1, 5, 1)]
    order = lanes.assign(lay, work)
    assert order == [1, 4, 3, 6, 0, 2, 5, 7]
    assert lanes.imbalance(lay, work) == pytest.approx((26 / 15, 26 / 15))
    assert lanes.imbalance(lay, [work[o] for o in order]) == pytest.approx((16 / 15, 16 / 15))
    assert lanes.imbalance(grid(2, 2, False, 1, 8), work)[0] is None   # no images: no vision figure


def test_sizes_are_the_samples_own(tmp_path):
    """Packed rows of the real-shaped small form: the index's tokens and patches are the built samples'; the mock
    weighs its one image; a loader builds the samples its order places at its positions."""
    spec = importlib.util.spec_from_file_location("real_shaped", os.path.join(ROOT, "bench", "real_shaped.py"))
    rs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rs)
    path = rs.write(str(tmp_path), records=64, seed=0, small=True, processes=1)
    cfg = config.resolve("tiny", {"seq_len": "256", "pack": "true", "overlong": "truncate", "data": path})
    ds, _ = data.build(cfg, data.load_tokenizer(None, cfg), verbose=False)
    p = cfg.vit_patch
    for i in range(8):
        s, (tokens, patches) = ds[i], data.sizes(ds, i)
        assert tokens == len(s.input_ids) - s.n_pad and len(patches) == len(s.images)
        assert sum(patches) == sum(im.shape[1] * im.shape[2] // p ** 2 for im in s.images)
    m = mock.MockData(config.resolve("tiny", {"mock_text_only_frac": "0.5"}), 15)
    assert [data.sizes(m, i) for i in range(4)] == [(96, []), (96, []), (96, [16]), (96, [])]

    lay = grid(2, 2, True, 1, 8)
    order = lanes.Lanes(cfg, ds, lay, 8, True, (0.4, 0.4))
    assert order(2) == order.step(0)[0][2:4] and sorted(order.step(0)[0]) == list(range(8))
    got = data.Loader(ds, [1], 2, order=order).step(0, 4)    # language lane 1 of the four micro-batches
    assert sorted(got) == sorted(order.step(0)[0][1::2])
    assert [g.input_ids.tolist() for _, g in sorted(got.items())] == [ds[i].input_ids.tolist() for i in sorted(got)]


@pytest.mark.slow
def test_a_step_the_order_moves_matches_one_process():
    """Seed 15, half text-only: samples 0-3 are [text, text, image, text]; in place over 2 lanes the order is
    [2, 0, 1, 3] (the image and a text chat share micro-batch 0), and the step equals one process's."""
    argv = ONE_STEP + ["--mock-text-only-frac", "0.5", "--seed", "15"]
    cfg = config.resolve("tiny", {"mock_text_only_frac": "0.5", "seed": "15", "global_batch": "4"})
    lay = grid(2, 2, True, 1, 4)
    assert lanes.Lanes(cfg, mock.MockData(cfg, 15), lay, 4, True, (0.4, 0.4)).step(0)[0] == [2, 0, 1, 3]
    (reference,) = run(argv, 1)
    assert_step_matches(run(argv + ["--colocated", "--lm-dp", "2"], 2), reference, "in place dp2, reordered")
