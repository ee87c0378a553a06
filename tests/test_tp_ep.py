"""Tensor / expert / expert-tensor parallel language model == one device (forward loss, every gradient)."""
import pytest
import torch
import torch.distributed as dist

import comm
import config
import model
from tests.spawn import run_distributed


def _groups(world, tp, ep, etp):
    """Every rank creates every group (same order); returns this rank's tp/dp/ep/etp/edp groups and coords."""
    dp = world // tp
    edp = world // (ep * etp)
    base = torch.arange(world).view(dp, tp)                 # tp fastest
    expert = torch.arange(world).view(edp, ep, etp)         # etp fastest, then ep
    rank, mine = dist.get_rank(), {}
    lists = {"tp": base.tolist(), "dp": base.T.tolist(),
             "etp": expert.reshape(-1, etp).tolist(),
             "ep": expert.permute(0, 2, 1).reshape(-1, ep).tolist(),
             "edp": expert.permute(1, 2, 0).reshape(-1, edp).tolist()}
    for kind, ranks_list in lists.items():
        for ranks in ranks_list:
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = (g, ranks.index(rank), len(ranks))
    return mine


def _check(rank, world, tp, ep, etp, latent):
    torch.manual_seed(0)
    cfg = config.resolve("tiny", {"moe_latent_size": latent})
    ref = model.LanguageModel(cfg)
    model.init_weights(ref, 7, {}, cfg)
    g = _groups(world, tp, ep, etp)
    groups = {k: g[k][0] for k in ("tp", "ep", "etp")}
    coords = {k: (g[k][1], g[k][2]) for k in ("tp", "ep", "etp")}
    lm = model.LanguageModel(cfg, groups)
    model.init_weights(lm, 7, coords, cfg)                  # layout-independent init == shards of `ref`
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        full = q.detach()
        for kind, dim, seg in getattr(p, "shards", ()):
            full = comm.shard(full, dim, *coords[kind], seg)
        assert torch.equal(p.detach(), full), name
    dp, lane = g["dp"][2], g["dp"][1]
    ids = torch.randint(0, cfg.vocab_size, (dp, 2, 24))     # lane j trains on ids[j]
    labels = torch.roll(ids, -1, -1)
    s, n = lm.loss_sum(lm(lm.embed(ids[lane])), labels[lane])
    s.backward()
    total = s.detach().clone()
    dist.all_reduce(total, group=g["dp"][0])
    s_ref, _ = ref.loss_sum(ref(ref.embed(ids.flatten(0, 1))), labels.flatten(0, 1))
    s_ref.backward()
    assert abs(total.item() - s_ref.item()) < 1e-4 * abs(s_ref.item())
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        is_expert = any(k == "ep" for k, _, _ in getattr(p, "shards", ()))
        dist.all_reduce(grad, group=g["edp" if is_expert else "dp"][0])
        if getattr(p, "tp_partial", False):   # LatentMoE's projections see a token slice per tp rank (optim.py)
            dist.all_reduce(grad, group=g["tp"][0])
        full = q.grad
        for kind, dim, seg in getattr(p, "shards", ()):
            full = comm.shard(full, dim, *coords[kind], seg)
        torch.testing.assert_close(grad, full, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return total.item()


@pytest.mark.parametrize("tp,ep,etp,latent", [(2, 1, 1, None), (1, 2, 1, None), (2, 2, 1, None), (2, 1, 2, None),
                                              (1, 2, 2, None), (2, 1, 1, 24), (1, 2, 1, 24), (2, 2, 2, 24)])
@pytest.mark.slow
def test_parallel_language_model_matches_single_device(tp, ep, etp, latent):
    """latent: LatentMoE, the routed experts 24 wide (the projections' tp-partial gradients summed over tp)."""
    losses = run_distributed(_check, 4, tp, ep, etp, latent)
    assert len(set(round(x, 5) for x in losses)) == 1
