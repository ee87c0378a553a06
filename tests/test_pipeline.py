"""Pipeline parallelism of the language model (--lm-pp; docs/pipeline.md) on gloo: the stage split, and training
and evaluation in every layout equal to one process (losses, reduced gradients, updated weights; fp32), composed
with tp, ep, cp, MTP and LoRA. Checkpoints and signals across pp sizes: tests/test_checkpoint.py, test_stop.py.
"""
import contextlib
import io

import pytest

import config
import model
import train
from tests.spawn import run_distributed
from tests.test_super import MTP
from tests.test_train import ONE_STEP, _train, assert_step_matches, run


def test_the_stages_split_the_layers_by_their_flops():
    """Contiguous ranges covering every layer once, at least one a stage; the slowest stage (the last with the head)
    as light as any split makes it: checked against every split by brute force."""
    import itertools
    for preset, pp in (("tiny", 2), ("tiny", 4), ("tiny", 8), ("20l", 2), ("20l", 4)):
        cfg = config.resolve(preset)
        stages = model.stage_layers(cfg, pp)
        n = len(cfg.hybrid_override_pattern)
        assert [i for r in stages for i in r] == list(range(n)) and all(len(r) for r in stages), (preset, pp)
        layers, head = model.layer_flops_per_token(cfg, cfg.seq_len)

        def slowest(bounds):
            return max(sum(layers[a:b]) + head * (b == n) for a, b in zip(bounds, bounds[1:]))
        best = min(slowest((0, *cuts, n)) for cuts in itertools.combinations(range(1, n), pp - 1))
        assert slowest([r.start for r in stages] + [n]) == best, (preset, pp)
    assert [(r.start, r.stop) for r in model.stage_layers(config.resolve("20l"), 2)] == [(0, 13), (13, 20)]


def test_a_stage_holds_its_layers_under_their_global_names():
    cfg = config.resolve("tiny", {"num_nextn_predict_layers": 1})
    names = [{n.split(".weight")[0] for n, _ in model.LanguageModel(cfg, stage=(s, 2)).named_parameters()}
             for s in range(2)]
    whole = {n.split(".weight")[0] for n, _ in model.LanguageModel(cfg).named_parameters()}
    assert names[0] | names[1] == whole and not names[0] & names[1]
    assert "backbone.embeddings" in names[0] and "lm_head" in names[1] and any(n.startswith("mtp.") for n in names[1])
    # MTP's block and head run on the last stage: it takes two of the eight layers
    assert {n.split(".")[2] for n in names[1] if n.startswith("backbone.layers.")} == {"6", "7"}


LAYOUTS = {  # name: (world, grid flags); the loss is known on the last stage's lanes: one each here but dp2
    "hetero pp2": (3, ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"]),
    "hetero pp4": (5, ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "4"]),
    "hetero v-dp2 + pp2 dp2": (6, ["--vision-dp", "2", "--lm-dp", "2", "--lm-pp", "2"]),
    "colocated pp2": (2, ["--colocated", "--lm-pp", "2", "--vision-tp", "1", "--micro-batch", "2"]),
    "colocated pp4": (4, ["--colocated", "--lm-pp", "4", "--vision-tp", "1", "--micro-batch", "4"]),
    "hetero pp2 tp2": (5, ["--vision-dp", "1", "--lm-dp", "1", "--lm-tp", "2", "--lm-pp", "2"]),
    "colocated pp2 dp2 ep2": (4, ["--colocated", "--lm-pp", "2", "--lm-ep", "2", "--vision-tp", "1",
                                  "--micro-batch", "2"]),
    "hetero pp2 cp2": (5, ["--vision-dp", "1", "--lm-dp", "1", "--lm-cp", "2", "--lm-pp", "2"]),
}


@pytest.fixture(scope="module")
def reference():
    return run(ONE_STEP, 1)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.slow
def test_one_step_matches_one_process(name, reference):
    world, flags = LAYOUTS[name]
    results = run_distributed(_train, world, ONE_STEP + flags, timeout=120.0)
    lanes = 2 if "dp2" in name else 1
    cp = 2 if "cp2" in name else 1
    tp = 2 if "tp2" in name else 1
    assert sum(h[0]["loss"] is not None for h, _, _ in results) == lanes * cp * tp   # the last stage's ranks
    assert_step_matches(results, reference, name)


@pytest.mark.slow
def test_five_steps_and_an_evaluation_match_one_process():
    """Five steps (losses, grad norms, weights) and the evaluation after them: the numbers of one process."""
    argv = ["--preset", "tiny", "--steps", "5", "--global-batch", "8", "--lr", "3e-3", "--lr-schedule", "constant",
            "--eval-every", "5", "--eval-samples", "6"]
    (one,) = run_distributed(_history, 1, argv)
    for world, flags in ((3, ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"]),
                         (4, ["--colocated", "--lm-pp", "2", "--lm-dp", "2", "--vision-tp", "1",
                              "--micro-batch", "2"])):
        for hist, evals in run_distributed(_history, world, argv + flags, timeout=120.0):
            assert [h["grad_norm"] for h in hist] == pytest.approx([h["grad_norm"] for h in one[0]], rel=1e-5)
            if hist[0]["loss"] is not None:
                assert [h["loss"] for h in hist] == pytest.approx([h["loss"] for h in one[0]], abs=1e-5)
                assert evals == pytest.approx(one[1], abs=1e-5), flags
            else:
                assert evals == [None]


def _history(rank, world, argv):
    """(history, [eval losses]) of train.main, the evaluations read from the step lines' printout."""
    evals = []
    real = train.evaluate

    def spy(run, stop, first=False):
        out = real(run, stop, first)
        evals.append(out["eval_loss"])
        return out
    train.evaluate = spy   # this forked child only
    try:
        return train.main(list(argv))[0], evals
    finally:
        train.evaluate = real


@pytest.mark.parametrize("world,flags", [(3, ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"]),
                                         (4, ["--colocated", "--lm-pp", "2", "--lm-dp", "2", "--vision-tp", "1",
                                              "--micro-batch", "2"])],
                         ids=["hetero-pp2", "colocated-pp2-dp2"])
@pytest.mark.slow
def test_mtp_at_pp2_equals_one_process(world, flags):
    """Two MTP depths on the last stage, reading the decoder input the first stage sends beside the residual
    stream: losses, MTP losses and weights after three steps equal one process (tests/test_super.py's case)."""
    from tests.test_super import _train as mtp_train
    (one,) = run_distributed(mtp_train, 1, MTP)
    many = run_distributed(mtp_train, world, MTP + flags, timeout=120.0)
    ref_hist, ref_w, _ = one
    assert sum(hist[0]["loss"] is not None for hist, _, _ in many) == world - 2   # the last stage's lanes
    for hist, weights, _ in many:
        for a, b in zip(hist, ref_hist):
            if a["loss"] is not None:
                assert abs(a["loss"] - b["loss"]) < 1e-5 * b["loss"]
                assert all(abs(x - y) < 1e-5 * y for x, y in zip(a["mtp_loss"], b["mtp_loss"]))
        for k, v in weights.items():
            assert (v - ref_w[k]).abs().max() < 1e-5, k


@pytest.mark.slow
def test_lora_at_pp2_equals_one_process():
    from tests.test_lora import LORA
    one = LORA + ["--steps", "1", "--lr", "3e-4"]
    (ref,) = run(one, 1)
    results = run_distributed(_train, 3, one + ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"], timeout=90.0)
    assert_step_matches(results, ref, "lora pp2")


def _step_lines(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(list(argv))
    return sum(line.startswith("step ") for line in out.getvalue().splitlines())


def test_the_last_stage_prints_the_step_lines():
    argv = ONE_STEP + ["--steps", "2", "--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "2"]
    assert run_distributed(_step_lines, 3, argv) == [0, 0, 2]


def _train_in_little_memory(rank, world, argv, capacity):
    import memory
    memory.capacity = lambda device: capacity   # this forked child only
    return _train(rank, world, argv)


@pytest.mark.slow
def test_a_stage_short_of_memory_gives_layers_to_its_neighbour(reference):
    """Four stages of tiny on a rank memory the compute split does not fit (its first stage keeps four
    micro-batches): chooser.fit_split moves the first stage's second layer on, and the step still equals one
    process."""
    import cli
    import chooser
    import layout
    import memory
    argv = ONE_STEP + ["--vision-dp", "1", "--lm-dp", "1", "--lm-pp", "4"]
    lay = layout.plan(cli.config_of(argv), 5)
    assert lay.lm_split == () and model.stage_layers(config.resolve("tiny"), 4)[0] == range(0, 2)
    capacity = 3.0e6   # bytes: the compute split's first stage plans 3.26 MB with the share the peak may use
    assert memory.fits(memory.plan(cli.config_of(argv), lay, cuda=False), capacity) is not None
    moved = chooser.plan(cli.config_of(argv), 5, capacity, cuda=False)
    assert moved.lm_split == (1, 4, 6) and "pp4 from layers 0, 1, 4, 6" in moved.describe()
    results = run_distributed(_train_in_little_memory, 5, argv, capacity, timeout=120.0)
    held = [{k.split(".")[3] for k in state if k.startswith("language.backbone.layers.")} for _, state, _ in results]
    assert held[1:] == [{"0"}, {"1", "2", "3"}, {"4", "5"}, {"6", "7"}], held   # ranks 1-4: stages 0-3
    assert_step_matches(results, reference, "pp4, layers moved")
