"""The optimizer (optim.py) on gloo: sharded, the same training as replicated (plain) AdamW in hetero and colocated
layouts with tp / ep (fp32, <= 1e-6 relative); its sharded state resumed into a layout with another dp (the
resharded moments and main weights equal the saved ones exactly; training continues on the straight run's track);
a stage 2 checkpoint in a stage 3 run keeps the projector's moments; the reduction, norm, clipping and inf / nan
consensus against hand-computed gradients (docs/parallel.md §8)."""
import itertools
import math
import types
import zlib

import pytest
import torch
import torch.distributed as dist

import checkpoint
import optim
import train
from comm import mark_shard, shard
from parallel import ModuleGroups, setup
from tests.spawn import run_distributed
from tests.test_parallel import TINY, assert_close as close, colocated, hetero
from tests.test_train import full_state

STAGE3 = ["--preset", "tiny", "--global-batch", "8", "--stage", "3", "--lr", "1e-3", "--lr-schedule", "constant"]
# world, flags, tolerance: with two ranks per dp group a reduce-scatter adds the same two numbers an all-reduce does
# (and the grad norm is fp64), so the run is bit-exact; over dp 4 the order of the four-term sums differs, and AdamW
# amplifies that last-bit difference where gradients are tiny next to eps
LAYOUTS = {
    "hetero v-dp2 + lm-dp2": (4, ["--vision-dp", "2", "--lm-dp", "2"], 0.0),
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
    aliased = [b for b in opt.buckets if b.alias]   # CPU: the one-rank (edp 1) buckets, every replicated one
    views = all(p.untyped_storage().data_ptr() == b.main.untyped_storage().data_ptr()
                for b in aliased for p in b.params)
    return [h["loss"] for h in history], full_state(modules), "sharded" if opt.sharded else "replicated", \
        (len(aliased), views)


def assert_close(got, ref, rel):
    """Every tensor within rel x its largest reference value (rel 0: bit-exact)."""
    for k, t in ref.items():
        err, scale = (got[k] - t).abs().max().item(), t.abs().max().item()
        assert err <= rel * scale, (k, err, scale)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.slow
def test_distributed_equals_plain_adamw(name):
    world, flags, rel = LAYOUTS[name]
    argv = STAGE3 + ["--steps", "3"] + flags
    sharded = run_distributed(_train, world, argv, 2048, timeout=90.0)
    plain = run_distributed(_train, world, argv + ["--no-distributed-optimizer"], timeout=90.0)
    for (loss_s, w_s, kind_s, alias), (loss_p, w_p, kind_p, _) in zip(sharded, plain):
        assert (kind_s, kind_p) == ("sharded", "replicated")
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_stage2_checkpoint_in_a_stage3_run_keeps_its_moments(tmp_path):
    """A stage 2 checkpoint resumed with --stage 3: the projector's saved AdamW state comes back though the tower's
    fresh parameters share its buckets (they are split by age: AdamW counts steps per bucket), sharded and
    replicated alike, and both then train the same (vision dp 2: bit-exact)."""
    save = str(tmp_path / "stage2")
    argv = ["--preset", "tiny", "--global-batch", "4", "--lr", "1e-3", "--lr-schedule", "constant", "--colocated"]
    run_distributed(_train, 2, argv + ["--steps", "2", "--save", save], timeout=90.0)
    r = checkpoint.Reader(save)
    for flags in ([], ["--no-distributed-optimizer"]):
        for state, _ in run_distributed(_gathered_after_load, 2, argv + ["--steps", "2", "--stage", "3", "--load",
                                                                          save] + flags):
            for name, st in state.items():
                if name.startswith("vision.mlp1."):   # trained in stage 2: its state, exactly
                    assert st["step"].item() == 2 and torch.equal(st["exp_avg"], r.read(name, ".exp_avg", "optim"))
                    assert torch.equal(st["exp_avg_sq"], r.read(name, ".exp_avg_sq", "optim")), name
                elif name.startswith("vision."):      # the tower: frozen in stage 2, fresh
                    assert st["step"].item() == 0 and not st["exp_avg"].any(), name
    resumed = [run_distributed(_train, 2, argv + ["--steps", "4", "--stage", "3", "--load", save, "--save",
                                                  str(tmp_path / kind)] + flags, timeout=90.0)
               for kind, flags in (("sharded", []), ("replicated", ["--no-distributed-optimizer"]))]
    for (loss_s, w_s, _, _), (loss_r, w_r, _, _) in zip(*resumed):
        assert loss_s == loss_r and len(loss_s) == 2
        assert_close(w_s, w_r, 0.0)


# ---------------------------------------------------------------- gradients, norm, tokens, consensus (docs/parallel.md §8)

def _full(name, replica, shape):
    """A deterministic 'full' gradient contribution of one data-parallel replica."""
    seed = zlib.crc32(name.encode()) + replica
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _make_params(par, lay):
    """Fake modules whose parameters' local grads are this rank's slice of its replica's full gradient. Returns
    (vision module, lm module, {id(param): expected grad after the dp reduction})."""
    vision, lm, expected = [], [], {}
    specs = []
    if par.in_vision:
        m = par.vision
        specs += [("v_tp", m, (4, 3), [("tp", 0, None)], lay.vision_dp, vision),
                  ("v_rep", m, (5,), [], lay.vision_dp, vision)]
    if par.in_lm:
        m = par.lm
        expert_shards = [("ep", 0, None)] + ([("etp", 1, None)] if lay.lm_etp > 1 else [])
        specs += [("l_tp", m, (4, 2), [("tp", 1, None)], lay.lm_dp, lm),
                  ("l_rep", m, (3,), [], lay.lm_dp, lm),
                  ("l_exp", m, (8, 4), expert_shards, lay.lm_edp, lm),
                  ("l_exp_rep", m, (8,), [("ep", 0, None)], lay.lm_edp, lm)]    # per-expert, replicated over etp
    for name, m, shape, shards, n_rep, params in specs:
        expert = any(s[0] == "ep" for s in shards)
        replica = m.edp_rank if expert else m.dp_rank

        def local(t):
            for kind, dim, _ in shards:
                rank, size = {"tp": (m.tp_rank, m.tp_size), "ep": (m.ep_rank, m.ep_size),
                              "etp": (m.etp_rank, m.etp_size)}[kind]
                t = shard(t, dim, rank, size)
            return t

        total = sum(_full(name, r, shape) for r in range(n_rep))
        p = mark_shard(torch.nn.Parameter(torch.zeros(local(total).shape)), *shards) if shards else \
            torch.nn.Parameter(torch.zeros(shape))
        p.grad = local(_full(name, replica, shape)).clone()
        expected[id(p)] = local(total)
        params.append(p)
    module = lambda ps: torch.nn.ParameterList(ps) if ps else None   # noqa: E731
    return module(vision), module(lm), expected


def _grads(opt):
    """{id(param): its full (this rank's tp / ep slice) gradient as AdamW steps it}, from the optimizer's shards:
    the reduced sums divided by the fused kernel's grad_scale (finish's step 4)."""
    scale = getattr(opt.inner, "grad_scale", None)
    return {k: g if scale is None else g / scale
            for b in opt.buckets for k, g in b.split(b.gather(b.main.grad)).items()}


def _norm(par, opt, grads):
    """The global norm of `grads` ({id(param): reduced gradient}) from each slice's one copy (checkpoint's rule)."""
    groups = {id(p): b.groups for b in opt.buckets for p in b.params}
    local = sum(float(grads[id(p)].double().pow(2).sum()) for p in opt.params() if checkpoint._writes(p, groups[id(p)]))
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t)
    return math.sqrt(t.item())


def _check_grads(rank, world):
    optim.BUCKET_BYTES = 16   # this child only: tiny buckets, several reductions
    out, cpu = [], torch.device("cpu")
    for lay, sharded in itertools.product((hetero(2, 2, 2, 2, ep=2), colocated(2, 4, ep=2, etp=2)), (True, False)):
        par = setup(lay, TINY)
        opt_of = lambda v, m: optim.AdamW(optim.domains(par, v, m), 1e-3, 0.0, cpu, sharded)   # noqa: E731
        vision, lm, expected = _make_params(par, lay)
        opt = opt_of(vision, lm)
        # single-process reference: the norm of the full reduced gradients of both modules, from the seeds alone
        norm2 = sum(sum(_full(n, r, s) for r in range(k)).double().pow(2).sum().item() for n, s, k in
                    (("v_tp", (4, 3), lay.vision_dp), ("v_rep", (5,), lay.vision_dp), ("l_tp", (4, 2), lay.lm_dp),
                     ("l_rep", (3,), lay.lm_dp), ("l_exp", (8, 4), lay.lm_edp), ("l_exp_rep", (8,), lay.lm_edp)))
        norm, ok = opt.finish(1, 0.0)                               # reduce only: no division, no clipping
        for k, g in _grads(opt).items():
            close(g, expected[k])
        assert ok and abs(norm - math.sqrt(norm2)) < 1e-5 * math.sqrt(norm2), (norm, math.sqrt(norm2))

        # token count: each language lane counts once; vision-only ranks pass garbage that must be ignored
        lanes_tokens = {d: 10 + 7 * d for d in range(lay.lm_dp)}
        local = lanes_tokens[par.lm.dp_rank] if par.in_lm else 999
        n_global, = train.global_token_count(par, [local])
        assert n_global == sum(lanes_tokens.values())

        # the whole step: reduce, divide by N_global, norm, clip to half
        vision, lm, expected = _make_params(par, lay)
        opt = opt_of(vision, lm)
        target = 0.5 * math.sqrt(norm2) / n_global
        norm, ok = opt.finish(n_global, max_norm=target)
        assert ok and abs(norm - math.sqrt(norm2) / n_global) < 1e-5 * norm
        grads = _grads(opt)
        for k, g in grads.items():
            close(g, expected[k] / n_global * (target / (norm + 1e-6)))
        clipped = _norm(par, opt, grads)
        assert abs(clipped - target) < 1e-5 * target

        # consensus: an inf on ONE vision rank, in a replicated copy the norm does not count (tp rank 1)
        vision, lm, _ = _make_params(par, lay)
        if par.in_vision and par.vision.tp_rank == 1 and par.vision.dp_rank == 1:
            vision[1].grad[0] = float("inf")
        opt = opt_of(vision, lm)
        norm_inf, ok_inf = opt.finish(n_global, max_norm=1.0)
        assert not ok_inf and math.isnan(norm_inf)
        assert all(p.grad is None for p in opt.params()) and all(b.main.grad is None for b in opt.buckets)
        out.append((norm, clipped, ok, ok_inf, n_global))
    return out


def test_gradients_norm_tokens_consensus():
    results = run_distributed(_check_grads, 8)
    for i in range(4):       # identical on every rank of both grids, sharded and replicated
        assert len({(r[i][0], r[i][1], r[i][2], r[i][3], r[i][4]) for r in results}) == 1, [r[i] for r in results]


def _missing(rank, world):
    used, unused, frozen = (torch.nn.Parameter(torch.ones(3)) for _ in range(3))
    frozen.requires_grad_(False)
    used.grad = torch.full((3,), 2.0)
    one_rank = types.SimpleNamespace(vision=None, lm=ModuleGroups("lm"))   # no dp group: a domain of one
    opt = optim.AdamW(optim.domains(one_rank, None, torch.nn.ParameterList([used, unused, frozen])), 1e-3, 0.0,
                      torch.device("cpu"))
    opt.finish(1, 0.0)
    grads = _grads(opt)
    return grads[id(used)], grads[id(unused)], frozen.grad, len(opt.params())


def test_missing_gradients_become_zeros_without_a_group_too():
    """A parameter no token reached steps like one with a zero gradient on every layout, dp = 1 included."""
    (used, unused, frozen, n), = run_distributed(_missing, 1)
    assert torch.equal(used, torch.full((3,), 2.0)) and torch.equal(unused, torch.zeros(3))
    assert frozen is None and n == 2


def _clipped_step(rank, world):
    g = torch.tensor([3.0, -4.0, 0.5, 12.0]) * 1e-7   # near AdamW's eps (1e-8): the step shows the gradient's scale
    w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4).repeat(2, 1))
    w.grad = torch.stack([g, -g])
    one_rank = types.SimpleNamespace(vision=None, lm=ModuleGroups("lm"))
    opt = optim.AdamW(optim.domains(one_rank, None, torch.nn.ParameterList([w])), 1e-2, 0.1, torch.device("cpu"))
    norm, ok = opt.finish(4, max_norm=1e-7)
    opt.step()
    return norm, ok, w.detach().clone()


def test_step_takes_the_divided_and_clipped_gradients():
    """finish(4, 1e-7) then step() == torch's AdamW given the gradient / 4, clipped to norm 1e-7 by hand (the
    fused kernel applies the factor: nothing multiplies the gradients before it)."""
    (norm, ok, got), = run_distributed(_clipped_step, 1)
    g = torch.tensor([3.0, -4.0, 0.5, 12.0]) * 1e-7
    full = torch.stack([g, -g])
    want_norm = full.norm().item() / 4
    assert ok and abs(norm - want_norm) < 1e-6 * want_norm

    def plain(grad):
        w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4).repeat(2, 1))
        w.grad = grad
        torch.optim.AdamW([w], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False).step()
        return w.detach()

    want = plain(full / 4 * (1e-7 / (want_norm + 1e-6)))
    assert (got - want).abs().max() < 1e-7, (got, want)
    # negative control: without the clipping (x 0.3 here) the step moves the weights elsewhere
    assert (got - plain(full / 4)).abs().max() > 1e-4
