"""Differentiable collectives used inside the model (tensor and expert parallelism), each the other's adjoint in
pairs, and how tensors are sliced by layout (shard / unshard, mark_shard, take_shard, init_shard).

Each collective takes a process group; `None` (or a group of size 1) makes it the identity, so the same model code
runs on one CPU process, colocated, or sharded.
"""
import zlib

import torch
import torch.distributed as dist

# torch 2.13 renamed these two (and warns on the old names), the CUDA image has torch 2.11
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group):
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group):
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x, group):
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _cat(x, dim, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def _chunk(x, dim, group):
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


def _stack(x, group):   # the collectives take the ranks' tensors concatenated along dim 0
    size = dist.get_world_size(group)
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    all_gather(out, x.contiguous(), group=group)
    return out.view(size, *x.shape)


def _sum_slot(x, group):
    out = x.new_empty(x.shape[1:])
    reduce_scatter(out, x.flatten(0, 1).contiguous(), group=group)
    return out


def _exchange(x, out_splits, in_splits, group):
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _same(x, *args):
    return x


def _adjoints(forward, backward, alone=_same):
    """A differentiable collective: forward(x, *args, group), whose gradient is backward(grad, *args, group);
    alone(x, *args) where the group is None or of size 1."""
    class Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *args):
            ctx.args = args
            return forward(x, *args)

        @staticmethod
        def backward(ctx, grad):
            return (backward(grad, *ctx.args),) + (None,) * len(ctx.args)

    return lambda x, *args: alone(x, *args[:-1]) if group_size(args[-1]) == 1 else Collective.apply(x, *args)

# copy_to: a column-parallel layer's input; reduce_from: a row-parallel layer's output (Megatron's f / g)
copy_to, reduce_from = _adjoints(_same, _all_reduce), _adjoints(_all_reduce, _same)
# all_gather_dim(x, dim, group) concatenates equal shards; split_dim keeps this rank's slice of a replicated tensor
all_gather_dim, split_dim = _adjoints(_cat, _chunk), _adjoints(_chunk, _cat)
# [...] -> [S, ...]: every rank's tensor stacked in rank order; backward sums the ranks' gradients of this rank's slot
# (a reduce-scatter), for a gathered tensor each rank reads differently (context parallelism's K, V)
gather_sum = _adjoints(_stack, _sum_slot, lambda x: x.unsqueeze(0))
# all_to_all(x, out_splits, in_splits, group): uneven splits along dim 0; backward swaps them
all_to_all = _adjoints(_exchange, lambda g, out_splits, in_splits, group: _exchange(g, in_splits, out_splits, group))


def shard(full, dim, rank, size, segments=None):
    """This rank's slice of a full tensor: each of `segments` (the lengths of concatenated blocks along `dim`, as Mamba
    in_proj's [z | x | B | C | dt]; None: one block) split in `size` equal parts. `unshard` is the inverse."""
    segments = segments or [full.shape[dim]]
    blocks = torch.split(full, segments, dim)
    return torch.cat([b.chunk(size, dim)[rank] for b in blocks], dim)


def unshard(slices, dim, segments=None):
    """Full tensor from the list of every rank's slice (inverse of `shard`)."""
    size = len(slices)
    segments = segments or [sum(s.shape[dim] for s in slices)]
    local = [n // size for n in segments]
    per_rank = [torch.split(s, local, dim) for s in slices]
    return torch.cat([torch.cat([per_rank[r][i] for r in range(size)], dim) for i in range(len(segments))], dim)


def mark_shard(param, *shards):
    """Record how a parameter is split: each shard is (group_kind, dim, segments), group_kind in tp/ep/etp, so that
    checkpoints assemble full tensors and the grad norm counts replicated parameters once. Unmarked parameters are
    replicated within their module's model-parallel group."""
    param.shards = tuple(shards)
    return param


def shard_kinds(p):
    """{"tp", "ep", "etp"} subset from mark_shard; empty for parameters replicated within the module's tp."""
    return {s[0] for s in getattr(p, "shards", ())}


def is_expert(p):
    return "ep" in shard_kinds(p)


def counted_in_replica(p, m):
    """Whether this rank's copy of p counts in the norm of one data-parallel replica: tp-sharded parameters on
    every tp rank, replicated ones on tp rank 0; experts on every ep rank, on etp rank 0 unless etp-sharded."""
    kinds = shard_kinds(p)
    if "ep" in kinds:
        return "etp" in kinds or m.etp_rank == 0
    return "tp" in kinds or m.tp_rank == 0


def device():
    """The device collectives' tensors live on: the current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def p2p(ops, group):
    """[(dist.isend or dist.irecv, tensor, peer's global rank, tag)] as one batch on `group` -> its requests; the
    caller waits (its line is what the watchdog names). One batch, never a lone send: that would make a 2-rank NCCL
    communicator mid-step (docs/parallel.md §9). An empty tensor is not posted: both sides know its size."""
    ops = [dist.P2POp(op, t, peer, group=group, tag=tag) for op, t, peer, tag in ops if t.numel()]
    return dist.batch_isend_irecv(ops) if ops else []


def open_pairs(peers, group, device):
    """One element each way with every peer, one batch: NCCL connects a pair host against host on its first
    transfer, so that runs here in set-up, where every rank of `group` posts this (NCCL wants them all in a group's
    first batch), not mid-step where the peer may wait elsewhere (docs/parallel.md §9)."""
    for r in p2p([(op, torch.zeros(1, device=device), peer, 0) for peer in peers for op in (dist.isend, dist.irecv)],
                 group):
        r.wait()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def on_every_rank(fn, *args, **kwargs):
    """fn(...) on every rank; a one-line error (SystemExit) on any rank ends every rank with it, rather than one
    rank exiting and the others waiting in their next collective (a corrupt rank json is read by its rank only).
    Without a process group: fn(...)."""
    if not dist.is_initialized():
        return fn(*args, **kwargs)
    try:
        out, error = fn(*args, **kwargs), None
    except SystemExit as e:
        out, error = None, str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise SystemExit(first)
    return out


def full_shape(shape, shards, sizes):
    """Shape of the whole tensor that a slice of `shape`, cut by `shards`, belongs to; sizes: {kind: group size}."""
    shape = list(shape)
    for kind, dim, _ in shards:
        shape[dim] *= sizes.get(kind, 1)
    return shape


def take_shard(full, shards, ranks, sizes):
    """This rank's slice of a full tensor, cut by `shards` in order (ranks / sizes: {kind: rank / group size})."""
    shape = list(full.shape)
    for kind, dim, _ in shards:
        shape[dim] //= sizes.get(kind, 1)
    out = full.new_empty(shape)
    copy_shard(out, full, shards, ranks, sizes)
    return out


def draw(name, seed, shape, rule, device="cpu"):
    """The full tensor `name` as rule(shape, generator) draws it, the generator (on `device`) seeded by (seed, name):
    an initial value depends on neither the layout nor any other tensor. Every init draws through here."""
    return rule(shape, torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode())))


def init_shard(t, name, seed, rule, ranks, sizes, device=None):
    """t <- this rank's slice (t.shards; ranks / sizes by kind) of draw(name, ...) at t's full shape, cast to t's
    dtype. Copied from views of the draw (copy_shard), so the draw is the one tensor beside t while this runs."""
    shards = getattr(t, "shards", ())
    full = draw(name, seed, full_shape(t.shape, shards, sizes), rule, device or t.device)
    with torch.no_grad():
        copy_shard(t, full, shards, ranks, sizes)


def copy_shard(t, full, shards, ranks, sizes):
    """t <- this rank's slice of `full` (take_shard), block by block from views of `full`, not through a copy of the
    slice (every shard after the first cuts another dim, as the model's experts' ep x etp)."""
    if not shards:
        t.copy_(full)
        return
    (kind, dim, segments), at = shards[0], 0
    for block in torch.split(full, segments or [full.shape[dim]], dim):
        part = block.chunk(sizes.get(kind, 1), dim)[ranks.get(kind, 0)]
        copy_shard(t.narrow(dim, at, part.shape[dim]), part, shards[1:], ranks, sizes)
        at += part.shape[dim]
