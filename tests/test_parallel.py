"""The rules of docs/parallel.md for layout.py, parallel.py and bridge.py: pure enumeration tests first, then gloo
multi-process tests."""
import dataclasses
import itertools
import math

import pytest
import torch
import torch.distributed as dist

import config
import layout
from bridge import Bridge, bridge_links
from layout import Layout, check_layout
from parallel import Grid, expert_grid, lane_samples, lanes, lm_grid, setup, vision_grid
from tests.spawn import run_distributed

BIG = config.Config()                       # 32 heads, 8 KV heads, 64 Mamba heads, 8 groups, 128 experts
TINY = config.resolve("tiny")               # 4 heads, 2 KV heads, 8 Mamba heads, 2 groups, 8 experts


def group_of(grid, dims, rank):
    """The group of `grid` spanning `dims` that holds `rank`."""
    return next(g for g in grid.groups(dims) if rank in g)


def rank_samples(lay, rank):
    """{"vision": range | None, "lm": range | None}: the samples `rank` handles on each side of the bridge."""
    out = {"vision": None, "lm": None}
    for side, grid in (("vision", vision_grid(lay)), ("lm", lm_grid(lay))):
        if rank in grid:
            out[side] = lane_samples(lay, side, grid.coords(rank)["dp"])
    return out


def assert_close(a, b):
    """torch.testing.assert_close imports torch.distributed.tensor: seconds in every child process."""
    assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a, b)


def hetero(vtp, vdp, ltp, ldp, ep=1, etp=1, mbs=1, gb=None):
    world = vtp * vdp + ltp * ldp
    return Layout(world, False, vtp, vdp, ltp, ldp, ep, etp, mbs, gb or mbs * ldp * 3)


def colocated(tp, dp, ep=1, etp=1, mbs=1):
    return Layout(tp * dp, True, tp, dp, tp, dp, ep, etp, mbs, mbs * dp * 3)


# ---------------------------------------------------------------- reference: Megatron's RankGenerator (docs/parallel.md §2)

def rank_generator(order, sizes, mask, offset=0):
    """generate_masked_orthogonal_rank_groups as the spec describes it: prefix-product strides over `order`
    (fastest first); masked dims decomposed fastest-first inside a group, the others fastest-first across groups."""
    strides = [math.prod(sizes[d] for d in order[:i]) for i in range(len(order))]
    inner = [i for i, d in enumerate(order) if d in mask]
    outer = [i for i, d in enumerate(order) if d not in mask]

    def decompose(dims):  # all index tuples, the first of `dims` varying fastest
        for idx in itertools.product(*[range(sizes[order[i]]) for i in reversed(dims)]):
            yield dict(zip(reversed(dims), idx))

    return [[offset + sum(strides[i] * v for i, v in {**o, **n}.items()) for n in decompose(inner)]
            for o in decompose(outer)]


def dense_generator(lay_tp, cp, dp, pp, offset, dims):
    sizes = dict(tp=lay_tp, cp=cp, ep=1, dp=dp, pp=pp)
    return rank_generator(["tp", "cp", "ep", "dp", "pp"], sizes, set(dims.split("-")), offset)


def expert_generator(etp, ep, edp, pp, offset, dims):
    names = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"}
    sizes = dict(tp=etp, cp=1, ep=ep, dp=edp, pp=pp)
    return rank_generator(["tp", "cp", "ep", "dp", "pp"], sizes, {names[d] for d in dims.split("-")}, offset)


# ---------------------------------------------------------------- worked examples (docs/parallel.md §2-4)

def test_worked_example_a():
    base = Grid({"tp": 2, "cp": 1, "dp": 2, "pp": 2})
    expert = Grid({"etp": 1, "ep": 2, "edp": 2, "pp": 2})
    assert base.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert base.groups("dp") == base.groups("dp-cp") == expert.groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert base.groups("pp") == expert.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert base.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert base.groups("tp-dp") == base.groups("tp-dp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert expert.groups("etp") == [[r] for r in range(8)]
    assert expert.groups("ep") == expert.groups("etp-ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert.groups("etp-ep-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_worked_example_b():
    lay = Layout(72, False, 1, 8, 2, 32, lm_ep=16, lm_etp=1, micro_batch=1, global_batch=32)
    check_layout(lay, BIG)
    v, lm, ex = vision_grid(lay), lm_grid(lay), expert_grid(lay)
    assert v.groups("tp") == [[r] for r in range(8)] and v.groups("dp") == [list(range(8))]
    assert lm.groups("tp") == [[r, r + 1] for r in range(8, 72, 2)]
    assert lm.groups("dp") == [list(range(8, 72, 2)), list(range(9, 72, 2))]
    assert ex.groups("ep") == [list(range(a, a + 16)) for a in (8, 24, 40, 56)]
    assert ex.groups("edp")[:2] == [[8, 24, 40, 56], [9, 25, 41, 57]] and len(ex.groups("edp")) == 16
    assert ex.groups("etp") == [[r] for r in range(8, 72)]
    ex2 = expert_grid(dataclasses.replace(lay, lm_etp=2))
    assert group_of(ex2, "ep", 8) == list(range(8, 40, 2))
    assert group_of(ex2, "etp", 8) == [8, 9] and group_of(ex2, "edp", 8) == [8, 40]
    for etp, grid in ((1, ex), (2, ex2)):   # both equal RankGenerator(tp=etp, ep=16, dp=edp, rank_offset=8)
        for dims in ("ep", "etp", "edp", "etp-ep", "etp-ep-pp"):
            assert grid.groups(dims) == expert_generator(etp, 16, 64 // (16 * etp), 1, 8, dims), dims
    # bridge (docs/parallel.md §6): encoder e feeds language leaders 8 + 2*(4e .. 4e+3)
    links = bridge_links(lay)
    assert [ln.src_leader for ln in links if ln.dst_leader in (8, 10, 12, 14)] == [0, 0, 0, 0]
    assert [ln.dst_leader for ln in links if ln.src_leader == 7] == [64, 66, 68, 70]
    assert [ln.dst_leader for ln in links if ln.src_leader == 1] == [16, 18, 20, 22]


def test_worked_example_c():
    lay = Layout(8, True, 1, 8, 2, 4, micro_batch=1, global_batch=4)
    assert vision_grid(lay).groups("dp") == [list(range(8))]
    assert lm_grid(lay).groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lm_grid(lay).groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert not lay.in_place and lay.vision_cp == 1      # each module its own lanes on the shared ranks
    with pytest.raises(SystemExit, match="4 samples per microbatch do not split evenly over vision dp 8"):
        check_layout(lay, BIG)
    lay = dataclasses.replace(lay, micro_batch=2, global_batch=8)
    check_layout(lay, BIG)   # the bridge moves rank e's rows to the leader of language lane e // 2, itself or not
    assert [(ln.src_leader, ln.dst_leader) for ln in bridge_links(lay)] == [(e, e // 2 * 2) for e in range(8)]


def test_canonical_order():
    g = Grid({"a": 2, "b": 2, "c": 2})
    assert g.groups(["a", "b"]) == g.groups(["b", "a"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    base = Grid({"tp": 2, "cp": 1, "dp": 3, "pp": 1})
    assert base.groups("tp-dp") == base.groups("dp-tp") == base.groups(["dp", "tp"])
    with pytest.raises(ValueError, match="'ep' is not a dim"):
        base.groups("ep")


def test_leaders_match_upstream_table():
    """Lanes and leaders, docs/parallel.md §6 (upstream grid order tp, cp, pp, dp), and the first row under this project's order."""
    for tp, pp, dp, src, dst, src_b, dst_b in [
            (2, 2, 2, [3, 7], [0, 4], [[2, 3], [6, 7]], [[0, 1], [4, 5]]),
            (4, 2, 1, [7], [0], [[4, 5, 6, 7]], [[0, 1, 2, 3]]),
            (1, 2, 4, [1, 3, 5, 7], [0, 2, 4, 6], [[1], [3], [5], [7]], [[0], [2], [4], [6]]),
            (2, 4, 1, [7], [0], [[6, 7]], [[0, 1]])]:
        g = Grid({"tp": tp, "cp": 1, "pp": pp, "dp": dp})
        assert [lane[-1] for lane in lanes(g)] == src and [lane[0] for lane in lanes(g)] == dst
        last, first = g.ranks.shape[1] - 1, 0     # boundary broadcast groups: tp-cp of the last / first pp stage
        assert [grp for grp in g.groups("tp-cp") if g.coords(grp[0])["pp"] == last] == src_b
        assert [grp for grp in g.groups("tp-cp") if g.coords(grp[0])["pp"] == first] == dst_b
    g = Grid({"tp": 2, "cp": 1, "dp": 2, "pp": 2})
    assert [lane[-1] for lane in lanes(g)] == [5, 7] and [lane[0] for lane in lanes(g)] == [0, 2]


# ---------------------------------------------------------------- grid invariants (docs/parallel.md §2-4)

LAYOUTS = [hetero(1, 8, 2, 32, ep=16), hetero(1, 8, 2, 32, ep=16, etp=2), hetero(2, 2, 2, 2, ep=2),
           hetero(1, 4, 2, 2, ep=4, mbs=2), colocated(2, 4, ep=2, etp=2), colocated(1, 4, ep=4)]


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.describe())
def test_grid_invariants(lay):
    check_layout(lay, BIG)
    v, lm, ex = vision_grid(lay), lm_grid(lay), expert_grid(lay)
    spans = [set(range(g.offset, g.offset + g.size)) for g in (v, lm)]
    if lay.colocated:   # tiling: identical spans, or disjoint spans covering the world
        assert spans[0] == spans[1] == set(range(lay.world))
    else:
        assert not spans[0] & spans[1] and spans[0] | spans[1] == set(range(lay.world))
    for grid, span in ((v, spans[0]), (lm, spans[1]), (ex, spans[1])):
        for n in range(1, len(grid.names) + 1):
            for dims in itertools.combinations(grid.names, n):
                groups = grid.groups(dims)
                size = math.prod(grid.shape[grid.names.index(d)] for d in dims)
                flat = [r for g in groups for r in g]
                assert all(len(g) == size for g in groups)               # partition: sizes
                assert sorted(flat) == sorted(span)                     # disjoint, covering exactly the span
                for r in span:                                          # coordinate consistency
                    c = grid.coords(r)
                    mine = group_of(grid, dims, r)
                    assert set(mine) == {q for q in span
                                         if all(grid.coords(q)[d] == c[d] for d in grid.names if d not in dims)}
                    coords = [tuple(grid.coords(q)[d] for d in reversed(dims)) for q in mine]
                    assert coords == sorted(coords)                     # earliest dim fastest, in order
    # Megatron equivalence (offset included) for the dense and expert generators
    for dims in ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp-cp"):
        assert lm.groups(dims) == dense_generator(lay.lm_tp, 1, lay.lm_dp, 1, lay.lm_offset, dims), dims
    for dims in ("etp", "ep", "edp", "etp-ep", "etp-ep-pp"):
        assert ex.groups(dims) == expert_generator(lay.lm_etp, lay.lm_ep, lay.lm_edp, 1, lay.lm_offset, dims)
    # expert view consistency
    assert ex.groups("pp") == lm.groups("pp") and ex.size == lm.size
    assert lay.lm_etp * lay.lm_ep * lay.lm_edp == lay.lm_tp * lay.lm_cp * lay.lm_dp
    for g in ex.groups("ep"):   # each ep group lies in one tp-cp-dp slice of a single pp stage
        assert any(set(g) <= set(s) for s in lm.groups("tp-cp-dp"))
    for r in spans[1]:          # tp_ep_pp x edp partitions the grid
        assert len(group_of(ex, "etp-ep-pp", r)) * len(group_of(ex, "edp", r)) == lm.size
        assert set(group_of(ex, "etp-ep-pp", r)) & set(group_of(ex, "edp", r)) == {r}


# ---------------------------------------------------------------- comm map (docs/parallel.md §6) and sample ownership

@pytest.mark.parametrize("lay", [hetero(1, 8, 2, 32), hetero(2, 1, 2, 2, mbs=2), hetero(1, 4, 2, 2, mbs=2),
                                 hetero(2, 2, 1, 2), hetero(1, 4, 4, 1, mbs=4), hetero(2, 2, 2, 1, mbs=2)],
                         ids=lambda lay: lay.describe())
def test_comm_map_balance(lay):
    check_layout(lay, BIG)
    links = bridge_links(lay)
    S, D = lay.vision_dp, lay.lm_dp
    src_leaders = [lane[-1] for lane in lanes(vision_grid(lay))]
    dst_leaders = [lane[0] for lane in lanes(lm_grid(lay))]
    assert {ln.src_leader for ln in links} == set(src_leaders) and {ln.dst_leader for ln in links} == set(dst_leaders)
    assert len(links) == max(S, D)                                   # every pair link is used exactly once
    for j in range(D):
        srcs = [ln.src_lane for ln in links if ln.dst_lane == j]
        if S <= D:
            assert srcs == [j // (D // S)]                           # fan-out: one source, floor(j/k)
        else:
            assert srcs == list(range(j * (S // D), (j + 1) * (S // D)))   # fan-in: contiguous block, lane order
        # samples delivered to lane j are exactly its own, in order
        assert [i for ln in links if ln.dst_lane == j for i in ln.samples] == list(lane_samples(lay, "lm", j))
    for e in range(S):
        assert [i for ln in links if ln.src_lane == e for i in ln.samples] == list(lane_samples(lay, "vision", e))
    # roles: leaders are sender/receiver, everybody else a member
    vision_members = set(range(lay.vision_size)) - set(src_leaders)
    assert not vision_members & {ln.src_leader for ln in links}
    # every rank's sample ownership
    for r in range(lay.world):
        own = rank_samples(lay, r)
        side = "vision" if r < lay.vision_size else "lm"
        assert own[{"vision": "lm", "lm": "vision"}[side]] is None
        assert len(own[side]) == (lay.vision_micro_batch if side == "vision" else lay.micro_batch)
    assert lay.vision_micro_batch * S == lay.micro_batch * D


# ---------------------------------------------------------------- validation (docs/parallel.md §1) and layout choice

def test_validation_messages():
    with pytest.raises(SystemExit) as e:
        check_layout(Layout(64, False, 1, 8, 2, 32, micro_batch=1, global_batch=32), BIG)
    assert "hetero layout: vision 8 (tp1 x dp8) + language 64 (tp2 x cp1 x dp32 x pp1) = 72 != WORLD_SIZE 64" \
        in str(e.value)
    cases = [
        (hetero(1, 2, 3, 1), TINY, "lm_tp 3 does not divide num_attention_heads 4"),
        (hetero(1, 2, 3, 1), TINY, "lm_tp 3 does not divide vocab_size 512"),
        (hetero(1, 2, 4, 1), TINY, "lm_tp 4 does not divide num_key_value_heads 2"),
        (hetero(3, 1, 1, 1), TINY, "vision_tp 3 does not divide vit_heads 4"),
        (hetero(1, 2, 1, 3, ep=3), TINY, "lm_ep 3 does not divide n_routed_experts 8"),
        (hetero(1, 1, 2, 1, ep=4), TINY, "is not divisible by etp1 x ep4 x pp1 = 4"),
        (hetero(1, 3, 1, 2), TINY, "micro_batch 1 x language dp 2 = 2 samples per microbatch do not split evenly "
         "over vision dp 3 (--micro-batch 3 would)"),
        (hetero(1, 4, 1, 2), TINY, "micro_batch 1 x language dp 2 = 2 samples per microbatch do not split evenly"),
        (hetero(1, 2, 1, 2, mbs=2, gb=6), TINY, "global_batch 6 is not divisible by micro_batch 2 x language dp 2"),
        (Layout(4, True, 1, 2, 2, 2, micro_batch=1, global_batch=2), TINY,
         "colocated layout: vision 2 (tp1 x dp2) and language 4 (tp2 x cp1 x dp2 x pp1) must both equal WORLD_SIZE 4"),
        (Layout(4, True, 1, 2, 1, 2, micro_batch=1, global_batch=2), TINY,
         "colocated layout: vision 2 (tp1 x dp2) and language 2 (tp1 x cp1 x dp2 x pp1) must both equal WORLD_SIZE 4"),
        (dataclasses.replace(hetero(1, 1, 1, 1), lm_pp=9, world=10), TINY,
         "language pp9: more stages than the model's 8 layers (--lm-pp 8 at most)"),
        (dataclasses.replace(hetero(1, 1, 1, 1), lm_cp=5, world=6), TINY,
         "seq_len 96 is not divisible by 2 x lm_cp = 10: context parallelism cuts each row into 2 x cp equal chunks "
         "(--seq-len 90 would do)"),
        (dataclasses.replace(hetero(1, 1, 1, 1), lm_cp=4, world=5), TINY,
         "lm_tp x lm_cp = 4 does not divide n_groups 2: Mamba layers scan 1 / (tp x cp) of them a rank (--lm-cp 2 "
         "would do)"),
        (dataclasses.replace(hetero(1, 1, 4, 1), lm_cp=3, world=13), dataclasses.replace(TINY, seq_len=18),
         "micro_batch x seq_len / lm_cp = 6 tokens per rank are not divisible by lm_tp 4"),
        (Layout(4, False, 0, 2, 1, 2, micro_batch=1, global_batch=2), TINY, "sizes must be positive integers"),
    ]
    for lay, cfg, msg in cases:
        with pytest.raises(SystemExit) as e:
            check_layout(lay, cfg)
        assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(SystemExit) as e:   # several problems, one message
        check_layout(Layout(9, False, 3, 1, 3, 2, lm_ep=3, micro_batch=1, global_batch=3), TINY)
    msg = str(e.value)
    assert "= 9 != WORLD_SIZE" not in msg and msg.count(";") >= 4, msg
    assert check_layout(hetero(2, 2, 2, 2, ep=2), TINY).lm_edp == 2


def plan_layout(cfg, world, micro_batch, global_batch, **flags):
    return layout.plan(dataclasses.replace(cfg, micro_batch=micro_batch, global_batch=global_batch, **flags), world)


def test_plan_layout(monkeypatch):
    ref = dataclasses.replace(BIG, preset="20l")
    monkeypatch.setitem(config.REFERENCE_LAYOUTS, "20l", (8, dict(vision_tp=1, vision_dp=4, lm_tp=2, lm_dp=2, lm_ep=4,
                                                                   lm_etp=1, colocated=False)))
    lay = plan_layout(ref, 8, 2, 4)                                          # the preset's reference layout
    assert (lay.colocated, lay.vision_tp, lay.vision_dp, lay.lm_tp, lay.lm_dp, lay.lm_ep, lay.lm_edp) == \
        (False, 1, 4, 2, 2, 4, 1)
    lay = plan_layout(ref, 4, 1, 8)                                          # other world: colocated dp
    assert (lay.colocated, lay.vision_tp, lay.vision_dp, lay.lm_tp, lay.lm_dp, lay.lm_ep) == (True, 1, 4, 1, 4, 1)
    lay = plan_layout(ref, 8, 1, 4, lm_tp=2, lm_ep=2)                        # flags replace the reference
    assert (lay.colocated, lay.vision_tp, lay.vision_dp, lay.lm_tp, lay.lm_dp, lay.lm_edp) == (True, 2, 4, 2, 4, 4)
    lay = plan_layout(ref, 6, 2, 8, vision_dp=2, lm_tp=2)                    # hetero, lm dp from the remainder
    assert (lay.colocated, lay.vision_size, lay.lm_tp, lay.lm_dp, lay.num_microbatches) == (False, 2, 2, 2, 2)
    lay = plan_layout(ref, 8, 1, 8, colocated=True)                          # forced colocated at the reference
    assert (lay.colocated, lay.vision_dp, lay.lm_dp, lay.lm_tp) == (True, 8, 8, 1)
    lay = plan_layout(TINY, 4, 1, 2)                                         # tiny preset's own reference
    assert (lay.colocated, lay.vision_dp, lay.lm_dp, lay.vision_micro_batch) == (False, 2, 2, 1)
    with pytest.raises(SystemExit, match="vision 2 .* = 10 != WORLD_SIZE 8"):
        plan_layout(ref, 8, 1, 4, vision_dp=2, lm_dp=4, lm_tp=2)


# ---------------------------------------------------------------- distributed: setup (docs/parallel.md §5)

def _members(group, world):
    """The global ranks of `group`, measured by a real collective on it."""
    v = torch.zeros(world)
    v[dist.get_rank()] = 1
    dist.all_reduce(v, group=group)
    return sorted(int(i) for i in v.nonzero().flatten())


def _check_setup(rank, world):
    out = []
    for lay in (hetero(2, 2, 2, 2, ep=2), colocated(2, 4, ep=2, etp=2), hetero(1, 4, 1, 4, ep=4)):
        par = setup(lay, TINY)
        grids = {"vision": (vision_grid(lay), ["tp", "dp_cp"]),
                 "lm": (lm_grid(lay), ["tp", "cp", "dp_cp", "tp_cp", "tp_dp_cp"])}
        assert par.in_vision == (rank in grids["vision"][0]) and par.in_lm == (rank in grids["lm"][0])
        for name, (grid, fields) in grids.items():
            m = getattr(par, name)
            if m is None:
                continue
            c = grid.coords(rank)
            assert (m.tp_rank, m.dp_rank, m.tp_size, m.dp_size) == (c["tp"], c["dp"], grid.shape[0], grid.shape[2])
            assert dist.get_rank(m.tp) == m.tp_rank
            for f in fields:
                assert _members(getattr(m, f), world) == group_of(grid, f.replace("_", "-"), rank), (name, f)
        if par.lm is not None:
            ex = expert_grid(lay)
            for f in ("ep", "etp", "edp"):
                assert _members(getattr(par.lm, f), world) == group_of(ex, f, rank), f
            c = ex.coords(rank)
            assert (par.lm.ep_rank, par.lm.etp_rank, par.lm.edp_rank) == (c["ep"], c["etp"], c["edp"])
            assert dist.get_rank(par.lm.ep) == par.lm.ep_rank and dist.get_rank(par.lm.edp) == par.lm.edp_rank
        if not lay.colocated:
            leaders = {ln.src_leader for ln in bridge_links(lay)} | {ln.dst_leader for ln in bridge_links(lay)}
            assert (par.bridge is not None) == (rank in leaders)
            if par.bridge is not None:
                assert _members(par.bridge, world) == sorted(leaders)
        out.append((par.created, str(par)))
    return out


def test_setup_groups():
    results = run_distributed(_check_setup, 8)
    for i in range(3):       # every rank issued the same group creations in the same order
        assert all(r[i][0] == results[0][i][0] for r in results)
    labels = [label for label, _ in results[0][0][0]]
    assert labels == ["vision tp", "vision dp-cp", "lm tp", "lm cp", "lm dp-cp", "lm tp-cp", "lm tp-dp-cp", "lm pp",
                      "lm ep", "lm etp", "lm edp", "bridge"]     # only the groups the code reads (no dp, tp-dp, whole)
    assert results[5][0][1] == "lm tp1/2 dp0/2 ep1/2 etp0/1 edp0/2 rank5"
    assert results[1][0][1] == "vision tp1/2 dp0/2 rank1"
    assert results[3][1][1] == "vision tp1/2 dp1/4 | lm tp1/2 dp1/4 ep1/2 etp1/2 edp0/2 rank3"


# ---------------------------------------------------------------- distributed: bridge (docs/parallel.md §6)

HIDDEN = 4


def _counts(m, n_samples):
    """Rows per sample of microbatch m: non-uniform (dynamic resolution), some 0; microbatch 1 is text-only."""
    if m == 1:
        return [0] * n_samples
    return torch.randint(0, 4, (n_samples,), generator=torch.Generator().manual_seed(17 + m)).tolist()


def _rows(m, i, n):
    """Tagged rows of sample i: (sample id, row id, microbatch, a seeded random value)."""
    rnd = torch.randn(n, generator=torch.Generator().manual_seed(1000 * m + i))
    return torch.stack([torch.full((n,), float(i)), torch.arange(n, dtype=torch.float32),
                        torch.full((n,), float(m)), rnd], 1)


def _grads(m, i, n):
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(5000 + 1000 * m + i))


def _check_bridge(rank, world, layouts, n_micro=3):
    """Encoder ranks run 1F1B as train.py does: send m+1 before the backward of m."""
    out = []
    for lay in layouts:
        par, inner = setup(lay, TINY), torch.zeros(2, dtype=torch.float64)
        bridge = Bridge(par)
        own = rank_samples(lay, rank)
        pending = []                                                   # encoder microbatches awaiting backward

        def encoder_backward(m, counts, base, weight, rows):
            grad = bridge.backward_encoder()
            expect = torch.cat([_grads(m, i, counts[i]) for i in own["vision"]])
            if lay.in_place:
                assert grad is None
            else:
                assert torch.equal(grad, expect)                      # same on every encoder tp rank
                if par.vision.tp_rank == par.vision.tp_size - 1:      # <x, bridge^T(g)>, each lane once
                    inner[1] += (base.double() * grad.double()).sum()
            assert_close(weight.grad, (base * expect).sum())
            if m == 1:                                                # text-only: zero encoder gradient
                assert rows.shape == (0, HIDDEN) and weight.grad.item() == 0.0

        for m in range(n_micro):
            counts = _counts(m, lay.samples_per_microbatch)
            if par.in_vision:
                mine = own["vision"]
                base = torch.cat([_rows(m, i, counts[i]) for i in mine])
                weight = torch.ones((), requires_grad=True)          # the "encoder parameter"
                rows = base * weight
                bridge.send(rows, [counts[i] for i in mine])
                pending.append((m, counts, base, weight, rows))
                assert bridge.in_flight == len(pending) <= 2
                if len(pending) == 2:                                 # 1F1B steady state: backward of m - 1
                    encoder_backward(*pending.pop(0))
            if par.in_lm:
                x, got_counts = bridge.recv()
                lane = own["lm"]
                assert got_counts == [counts[i] for i in lane]
                assert torch.equal(x.detach(), torch.cat([_rows(m, i, counts[i]) for i in lane]))   # exact delivery
                assert x.requires_grad and x.shape == (sum(got_counts), HIDDEN)
                g = torch.cat([_grads(m, i, counts[i]) for i in lane])
                (x * g).sum().backward()
                bridge.send_grad()
                if par.lm.tp_rank == 0:                               # <bridge(x), g>, each lane once
                    inner[0] += (x.detach().double() * g.double()).sum()
        while pending:                                                # cool-down
            encoder_backward(*pending.pop(0))
        assert bridge.in_flight == 0
        dist.all_reduce(inner)
        if not lay.in_place:
            assert abs(inner[0] - inner[1]) < 1e-9 * max(1.0, abs(inner[0].item())), inner   # adjointness
            assert inner[0] != 0
        if par.in_lm:
            assert bridge.received == n_micro
        if bridge.out_links:
            assert bridge.sent == n_micro
        out.append(inner.tolist())
    return out


def test_bridge_world4():
    layouts = [hetero(1, 2, 1, 2, mbs=2),      # 1:1
               hetero(1, 1, 1, 3, mbs=2),      # fan-out k=3
               hetero(1, 2, 2, 1, mbs=2),      # fan-in k=2 into language tp2
               colocated(2, 2, mbs=2),         # identity
               # shared ranks, each module its own lanes: rows move between leaders, or stay on a rank leading both
               Layout(4, True, 1, 4, 2, 2, micro_batch=2, global_batch=12),
               Layout(4, True, 2, 2, 1, 4, micro_batch=1, global_batch=12)]
    assert len(run_distributed(_check_bridge, 4, layouts)) == 4


def test_bridge_uneven_world5():
    layouts = [hetero(1, 2, 1, 3, mbs=2),      # vision lane 0 feeds language lanes 0 and 1, lane 1 lanes 1 and 2
               hetero(1, 3, 1, 2, mbs=3)]      # and the other way round
    assert len(run_distributed(_check_bridge, 5, layouts)) == 5


def test_bridge_world6():
    layouts = [hetero(2, 1, 2, 2, mbs=1),      # fan-out, vision tp2 -> language tp2
               hetero(2, 2, 2, 1, mbs=2),      # fan-in with vision tp2
               hetero(2, 2, 1, 2, mbs=1)]      # 1:1, vision tp2
    assert len(run_distributed(_check_bridge, 6, layouts)) == 6


def test_bridge_world8():
    layouts = [hetero(1, 4, 2, 2, mbs=2)]      # fan-in k=2, uneven rows per source lane
    assert len(run_distributed(_check_bridge, 8, layouts)) == 8
