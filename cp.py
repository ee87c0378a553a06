"""Context parallelism (docs/cp.md): the cp ranks of a language lane each hold 1/cp of every sequence.

The split is the two-chunk zigzag: a row of L positions is cut into 2 cp equal chunks and cp rank r holds chunks r
and 2 cp - 1 - r, in that order (cp = 1: the whole row, one chunk). Under causal attention a query's work grows with
its position, so every rank then gets the same share of it. Token-wise layers (norms, projections, MoE, the loss) run
on a rank's positions as they are; the two mixers that read other positions see the whole row: attention gathers K
and V from every cp rank (`gather`, docs/cp.md §2), Mamba2 runs its conv and scan on whole rows of 1/cp of its heads
(`to_heads` and back `to_positions`: all-to-alls, docs/cp.md §3). "Natural order" is the row's own order of
positions, 0 .. L - 1; a rank's "local" tensors hold its positions in zigzag order (`local`).

Shape suffixes: B batch, L the whole row, M this rank's positions (L / cp), W a channel width, S the cp ranks.
"""
import torch

import comm


def spans(L, rank, size):
    """[(start, stop)] of the positions cp rank `rank` of `size` holds in a row of L, in its local order."""
    if size == 1:
        return [(0, L)]
    c = L // (2 * size)
    return [(rank * c, (rank + 1) * c), ((2 * size - 1 - rank) * c, (2 * size - rank) * c)]


def local(t, rank, size, dim=1):
    """This rank's positions of a whole-row tensor (dim: the sequence dim)."""
    if size == 1:
        return t
    return torch.cat([t.narrow(dim, a, b - a) for a, b in spans(t.shape[dim], rank, size)], dim)


def natural(parts_S, dim):
    """Every rank's local tensor (a list over cp ranks) -> the whole rows in natural order."""
    size = len(parts_S)
    halves = [p.chunk(2, dim) for p in parts_S]
    return torch.cat([halves[k][0] if k < size else halves[2 * size - 1 - k][1] for k in range(2 * size)], dim)


def zigzag(t, size, dim):
    """The inverse of `natural`: whole rows -> the list of every rank's local tensor."""
    chunks = t.chunk(2 * size, dim)
    return [torch.cat([chunks[r], chunks[2 * size - 1 - r]], dim) for r in range(size)]


def _exchange(send_S, group):
    """send_S [S, ...]: slice s goes to cp rank s -> [S, ...]: slice s came from cp rank s."""
    size = send_S.shape[0]
    return comm.all_to_all(send_S, [1] * size, [1] * size, group)


def gather(x_BMW, group):
    """The whole rows [B, L, W] in natural order from every rank's positions [B, M, W]. Backward sums each rank's
    gradient for these positions (every rank's queries read all of them) and keeps this rank's: a reduce-scatter."""
    if comm.group_size(group) == 1:
        return x_BMW
    return natural(list(comm.gather_sum(x_BMW, group)), 1)


def to_heads(x_BMW, segments, group):
    """Sequence-sharded -> head-sharded: [B, M, W] whose channels are the concatenated `segments` -> [B, L, W / cp]
    holding the (W_i / cp)-wide slice r of every segment i, for the whole rows (cp rank r)."""
    size = comm.group_size(group)
    if size == 1:
        return x_BMW
    parts = [seg.chunk(size, -1) for seg in x_BMW.split(segments, -1)]
    send = torch.stack([torch.cat([p[r] for p in parts], -1) for r in range(size)])
    return natural(list(_exchange(send, group)), 1)


def to_positions(y_BLW, group):
    """Head-sharded -> sequence-sharded, the inverse of `to_heads` for one segment: [B, L, W] (this rank's channel
    slice of the whole rows) -> [B, M, W x cp] (every rank's slices, in rank order, for this rank's positions)."""
    size = comm.group_size(group)
    if size == 1:
        return y_BLW
    recv = _exchange(torch.stack(zigzag(y_BLW, size, 1)), group)
    return torch.cat(list(recv), -1)
