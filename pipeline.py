"""Pipeline parallelism's transfers between the language model's stages (docs/pipeline.md).

Stage s of p holds the layers model.stage_layers gives it. A rank trades with the rank of the same tp, cp and dp
coordinates one stage up and one down (its lm pp group, parallel.py): forward, the residual stream [mbs, seq/cp, D]
(and with MTP the decoder input beside it, which the last stage's MTP blocks read); backward, their gradients. Every
tp rank of a stage holds the whole residual stream, so each sends its own copy: no scatter, no gather.

    upstream:   received = pipe.trade_up(grads of the last backward's inputs, receive=True)    # stage > 0
    downstream: grads = pipe.trade_down(this forward's outputs, receive=True)                   # stage < p - 1

The NCCL rules (docs/parallel.md §9): both ranks of a pair post their send and receive of one round as ONE batch
(two batches, one per direction, could each wait for the other on the pair's one stream); the pair's first transfer
runs here in set-up, where every stage meets; the shapes and dtype are known on both sides (no header).
"""
import torch
import torch.distributed as dist

import comm
import vlm

TAG_ACT, TAG_GRAD = 201, 202   # gloo matches by tag: a pair's two directions never cross


class Pipe:
    """One per language rank. stage, stages: this rank's stage and their count; first / last: whether it holds the
    embedding / the head."""

    def __init__(self, par, cfg, device):
        lay, m = par.layout, par.lm
        self.stage, self.stages, self.group = m.pp_rank, m.pp_size, m.pp
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        hop = lay.lm_tp * lay.lm_cp * lay.lm_dp     # the grid's pp stride (parallel.Grid)
        self.up = None if self.first else par.rank - hop
        self.down = None if self.last else par.rank + hop
        self.shape = (lay.micro_batch, cfg.seq_len // lay.lm_cp, cfg.hidden_size)
        self.device = torch.device(device)
        self.dtype = vlm.compute_dtype(self.device)
        if self.stages > 1:
            comm.open_pairs([peer for peer in (self.up, self.down) if peer is not None], self.group, device)

    def _trade(self, peer, sends, send_tag, count, recv_tag):
        """Send `sends` to `peer` and receive `count` tensors from it, in one batch -> the received (or None)."""
        got = [torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in range(count)]
        for r in comm.p2p([(dist.isend, t.detach().to(self.dtype).contiguous(), peer, send_tag) for t in sends or ()]
                          + [(dist.irecv, t, peer, recv_tag) for t in got], self.group):
            r.wait()   # over NCCL the stream waits, not the host
        return got or None

    def trade_up(self, grads, receive, mtp):
        """With the stage above: send it the gradients of the inputs of this stage's last backward (or None), and
        receive the next micro-batch's inputs (leaves requiring grad), if `receive`. mtp: the decoder input
        travels too."""
        got = self._trade(self.up, grads, TAG_GRAD, (1 + mtp) * receive, TAG_ACT)
        return got and [t.requires_grad_() for t in got]

    def trade_down(self, outputs, receive, mtp):
        """With the stage below: send it this forward's outputs (or None), receive the gradients of the oldest
        forward whose backward is due, if `receive`."""
        return self._trade(self.down, outputs, TAG_ACT, (1 + mtp) * receive, TAG_GRAD)
