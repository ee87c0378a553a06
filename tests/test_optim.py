"""The distributed optimizer (optim.py) on gloo: the same training as plain AdamW in hetero and colocated layouts
with tp / ep (fp32, <= 1e-6 relative), its sharded state resumed into a layout with another dp (the resharded
moments and main weights equal the saved ones exactly; training continues on the straight run's track)."""
import pytest
import torch

import checkpoint
import optim
import train
from tests.spawn import run_distributed
from tests.test_train import full_state

STAGE3 = ["--preset", "tiny", "--global-batch", "8", "--stage", "3", "--lr", "1e-3", "--lr-schedule", "constant"]
# world, flags, tolerance: with two ranks per dp group a reduce-scatter adds the same two numbers an all-reduce does
# (and the grad norm is fp64), so the run is bit-exact; over dp 4 the order of the four-term sums differs, and AdamW
# amplifies that last-bit difference where gradients are tiny next to eps
LAYOUTS = {
    "hetero v-dp2 + lm-dp2": (4, [], 0.0),
    "colocated tp2 dp2 ep4 edp1": (4, ["--colocated", "--lm-tp", "2", "--lm-ep", "4"], 0.0),
    "colocated dp4 ep2 edp2": (4, ["--colocated", "--lm-ep", "2"], 1e-5),
}


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def _train(rank, world, argv, bucket_bytes=None):
    """train.main -> (losses, full weights, the optimizer built, as its class name)."""
    if bucket_bytes:
        optim.BUCKET_BYTES = bucket_bytes   # this forked child only: many buckets, most of them padded
    built = []
    real = optim.build
    optim.build = lambda *a, **k: built.append(real(*a, **k)) or built[-1]
    try:
        history, modules = train.main(list(argv))
    finally:
        optim.build = real
    opt = built[0]
    aliased = [b for b in getattr(opt, "buckets", []) if b.alias]   # CPU: the one-rank (edp 1) buckets
    views = all(p.untyped_storage().data_ptr() == b.main.untyped_storage().data_ptr()
                for b in aliased for p in b.params)
    return [h["loss"] for h in history], full_state(modules), type(opt).__name__, (len(aliased), views)


def assert_close(got, ref, rel):
    """Every tensor within rel x its largest reference value (rel 0: bit-exact)."""
    for k, t in ref.items():
        err, scale = (got[k] - t).abs().max().item(), t.abs().max().item()
        assert err <= rel * scale, (k, err, scale)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_distributed_equals_plain_adamw(name):
    world, flags, rel = LAYOUTS[name]
    argv = STAGE3 + ["--steps", "3"] + flags
    sharded = run_distributed(_train, world, argv, 2048, timeout=90.0)
    plain = run_distributed(_train, world, argv + ["--no-distributed-optimizer"], timeout=90.0)
    for (loss_s, w_s, kind_s, alias), (loss_p, w_p, kind_p, _) in zip(sharded, plain):
        assert (kind_s, kind_p) == ("DistributedAdamW", "AdamW")
        # experts at edp 1 train as views of their fp32 main weights (optim.fp32_weights), the rest from copies
        assert alias[1] and (alias[0] > 0) == (name == "colocated tp2 dp2 ep4 edp1"), alias
        for a, b in zip(loss_s, loss_p):
            assert (a is None and b is None) or abs(a - b) <= 1e-6 * rel * abs(b), (loss_s, loss_p)
        assert sorted(w_s) == sorted(w_p)
        assert_close(w_s, w_p, rel)
    first, last = sharded[-1][0][0], sharded[-1][0][-1]
    assert last < first - 1e-3, (first, last)   # it trains


def _gathered_after_load(rank, world, argv):
    """Load (no step left to run), then the optimizer's state gathered from its shards under this layout."""
    built = []
    real = optim.build
    optim.build = lambda *a, **k: built.append(real(*a, **k)) or built[-1]
    try:
        _, modules = train.main(list(argv))
    finally:
        optim.build = real
    opt = built[0]
    names = {id(p): f"{k}.{n}" for k, m in modules.items() for n, p in m.named_parameters()}
    return {names[i]: s for i, s in opt.gather_state().items()}, \
        {names[id(p)]: getattr(p, "shards", ()) for p in opt.params()}


def test_resume_into_another_dp(tmp_path):
    """Saved under tp2 dp2 ep2 edp2 after 2 steps, resumed under tp1 dp4 ep2 edp2."""
    save = str(tmp_path / "ckpt")
    tp2 = STAGE3 + ["--colocated", "--lm-tp", "2", "--lm-ep", "2"]
    dp4 = STAGE3 + ["--colocated", "--lm-ep", "2"]
    straight = run_distributed(_train, 4, tp2 + ["--steps", "4"], timeout=90.0)
    run_distributed(_train, 4, tp2 + ["--steps", "2", "--save", save], timeout=90.0)

    # the sharded moments and fp32 main weights under dp4 are exactly the saved ones (this rank's tp / ep slice)
    r = checkpoint.Reader(save)
    for rank, (state, shards) in enumerate(run_distributed(_gathered_after_load, 4, dp4 + ["--steps", "2",
                                                                                         "--load", save])):
        assert sorted(state) == sorted(n for n, s in r.tensors.items() if s["optim"])   # stage 3: all but buffers
        ep_rank = rank % 2                     # colocated ep2 on 4 ranks: ep is the fastest expert dim
        for name, s in state.items():
            coords, sizes = {"tp": 0, "ep": ep_rank, "etp": 0}, {"tp": 1, "ep": 2, "etp": 1}
            where = dict(shards=shards[name], coords=coords, sizes=sizes)
            assert torch.equal(s["main"], r.read(name, **where)), name
            assert torch.equal(s["exp_avg"], r.read(name, ".exp_avg", kind="optim", **where)), name
            assert torch.equal(s["exp_avg_sq"], r.read(name, ".exp_avg_sq", kind="optim", **where)), name
            assert s["step"].item() == 2

    resumed = run_distributed(_train, 4, dp4 + ["--steps", "4", "--load", save], timeout=90.0)
    for rank in range(4):
        losses, weights, _, _ = resumed[rank]
        ref_losses, ref_weights, _, _ = straight[0]
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(losses, ref_losses[2:])), (losses, ref_losses)
        assert_close(weights, ref_weights, rel=1e-5)
