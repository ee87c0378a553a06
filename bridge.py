"""The encoder -> language bridge (docs/parallel.md §6, §7, §9): encoder rows to the language lanes that own their
samples, gradients back. Layout, grids and lanes come from parallel.py; schedule.py, its one caller, runs it in 1F1B.

A link joins every (vision lane, language lane) pair whose shares of a micro-batch overlap and carries exactly the
overlap (bridge_links): fan-out, fan-in and 1:1 all fall out of that one rule. The vision lane's leader (its LAST tp
rank) sends each link a header int64[micro-batch, dtype, rows, D, rows of each sample], then the payload; the
language lane's leader (tp and cp rank 0) receives its links in lane order and broadcasts both in its lane's tp-cp
group (each cp rank places the rows its positions hold: model.place_images). Backward runs the links in reverse,
without a header (both leaders recorded the row counts): the language leader sums the gradient over cp and sends
each link its slice; the vision leader broadcasts it in its tp group, and every vision tp rank runs
rows.backward(grad). In place (colocated, the same lanes), send keeps the rows and recv returns that very tensor
(autograd flows straight into the encoder); send_grad and backward_encoder do nothing.

  vision ranks:    bridge.send(rows, rows_per_sample)     # rows [R, D] of this lane's samples, in sample order
                   bridge.backward_encoder()              # the oldest in flight: its gradient, rows.backward
  language ranks:  x, rows_per_sample = bridge.recv()     # [R_lane, D], a leaf requiring grad, same on all tp
                   ... loss.backward(); bridge.send_grad()
The NCCL rules (§9, schedule.py's rounds; p = lm_pp), one path for separate and shared ranks. Every transfer is a
batch on the bridge group's one communicator, and every link is opened in set-up (comm.open_pairs): a pair's first
transfer blocks the host. In round k the encoder leader posts the receive of gradient k - p, then the rows of k
(header and payload); the language leader (stage 0) the headers of k, then the payloads (sized by the headers), and
after its backward the gradient of k - p + 1, before its next signal check. So both ranks of a pair post one
sequence, rows k, gradient k - p + 1, rows k + 1, and a rank waits only for what its peer posted in that round or
earlier. Sends are waited for late, the rows at their backward, a gradient at the next one's send (or release): on
shared ranks the encoder receives it after the next signal check and encode, collectives this rank joins first. A
pair carries rows one way only: hetero ranks hold one side, and colocated the vision leader is the last rank of its
lane, the language leader the first of its, so rows go to a lower rank or stay (a copy). Where one rank's stream
holds both sides, a receive queued behind its own sends waits on lower ranks for rows, higher ones for gradients:
chains that end. Not one batch per pair and round as in pipeline.py: the payload's size comes in its header, a
gradient exists only after the backward and leaves before the check a vision-only rank passes after its round, and
the gradient receive batched with the sends would be one NCCL work with them, holding the encoder backward until
the language side took the new rows. A text-only micro-batch still sends one header per link; its 0-row payload
and gradient are posted by neither side (both know the size).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

import comm
from parallel import lane_samples, lanes, lm_grid, vision_grid


@dataclass(frozen=True)
class Link:
    src_lane: int
    dst_lane: int
    src_leader: int                  # global rank: the vision lane's last tp rank
    dst_leader: int                  # global rank: the language lane's tp rank 0
    samples: range                   # sample indices within the global microbatch


def bridge_links(lay):
    """The comm map (docs/parallel.md §6): every link, ordered by language lane then vision lane (= by vision
    lane, then language)."""
    src, dst = lanes(vision_grid(lay)), lanes(lm_grid(lay))
    links = []
    for j, dst_ranks in enumerate(dst):
        for e, src_ranks in enumerate(src):
            a, b = lane_samples(lay, "vision", e), lane_samples(lay, "lm", j)
            lo, hi = max(a.start, b.start), min(a.stop, b.stop)
            if lo < hi:
                links.append(Link(e, j, src_ranks[-1], dst_ranks[0], range(lo, hi)))
    return links


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)   # header code = index
TAG_HEADER, TAG_PAYLOAD, TAG_GRAD = 101, 102, 103   # gloo matches by tag: payloads never cross


class Bridge:
    """One per rank (any role); the API is in the comment above. `device`: where received tensors live (the
    local cuda device under NCCL)."""

    def __init__(self, par, device="cpu"):
        self.par, self.lay, self.device = par, par.layout, torch.device(device)
        self.in_place = self.lay.in_place     # colocated, the same lanes: rows handed over in memory
        self.depth = self.lay.lm_pp            # the pipeline's stages: micro-batches in flight are up to depth + 1
        links = [] if self.in_place else bridge_links(self.lay)
        self.out_links = [ln for ln in links if ln.src_leader == par.rank]   # non-empty on encoder leaders only
        self.in_links = [ln for ln in links if ln.dst_leader == par.rank]    # non-empty on language leaders only
        if par.vision is not None:
            self.vision_leader = lanes(vision_grid(self.lay))[par.vision.dp_rank][-1]
            self.vision_first = lane_samples(self.lay, "vision", par.vision.dp_rank).start
        if par.lm is not None:
            self.lm_leader = lanes(lm_grid(self.lay))[par.lm.dp_rank][0]
        self.sent = self.received = 0          # microbatch counters; the index travels in the header as a check
        self._pass = None
        self._held = []                        # language, oldest first: (rows received, rows per link) until
        #                                        send_grad
        self._flight = []                      # encoder, oldest first: [rows, rows per link, send reqs, grad recv]
        self._grad_sent = []                   # language: the last gradient send's requests (send_grad says why)
        self._mail = {TAG_HEADER: [], TAG_PAYLOAD: [], TAG_GRAD: []}   # sends to this rank itself
        peers = {ln.dst_leader for ln in self.out_links} | {ln.src_leader for ln in self.in_links}
        comm.open_pairs(sorted(peers - {par.rank}), par.bridge, self.device)   # set-up: every bridge leader is here

    def _post(self, ops, wait=True):
        """[(dist.isend or dist.irecv, tensor, peer's global rank, tag)] as one batch (comm.p2p) -> its requests,
        waited for unless wait=False. A link whose two leaders are this rank is a copy: its send comes first (the
        encoder's side of a round runs before the language side's; a gradient before the backward that takes it)."""
        for op, t, peer, tag in ops:
            if peer == self.par.rank and op is dist.isend:
                self._mail[tag].append(t)
            elif peer == self.par.rank:
                t.copy_(self._mail[tag].pop(0))
        reqs = comm.p2p([o for o in ops if o[2] != self.par.rank], self.par.bridge)
        for r in reqs if wait else ():
            r.wait()
        return reqs

    @property
    def in_flight(self):
        """Encoder microbatches sent whose backward has not run yet."""
        return len(self._flight)

    @property
    def held(self):
        """Language micro-batches received whose gradient has not been sent back yet."""
        return len(self._held)

    # ---- encoder side ----------------------------------------------------------------------------------------
    def send(self, rows, rows_per_sample):
        """Hand this vision lane's rows [R, D] (samples in order, `rows_per_sample` rows each) to the language side."""
        counts = [int(c) for c in rows_per_sample]
        assert rows.dim() == 2 and len(counts) == self.lay.vision_micro_batch and sum(counts) == rows.shape[0], \
            f"rows {tuple(rows.shape)} do not match rows_per_sample {counts}"
        assert self.in_flight <= self.depth, "bridge.send with lm_pp + 1 in flight: run backward_encoder first"
        if self.in_place:
            self._pass = (rows, counts)
            self._flight.append([rows, None, [], None])
            self.sent += 1
            return
        if len(self._flight) == self.depth:   # the gradient receive before this send: see the comment above
            self._flight[0][3] = self._post_grad_recv(self._flight[0])
        first = self.vision_first              # out_links is empty on the non-leader tp ranks: they send nothing
        link_counts = [counts[ln.samples.start - first: ln.samples.stop - first] for ln in self.out_links]
        splits = [sum(c) for c in link_counts]
        chunks = [c.contiguous() for c in rows.detach().split(splits)] if self.out_links else []
        ops = []
        for ln, c, chunk in zip(self.out_links, link_counts, chunks):
            header = torch.tensor([self.sent, DTYPES.index(rows.dtype), len(chunk), rows.shape[1], *c],
                                  dtype=torch.int64, device=rows.device)
            ops += [(dist.isend, header, ln.dst_leader, TAG_HEADER), (dist.isend, chunk, ln.dst_leader, TAG_PAYLOAD)]
        self._flight.append([rows, splits, self._post(ops, wait=False), None])
        self.sent += 1

    def _post_grad_recv(self, entry):
        """(the gradient slices of the micro-batch's links, their posted receives)."""
        parts = [entry[0].new_empty(n, entry[0].shape[1]) for n in entry[1]]
        return parts, self._post([(dist.irecv, p, ln.dst_leader, TAG_GRAD) for ln, p in zip(self.out_links, parts)],
                                 wait=False)

    def backward_encoder(self):
        """For the oldest microbatch in flight: receive d(loss)/d(rows), share it in the lane's tp group, run
        rows.backward(grad). Returns the gradient (None in place: the language loss.backward() already
        reached the encoder)."""
        assert self._flight, "backward_encoder without send"
        entry = self._flight.pop(0)
        rows, send_reqs, recv = entry[0], entry[2], entry[3]
        if self.in_place:
            return None
        if self.out_links:                     # leader: one slice per link, concatenated in link (= sample) order
            parts, recv_reqs = recv or self._post_grad_recv(entry)
            for r in send_reqs + recv_reqs:
                r.wait()
            grad = torch.cat(parts)
        else:
            grad = rows.new_empty(rows.shape)
        if dist.get_world_size(self.par.vision.tp) > 1:
            dist.broadcast(grad, src=self.vision_leader, group=self.par.vision.tp)
        if rows.requires_grad:
            rows.backward(grad)
        return grad

    def release(self):
        """End a step, or forward-only micro-batches (evaluation), on either side: this rank's sends are waited for,
        what is held without a gradient to come is dropped."""
        for r in [r for entry in self._flight for r in entry[2]] + self._grad_sent:
            r.wait()
        self._flight, self._held, self._grad_sent, self._pass = [], [], [], None

    # ---- language side ---------------------------------------------------------------------------------------
    def recv(self):
        """This language lane's rows [R_lane, D] (a leaf requiring grad, identical on every tp rank) and the row
        count of each of its micro_batch samples."""
        assert len(self._held) < self.depth, "bridge.recv with lm_pp micro-batches held: send_grad first"
        if self.in_place:
            (rows, counts), self._pass = self._pass, None
            self.received += 1
            return rows, counts
        if self.in_links:                      # leader: all headers, then all payloads, links in lane order
            headers = [torch.empty(4 + len(ln.samples), dtype=torch.int64, device=self.device) for ln in self.in_links]
            self._post([(dist.irecv, h, ln.src_leader, TAG_HEADER) for ln, h in zip(self.in_links, headers)])
            flat = torch.cat(headers).cpu()                                 # one device->host copy for all links
            heads = [h.tolist() for h in flat.split([len(h) for h in headers])]
            assert all(h[0] == self.received for h in heads), f"microbatch {self.received} got headers {heads}"
            code, hidden = heads[0][1], heads[0][3]
            parts = [torch.empty(h[2], hidden, dtype=DTYPES[code], device=self.device) for h in heads]
            self._post([(dist.irecv, p, ln.src_leader, TAG_PAYLOAD) for ln, p in zip(self.in_links, parts)])
            x = torch.cat(parts)
            splits = [h[2] for h in heads]
            head = [self.received, code, len(x), hidden, *[c for h in heads for c in h[4:]]]
        lane = self.par.lm.tp_cp
        if dist.get_world_size(lane) > 1:      # the leader shares header and payload with its tp and cp partners
            if self.in_links:
                header = torch.tensor(head, dtype=torch.int64, device=self.device)
            else:
                header = torch.empty(4 + self.lay.micro_batch, dtype=torch.int64, device=self.device)
            dist.broadcast(header, src=self.lm_leader, group=lane)
            if not self.in_links:
                head = header.tolist()
                x = torch.empty(head[2], head[3], dtype=DTYPES[head[1]], device=self.device)
            dist.broadcast(x, src=self.lm_leader, group=lane)
        self.received += 1
        self._held.append((x.requires_grad_(True), splits if self.in_links else None))
        return x, head[4:]

    def send_grad(self):
        """After the language backward of the oldest held: the leader returns each link its slice of x.grad (zeros
        if x got none), summed over the lane's cp ranks (each holds the gradient of the rows its positions hold; tp
        ranks agree)."""
        if self.in_place:
            return
        assert self._held, "send_grad without recv"
        x, splits = self._held.pop(0)
        m = self.par.lm
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        if m.cp_size > 1 and m.tp_rank == 0:
            dist.reduce(grad, dst=self.lm_leader, group=m.cp)
        for r in self._grad_sent:   # a micro-batch late: shared, the encoder receives after the next check and encode
            r.wait()
        self._grad_sent = self._post([(dist.isend, g.contiguous(), ln.src_leader, TAG_GRAD)
                                      for ln, g in zip(self.in_links, grad.detach().split(splits) if self.in_links
                                                       else [])], wait=False)
