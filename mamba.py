"""Mamba2 mixer: in_proj -> causal conv + SiLU -> chunked SSD (+ D skip) -> gated grouped RMSNorm -> out_proj.

Two execution paths with the same math (tests/test_gpu.py::test_mamba_kernel_matches_reference_fp32 holds them
to docs/decoder.md §4's tolerances; tests/test_decoder.py checks the reference against the plain recurrence):
- CPU / reference: pure PyTorch. Chunked SSD after Mamba-2 "Listing 1" (ssd_minimal), extended with a document
  mask so packed sequences (`seq_idx`) reset the state without per-document loops.
- CUDA: `mamba_ssm`'s fused `mamba_split_conv1d_scan_combined` (conv, SSD and gated norm in one pipeline; tuned.py
  loads it on the first GPU input).

Tensor parallel: each rank owns H/tp heads and G/tp groups; in_proj rows are laid out [z | x | B | C | dt] per
rank (segments sharded separately), so the local split is the same code as on one device. Context parallel:
in_proj and out_proj run on the rank's positions, the conv and scan on whole rows of 1/cp of its heads (cp.py).

Shape suffixes (u_BMD is [B, M, D]; widths are this tp rank's share): B batch, L sequence (whole rows), M this cp
rank's positions of a row (cp.py), D hidden size, I inner width (heads x head dim), C conv channels (I + 2 G N), W
conv kernel width. Sizes: H heads, P head dim, G groups, N state size (lowercase in ssd_chunked's shapes, with b
batch, c chunks, Q chunk length; its einsums' l and s are positions in a chunk, z a chunk). The tensors B, C
(ssd_chunked's, Bm / Cm elsewhere) and the parameter D are the SSM's input, output and skip terms (docs/decoder.md
§2), not sizes.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import comm
import cp
import tuned


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg, tp_group=None, cp_group=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        self.tp_group, self.cp_group = tp_group, cp_group
        H, P, G, N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        self.nheads, self.headdim, self.ngroups, self.dstate = H // tp, P, G // tp, N
        self.d_inner = self.nheads * P
        self.conv_dim = self.d_inner + 2 * self.ngroups * N
        self.chunk_size, self.eps = cfg.chunk_size, cfg.norm_eps
        d_in_full, gn_full = H * P, G * N
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * self.d_inner + 2 * self.ngroups * N + self.nheads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim, bias=True)
        # the CUDA kernels read the conv channels 8 at a time and take conv widths 2 to 4 (causal_conv1d)
        self.kernels = self.conv_dim // comm.group_size(cp_group) % 8 == 0 and cfg.conv_kernel <= 4
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.D = nn.Parameter(torch.empty(self.nheads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, cfg.hidden_size, bias=False)
        comm.mark_shard(self.in_proj.weight, ("tp", 0, [d_in_full, d_in_full, gn_full, gn_full, H]))
        for p in (self.conv1d.weight, self.conv1d.bias):
            comm.mark_shard(p, ("tp", 0, [d_in_full, gn_full, gn_full]))
        for p in (self.dt_bias, self.A_log, self.D, self.norm.weight):
            comm.mark_shard(p, ("tp", 0, None))
        comm.mark_shard(self.out_proj.weight, ("tp", 1, None))

    def forward(self, u_BMD, seq_idx=None, valid_BL=None):
        """u: this cp rank's positions; the conv and the scan run on whole rows of this rank's heads (cp.py)."""
        u_BMD = comm.copy_to(u_BMD, self.tp_group)
        GN = self.ngroups * self.dstate
        zxbcdt = cp.to_heads(self.in_proj(u_BMD), [self.d_inner, self.d_inner, GN, GN, self.nheads], self.cp_group)
        y = (self._kernel_path if zxbcdt.is_cuda and self.kernels else self._reference_path)(zxbcdt, seq_idx)
        return comm.reduce_from(self.out_proj(cp.to_positions(y, self.cp_group)), self.tp_group)

    def _heads(self):
        """(conv weight [C, W], conv bias, dt_bias, A_log, D, norm weight, heads, groups) of the heads this cp rank
        scans: its 1/cp slice of the tp rank's heads and groups (all of them without cp). The slices are views into
        the parameters, so each cp rank's gradient lands in its slice; optim.py sums them over dp-cp."""
        w, b = self.conv1d.weight.squeeze(1), self.conv1d.bias
        n, r = comm.group_size(self.cp_group), comm.group_rank(self.cp_group)
        if n == 1:
            return w, b, self.dt_bias, self.A_log, self.D, self.norm.weight, self.nheads, self.ngroups
        conv = [self.d_inner, self.ngroups * self.dstate, self.ngroups * self.dstate]
        return (comm.shard(w, 0, r, n, conv), comm.shard(b, 0, r, n, conv),
                *(p.chunk(n)[r] for p in (self.dt_bias, self.A_log, self.D, self.norm.weight)),
                self.nheads // n, self.ngroups // n)

    def _reference_path(self, zxbcdt, seq_idx):
        conv_w, conv_b, dt_bias, A_log, D, norm_w, H, G = self._heads()
        Bsz, L, _ = zxbcdt.shape
        P, N = self.headdim, self.dstate
        z, xBC, dt = torch.split(zxbcdt, [H * P, H * P + 2 * G * N, H], dim=-1)
        xBC = F.silu(causal_conv1d_ref(xBC, conv_w, conv_b, seq_idx))
        x, Bm, Cm = torch.split(xBC, [H * P, G * N, G * N], dim=-1)
        dt = F.softplus(dt.float() + dt_bias.float())
        A = -torch.exp(A_log.float())
        y = ssd_chunked(x.reshape(Bsz, L, H, P).float(), dt, A, Bm.reshape(Bsz, L, G, N).float(),
                        Cm.reshape(Bsz, L, G, N).float(), self.chunk_size, seq_idx)
        y = y + x.reshape(Bsz, L, H, P).float() * D.float()[:, None]
        y = gated_rms_norm(y.reshape(Bsz, L, H * P), z, norm_w, G, self.eps)
        return y.to(zxbcdt.dtype)

    def _kernel_path(self, zxbcdt, seq_idx):
        conv_w, conv_b, dt_bias, A_log, D, norm_w, _, G = self._heads()
        seq_idx = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
        W = zxbcdt.shape[-1]
        if W % 8:   # causal_conv1d's channels-last input needs row strides in multiples of 8: a padded row's view
            zxbcdt = F.pad(zxbcdt, (0, -W % 8))[..., :W]
        # norm_before_gate=False and eps 1e-5: the kernel defaults (True, 1e-6) are wrong for Nemotron.
        return tuned.mamba_kernel()(
            zxbcdt, conv_w, conv_b, dt_bias, -torch.exp(A_log.float()), D, self.chunk_size, seq_idx=seq_idx,
            activation="silu", rmsnorm_weight=norm_w, rmsnorm_eps=self.eps, headdim=self.headdim, ngroups=G,
            norm_before_gate=False)


def facts(cfg, seq_len, T=0, tp=1, cp=1, ep=1, etp=1):
    """What the plan and the cost model count of one Mamba layer (model.kind_facts). The SSD (chunk c, state s, head
    dim p), per head: intra-chunk scores and values 2 x (c / 2) x (s + p), state in and out 2 x 2 x s x p, x3. Saved:
    in_proj's input and output, the scan's input and output, the gated norm's rstd. cp exchanges in_proj's rows
    (z x B C dt) for whole rows of 1 / cp of the heads, and the scan's output back: two all-to-alls a pass."""
    H, P, N, c, D = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.chunk_size, cfg.hidden_size
    d_in, gn = H * P, cfg.n_groups * N
    return {"flops": 3 * H * (c * (N + P) + 4 * N * P), "idle": 0,
            "saved": (2 * T * D + 2 * T * (2 * d_in + 2 * gn + H) / tp + 2 * 2 * T * d_in / tp
                      + 4 * T * cfg.n_groups / tp),
            "exchange": 2 * 2 * T * (2 * d_in + 2 * gn + H) / tp,
            "sends": {"tp": (2 * (tp - 1) / tp * 2 * T * D, 1),
                      "cp": ((cp - 1) / cp * (2 * T * (3 * d_in + 2 * gn + H) / tp), 2)}}


def causal_conv1d_ref(x_BLC, w_CW, bias_C, seq_idx=None):
    """Depthwise causal conv over time; with seq_idx, taps that reach into another document are zeroed."""
    L, W = x_BLC.shape[1], w_CW.shape[1]
    if seq_idx is None:
        y = F.conv1d(x_BLC.transpose(1, 2), w_CW.unsqueeze(1), bias_C, padding=W - 1, groups=w_CW.shape[0])
        return y[..., :L].transpose(1, 2)
    y = bias_C.expand_as(x_BLC).clone()
    for k in range(W):  # tap k reads x[t - (W-1-k)]
        shift = W - 1 - k
        if shift >= L:
            continue
        x_shift = F.pad(x_BLC, (0, 0, shift, 0))[:, :L]
        same_doc = seq_idx == F.pad(seq_idx, (shift, 0), value=-1)[:, :L]
        y = y + x_shift * w_CW[:, k] * same_doc[..., None]
    return y


def gated_rms_norm(y_BLI, z_BLI, weight_I, ngroups, eps):
    """RMSNorm(y * silu(z)) over groups of d_inner/ngroups channels, in fp32 (norm_before_gate=False)."""
    y = y_BLI.float() * F.silu(z_BLI.float())
    shape = y.shape
    y = y.reshape(*shape[:-1], ngroups, -1)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return y.reshape(shape) * weight_I.float()


def segsum(a):
    """a[..., T] -> S[..., T, T], S[i, j] = sum_{k=j+1..i} a[k] for i >= j, -inf above the diagonal."""
    T = a.shape[-1]
    a = a[..., None].expand(*a.shape, T)
    a = a.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), -1), 0)
    s = torch.cumsum(a, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device)), -torch.inf)


def ssd_chunked(x, dt, A, B, C, chunk, seq_idx=None):
    """Chunked SSD. x [b,L,h,p], dt [b,L,h] (after softplus), A [h], B/C [b,L,g,n] -> y [b,L,h,p] (no D term).

    Document resets (seq_idx [b,L], non-decreasing) are masks on the decay matrices: a contribution from
    position s to position t survives only when both lie in the same document, which is exact because
    documents are contiguous. Padded tail steps get x = 0 and dt = 0 (no input, no decay).
    """
    b, L, h, p = x.shape
    rep = h // B.shape[2]
    B = B.repeat_interleave(rep, dim=2)  # head i reads group i // (h/g)
    C = C.repeat_interleave(rep, dim=2)
    pad = (-L) % chunk
    if seq_idx is None:
        seq_idx = torch.zeros(b, L, dtype=torch.long, device=x.device)
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
        seq_idx = torch.cat([seq_idx, seq_idx[:, -1:].expand(b, pad)], 1)
    c = x.shape[1] // chunk
    X = (x * dt[..., None]).reshape(b, c, chunk, h, p)
    Ad = (dt * A).reshape(b, c, chunk, h).permute(0, 3, 1, 2)          # [b,h,c,Q]
    B, C = B.reshape(b, c, chunk, h, -1), C.reshape(b, c, chunk, h, -1)
    doc = seq_idx.reshape(b, c, chunk)
    A_cs = torch.cumsum(Ad, dim=-1)
    # 1. within a chunk
    same = (doc[..., :, None] == doc[..., None, :])[:, None]              # [b,1,c,Q,Q]
    Lmat = torch.exp(segsum(Ad)) * same
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, Lmat, X)
    # 2. state at the end of each chunk, from positions in the chunk's last document
    last = doc[..., -1:]                                                  # [b,c,1]
    decay = torch.exp(A_cs[..., -1:] - A_cs) * (doc == last)[:, None]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay, X)
    # 3. pass states across chunks, only while the document continues
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(segsum(F.pad(A_cs[..., -1], (1, 0))))       # [b,h,c+1,c+1]
    end_doc = torch.cat([torch.full_like(last[:, :1, 0], -1), last[..., 0]], 1)  # doc at end of chunk z-1
    chunk_decay = chunk_decay * (end_doc[:, :, None] == end_doc[:, None, :])[:, None]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]
    # 4. carry the incoming state into each position of its document
    carry = torch.exp(A_cs) * (doc == end_doc[:, :-1, None])[:, None]     # [b,h,c,Q]
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, carry)
    return (Y_diag + Y_off).reshape(b, c * chunk, h, p)[:, :L]

