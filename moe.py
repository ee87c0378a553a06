"""Mixture of experts: sigmoid router with expert bias, squared-ReLU experts, shared expert, EP/ETP dispatch.

Token flow of one MoE layer (x is replicated over the language tp group, as every activation between layers):
  router on all tokens (fp32, replicated)            -> topk ids [T, K], weights [T, K], seq aux loss (via grad)
  each tp rank keeps its 1/tp slice of the tokens     -> distinct tokens per rank, so ep/etp peers share work
  LatentMoE (moe_latent_size): fc1_latent_proj of the slice -> the routed rows are latent-wide (Z < D)
  dispatch: sort by expert, all_to_all over ep (+ all-gather over etp), grouped GEMM, and back
  combine: weight on the sender, sum each token's k rows (a gather); LatentMoE: fc2_latent_proj back to D;
           all-gather the tp slices
  + shared expert (tensor parallel like a dense MLP)

Shape suffixes (x_TD is [T, D]): B batch, L sequence (this cp rank's positions of it), D hidden size, E routed
experts, F expert ffn width, T tokens (B x L, or this tp rank's slice of them), K experts per token, R routed rows
(one per token and choice, sorted by expert), S source ranks of the exchange, J this rank's experts (E / ep), G
groups of a grouped GEMM (this rank's experts), I and O a grouped GEMM's input and output widths (Z and F, or F and
Z), Z the width the experts read and write (moe_latent_size under LatentMoE, else D).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import comm
import fused


class Router(nn.Module):
    def __init__(self, cfg, cp_group=None):
        super().__init__()
        self.cp_group = cp_group    # the balance loss's sequences span the cp ranks (seq_aux_loss)
        E, self.top_k, self.scale = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.aux_coeff = cfg.moe_aux_loss_coeff
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))
        # Expert bias: chosen by the balancing rule, never by the optimizer; kept fp32 (HF name).
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
        self.aux_loss_scale = 1.0  # set per step by set_aux_loss_scale
        self.force_balance = cfg.moe_force_balance  # benchmarks only: token t takes experts t*K .. t*K+K-1 mod E

    def forward(self, x_BLD, valid_BL=None):
        """-> topk ids [B*L, K] (int64), routing weights [B*L, K] (fp32, differentiable)."""
        Bsz, L, _ = x_BLD.shape
        with torch.autocast(x_BLD.device.type, enabled=False):  # fp32 routing: autocast would run it in bf16
            scores = torch.sigmoid(F.linear(x_BLD.reshape(Bsz * L, -1).float(), self.weight.float()))
        topk_idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices  # bias: choice only
        if self.force_balance:   # the same kernels and shapes, every expert the same rows (Megatron's and
            E, K = scores.shape[1], self.top_k  # Automodel's benchmark routers force balance too)
            topk_idx = (torch.arange(Bsz * L * K, device=scores.device) % E).view(Bsz * L, K)
        picked = scores.gather(-1, topk_idx)
        topk_w = self.scale * picked / (picked.sum(-1, keepdim=True) + 1e-20)
        if self.training and torch.is_grad_enabled() and self.aux_coeff > 0:
            aux = seq_aux_loss(scores.view(Bsz, L, -1), self.top_k, self.aux_coeff, valid_BL, self.cp_group)
            topk_w = AuxLossInjector.apply(topk_w, aux, self.aux_loss_scale)
        return topk_idx, topk_w


def seq_aux_loss(scores_BLE, top_k, coeff, valid_BL=None, cp_group=None):
    """DeepSeek-V3 sequence-wise balance loss: coeff/B * sum_b sum_i f_bi * P_bi (bias-free scores).
    Under a padding mask, T of each sequence is its count of valid tokens. Under context parallelism the scores are
    this rank's positions of each sequence: f and T (no gradient) are summed over cp first, P is this rank's share of
    the sum over positions, so the ranks' losses add up to the whole sequences' loss, and so do their gradients."""
    Bsz, L, E = scores_BLE.shape
    s_hat = scores_BLE / (scores_BLE.sum(-1, keepdim=True) + 1e-20)
    chosen = torch.zeros_like(s_hat).scatter_(-1, torch.topk(s_hat, top_k, dim=-1).indices, 1.0)
    w = torch.ones(Bsz, L, 1, device=s_hat.device) if valid_BL is None else valid_BL[..., None].float()
    counts = torch.cat([(chosen * w).sum(1), w.sum(1)], 1)     # [B, E + 1]: choices per expert, tokens
    if comm.group_size(cp_group) > 1:
        dist.all_reduce(counts, group=cp_group)
    T = counts[:, E:].clamp_min(1)           # [B, 1]
    f = counts[:, :E] * E / (top_k * T)      # [B, E], no gradient
    P = (s_hat * w).sum(1) / T               # [B, E]
    return coeff * (f * P).sum() / Bsz


class AuxLossInjector(torch.autograd.Function):
    """Pass `x` through; in backward add d(scale * aux)/d(theta) (Megatron's MoEAuxLossAutoScaler): the aux loss
    never enters the loss scalar; `scale` weighs it against how the main loss is backpropagated (set_aux_loss_scale).
    """

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def set_aux_loss_scale(model, scale):
    """The training loop backpropagates sum(token losses) and divides gradients by N_global afterwards; an aux
    weight of 1 / (micro-batches x lanes) in the objective therefore needs scale = N_global / (M x lanes)."""
    for m in model.modules():
        if isinstance(m, Router):
            m.aux_loss_scale = scale


class MLP(nn.Module):
    """relu(up(x))^2 -> down, no bias, no gate. Column/row parallel over tp (dense '-' layer, shared expert)."""

    def __init__(self, hidden, ffn, tp_group=None):
        super().__init__()
        self.tp_group = tp_group
        local = ffn // comm.group_size(tp_group)
        self.up_proj = nn.Linear(hidden, local, bias=False)
        self.down_proj = nn.Linear(local, hidden, bias=False)
        comm.mark_shard(self.up_proj.weight, ("tp", 0, None))
        comm.mark_shard(self.down_proj.weight, ("tp", 1, None))

    def forward(self, x, seq_idx=None, valid_BL=None):
        x = comm.copy_to(x, self.tp_group)
        return comm.reduce_from(relu2_linear(self.up_proj(x), self.down_proj), self.tp_group)


def mlp_facts(cfg, seq_len, T=0, tp=1, cp=1, ep=1, etp=1):
    """What the plan and the cost model count of one dense MLP layer (model.kind_facts): its saved inputs, x and
    the up projection's output (relu2_down recomputes the squared ReLU)."""
    D = cfg.hidden_size
    return {"flops": 0, "idle": 0, "saved": 2 * T * D + 2 * T * cfg.intermediate_size / tp, "exchange": 0,
            "sends": {"tp": (2 * (tp - 1) / tp * 2 * T * D, 1)}}


def relu2_linear(h, lin):
    """lin(relu(h)^2) for a bias-free nn.Linear `lin` through relu2_down (saving h, not relu(h)^2), its LoRA adapter
    (lora.py) applied here as lora.add_adapter would: the module is not called, so its forward hook does not run."""
    h_RI = h.reshape(-1, h.shape[-1])
    if not hasattr(lin, "lora_A"):
        (y,) = relu2_down(h_RI, None, lin.weight)
    else:
        y, z = relu2_down(h_RI, None, lin.weight, lin.lora_A)
        y = y + F.linear(z, lin.lora_B) * lin.lora_scale
    return y.view(*h.shape[:-1], -1)


def relu2_down(h_RI, counts, *w_GOI):
    """relu(h)^2 times each weight given, -> a tuple of outputs [R, O]: grouped like grouped_mm (counts rows a
    group), or counts None: one dense weight [O, I] each. The weights are the down projection's and a LoRA
    adapter's A, which reads the same squared ReLU."""
    if h_RI.is_cuda and torch.is_autocast_enabled("cuda"):  # the GEMMs inside run in autocast's dtype
        h_RI = h_RI.to(torch.get_autocast_dtype("cuda"))
    return _Relu2Down.apply(h_RI, counts, *w_GOI)


class _Relu2Down(torch.autograd.Function):
    """relu2_down, saving h and not relu(h)^2 ([R, I] less a layer: the down projection's weight gradient was what
    kept it). The price is one pointwise pass over [R, I] in backward, recomputing relu(h)^2 for the weights'
    gradients; d/dh = grad * 2 relu(h) is a pass over [R, I] as autograd's would be."""

    @staticmethod
    def forward(ctx, h_RI, counts, *w_GOI):
        a_RI = fused.squared_relu(h_RI)
        ctx.dtypes = [w.dtype for w in w_GOI]
        w_GOI = [w.to(a_RI.dtype) for w in w_GOI]   # the cast autocast would make, kept for backward as it keeps it
        ctx.save_for_backward(h_RI, counts, *w_GOI)
        return tuple(_down(a_RI, w, counts) for w in w_GOI)

    @staticmethod
    def backward(ctx, *grad_RO):
        h_RI, counts, *w_GOI = ctx.saved_tensors
        grad_RO = [g.contiguous() for g in grad_RO]   # an expanded gradient would not suit the grouped GEMM
        grad_h = None
        if ctx.needs_input_grad[0]:
            grad_a = sum(_down(g, w.transpose(-2, -1), counts) for g, w in zip(grad_RO, w_GOI))
            grad_h = fused.squared_relu_grad(h_RI, grad_a)
            del grad_a   # before the recompute: two [R, I] beside h at most
        grad_w = [None] * len(w_GOI)
        if any(ctx.needs_input_grad[2:]):
            a_RI = fused.squared_relu(h_RI)   # the recompute
            grad_w = [_down_weight_grad(g, a_RI, counts).to(dtype) if needed else None
                      for g, dtype, needed in zip(grad_RO, ctx.dtypes, ctx.needs_input_grad[2:])]
        return grad_h, None, *grad_w


def _down(a_RI, w_GOI, counts):
    return F.linear(a_RI, w_GOI) if counts is None else grouped_mm(a_RI, w_GOI, counts)


def _down_weight_grad(g_RO, a_RI, counts):
    return g_RO.T @ a_RI if counts is None else grouped_mm_weight_grad(g_RO, a_RI, counts)


class Experts(nn.Module):
    """This rank's E/ep experts, stacked for grouped GEMM; each holds an F/etp slice of the ffn width. They read and
    write rows of the hidden size, or of the latent width under LatentMoE."""

    def __init__(self, cfg, ep_group=None, etp_group=None):
        super().__init__()
        n_local = cfg.n_routed_experts // comm.group_size(ep_group)
        f_local = cfg.moe_intermediate_size // comm.group_size(etp_group)
        width = cfg.moe_latent_size or cfg.hidden_size
        self.up_proj = nn.Parameter(torch.empty(n_local, f_local, width))
        self.down_proj = nn.Parameter(torch.empty(n_local, width, f_local))
        comm.mark_shard(self.up_proj, ("ep", 0, None), ("etp", 1, None))
        comm.mark_shard(self.down_proj, ("ep", 0, None), ("etp", 2, None))

    def forward(self, x_RZ, counts):
        """x sorted by local expert, counts [n_local] rows per expert -> partial outputs (summed over etp later)."""
        lora = (self.lora_scale, self.lora_up_A, self.lora_up_B, self.lora_down_A, self.lora_down_B) \
            if hasattr(self, "lora_scale") else None   # lora.py's adapters, one pair per expert and projection
        return expert_ffn(x_RZ, self.up_proj, self.down_proj, counts, lora)


def expert_ffn(x_RZ, w_up, w_down, counts, lora=None):
    """up -> squared ReLU -> down for rows grouped by expert (counts rows each), one grouped GEMM per projection,
    the down one through relu2_down (saving up's output, not the squared ReLU); lora (scale, up A, up B, down A,
    down B): + scale * B (A x) on each projection, grouped the same way (down's A inside relu2_down)."""
    h_RF = grouped_mm(x_RZ, w_up, counts)
    if lora is None:
        (y_RZ,) = relu2_down(h_RF, counts, w_down)
        return y_RZ
    h_RF = h_RF + lora[0] * grouped_mm(grouped_mm(x_RZ, lora[1], counts), lora[2], counts)
    y_RZ, z_Rr = relu2_down(h_RF, counts, w_down, lora[3])
    return y_RZ + lora[0] * grouped_mm(z_Rr, lora[4], counts)


def grouped_mm(x_RI, w_GOI, counts):
    """Rows of group g times w[g]^T; counts: rows per group, an int tensor. bf16 CUDA: one torch grouped GEMM whose
    offsets stay on the device (counts on the host would cost a stream sync for the copy); else a loop over groups."""
    if x_RI.is_cuda and torch.is_autocast_enabled("cuda"):  # grouped_mm is not autocast-aware
        x_RI = x_RI.to(torch.get_autocast_dtype("cuda"))
    if x_RI.is_cuda and x_RI.dtype == torch.bfloat16 and hasattr(F, "grouped_mm"):
        offs = torch.cumsum(counts.to(x_RI.device), 0, dtype=torch.int32)
        return F.grouped_mm(x_RI, w_GOI.to(x_RI.dtype).transpose(-2, -1), offs=offs)
    parts = [x @ w.to(x.dtype).T for x, w in zip(torch.split(x_RI, counts.tolist()), w_GOI)]
    return torch.cat(parts) if parts else x_RI.new_zeros(0, w_GOI.shape[1])


def grouped_mm_weight_grad(g_RO, x_RI, counts):
    """grouped_mm's gradient in its weight, [G, O, I]: group g's rows of g^T x (zeros for a group of no rows). bf16
    CUDA: the grouped GEMM whose 2-D operands share the grouped dimension, as torch's grouped_mm backward runs it."""
    if x_RI.is_cuda and x_RI.dtype == torch.bfloat16 and hasattr(F, "grouped_mm"):
        offs = torch.cumsum(counts.to(x_RI.device), 0, dtype=torch.int32)
        return F.grouped_mm(g_RO.T, x_RI, offs=offs)
    rows = counts.tolist()
    return torch.stack([g.T @ x for g, x in zip(torch.split(g_RO, rows), torch.split(x_RI, rows))])


class MoE(nn.Module):
    def __init__(self, cfg, tp_group=None, ep_group=None, etp_group=None, dispatcher="alltoall", cp_group=None):
        super().__init__()
        self.tp_group, self.ep_group, self.etp_group = tp_group, ep_group, etp_group
        self.num_experts = cfg.n_routed_experts
        self.gate = Router(cfg, cp_group)
        self.experts = Experts(cfg, ep_group, etp_group)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, tp_group)
        if cfg.moe_latent_size:   # LatentMoE (Nemotron 3 Super): the routed rows travel and meet their experts in
            # the latent width. The projections run on this tp rank's token slice (replicated weights whose
            # gradient is a partial sum per tp rank: optim.py sums it over tp), so they add no collective
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, bias=False)
            for lin in (self.fc1_latent_proj, self.fc2_latent_proj):
                lin.weight.tp_partial = comm.group_size(tp_group) > 1
        self.deepep = DeepEPDispatch(ep_group, self.num_experts) if dispatcher == "deepep" else None

    def forward(self, x_BLD, valid_BL=None, seq_idx=None):
        Bsz, L, D = x_BLD.shape
        topk_idx, topk_w = self.gate(x_BLD, valid_BL)
        valid_T = None if valid_BL is None else valid_BL.reshape(-1)
        x_TD = x_BLD.reshape(Bsz * L, D)
        tp = comm.group_size(self.tp_group)
        if tp > 1:  # each tp rank routes its own token slice; backward all-gathers so upstream grads are whole
            if (Bsz * L) % tp:
                raise ValueError(f"MoE with tp={tp} needs batch*seq ({Bsz * L}) divisible by tp")
            rank = comm.group_rank(self.tp_group)
            x_TD = comm.split_dim(x_TD, 0, self.tp_group)
            topk_w = comm.split_dim(topk_w, 0, self.tp_group)
            topk_idx = topk_idx.chunk(tp)[rank]
            valid_T = None if valid_T is None else valid_T.chunk(tp)[rank]
        # Bias-influenced choices, counted once per token: not again when activation checkpointing recomputes
        # this forward inside backward (graph task id != -1 only while autograd runs).
        if self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            K = topk_idx.shape[1]
            weight = torch.ones(topk_idx.numel(), device=topk_idx.device) if valid_T is None else \
                valid_T[:, None].expand(-1, K).reshape(-1).float()         # padding is routed, not counted
            self.gate.tokens_per_expert += count_per_expert(topk_idx.reshape(-1), self.num_experts, weight)
        latent = hasattr(self, "fc1_latent_proj")
        x_TZ = self.fc1_latent_proj(x_TD) if latent else x_TD
        y_TZ = (self.deepep or self._alltoall_dispatch)(x_TZ, topk_idx, topk_w, self.experts)
        y_TD = comm.all_gather_dim(self.fc2_latent_proj(y_TZ) if latent else y_TZ, 0, self.tp_group)
        return y_TD.view(Bsz, L, D) + self.shared_experts(x_BLD)

    def _alltoall_dispatch(self, x_TZ, topk_idx, topk_w, experts):
        """Dropless dispatch; routing weights stay on the sender and apply in the combine after the return trip."""
        K = topk_idx.shape[1]
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)                 # grouped by expert = by destination rank
        unorder = inverse_permutation(order)
        x_send = _GatherRouted.apply(x_TZ, order, unorder, K)    # row i = token order[i] // K
        cnt = count_per_expert(flat, self.num_experts, torch.ones_like(flat))
        if comm.group_size(self.ep_group) * comm.group_size(self.etp_group) == 1:
            y_back = experts(x_send, cnt)                        # one source: no exchange, no host sync
        else:
            y_back = self._exchange(x_send, cnt, experts)
        return _CombineRouted.apply(y_back, topk_w, order, unorder)

    def _exchange(self, x_send, cnt, experts):
        """Rows (sorted by global expert) to the ranks holding their experts, through them, and back."""
        ep, etp = comm.group_size(self.ep_group), comm.group_size(self.etp_group)
        n_local = self.num_experts // ep
        cnt_recv = cnt.view(ep, n_local).clone()                 # [source ep rank, local expert]
        if ep > 1:
            dist.all_to_all_single(cnt_recv, cnt.view(ep, n_local).contiguous(), group=self.ep_group)
        cnt_src = cnt_recv
        if etp > 1:  # etp peers hold other ffn slices of the same experts: everyone will see everyone's rows
            gathered = [torch.empty_like(cnt_recv) for _ in range(etp)]
            dist.all_gather(gathered, cnt_recv, group=self.etp_group)
            cnt_src = torch.cat(gathered)                        # [(etp source, ep source), local expert]
        # The one host sync of the layer: every split size below comes from this single copy.
        cnt_h, src_h = torch.cat([cnt, cnt_src.reshape(-1)]).cpu().split([cnt.numel(), cnt_src.numel()])
        src_h = src_h.view(etp, ep, n_local)
        in_splits = cnt_h.view(ep, n_local).sum(1).tolist()
        out_splits = src_h[comm.group_rank(self.etp_group)].sum(1).tolist()
        x_recv = comm.all_to_all(x_send, out_splits, in_splits, self.ep_group)
        if etp > 1:
            sizes = src_h.sum((1, 2)).tolist()
            x_recv = comm.all_to_all(x_recv.repeat(etp, 1), sizes, [x_recv.shape[0]] * etp, self.etp_group)
        perm = _source_to_expert_order(cnt_src, int(src_h.sum()))
        inv_perm = inverse_permutation(perm)
        y_exp = experts(_PermuteRows.apply(x_recv, perm, inv_perm), cnt_src.sum(0))
        y_recv = _PermuteRows.apply(y_exp, inv_perm, perm)
        if etp > 1:  # sum the ffn-slice partials and keep own rows (the adjoint of the gather above)
            n_own = sum(out_splits)
            y_recv = comm.all_to_all(y_recv, [n_own] * etp, sizes, self.etp_group).view(etp, n_own, -1).sum(0)
        return comm.all_to_all(y_recv, in_splits, out_splits, self.ep_group)


def moe_facts(cfg, seq_len, T=0, tp=1, cp=1, ep=1, etp=1):
    """What the plan and the cost model count of one MoE layer (model.kind_facts), routing balanced (T x k / tp rows a
    rank): idle, the routed experts a token does not run; saved, the input, the fp32 router input, scores and
    sigmoid, the shared expert's input and up projection, the routed rows in and out and the experts' up projection
    (relu2_down recomputes the squared ReLU), the combined rows, all-gathered over tp (LatentMoE: fc1's input slice
    and fc2's input too); sends: the shared expert's all-reduce and the rows' all-gather over tp, the dispatch and
    combine over ep (and their all-gathers over etp)."""
    K, E, D, F = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    Z = cfg.moe_latent_size or D
    latent = 2 * T * (D + Z) / tp if cfg.moe_latent_size else 0
    routed = 2 * T * K / tp * Z   # a rank's routed rows, bf16
    return {"flops": 0, "idle": (E - K) * 2 * Z * F,
            "saved": (2 * T * D + 4 * T * D + 4 * 2 * T * E + 2 * T * cfg.moe_shared_expert_intermediate_size / tp
                      + 2 * (T * K / tp) * etp * (2 * Z + F / etp) + 2 * T * D / tp + 2 * T * D + latent),
            "exchange": 0,
            "sends": {"tp": ((2 * (tp - 1) / tp + (tp - 1) / tp) * 2 * T * D, 2),
                      "ep": (2 * ((ep - 1) / ep + etp - 1) * routed, 2 * (ep * etp > 1))}}


def count_per_expert(ids, num_experts, weight):
    """Sum of `weight` per expert id. index_add, not bincount: bincount on CUDA waits for the GPU to size its output."""
    return weight.new_zeros(num_experts).index_add_(0, ids, weight)


def inverse_permutation(idx):
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(len(idx), device=idx.device)
    return inv


class _PermuteRows(torch.autograd.Function):
    """x[idx] for a permutation idx. Backward is again a gather (by the inverse), not an atomic scatter-add."""

    @staticmethod
    def forward(ctx, x, idx, inv):
        ctx.save_for_backward(inv)
        return x[idx]

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        return grad[inv], None, None


class _GatherRouted(torch.autograd.Function):
    """Routed copies x[order // K]; backward gathers the copies back to (token, k) order and sums over k."""

    @staticmethod
    def forward(ctx, x_TZ, order, unorder, K):
        ctx.save_for_backward(unorder)
        ctx.K = K
        return x_TZ[order // K]

    @staticmethod
    def backward(ctx, grad):
        (unorder,) = ctx.saved_tensors
        ones_TK = grad.new_ones(grad.shape[0] // ctx.K, ctx.K, dtype=torch.float32)
        return fused.sum_routed(grad.contiguous(), unorder, ones_TK), None, None, None


class _CombineRouted(torch.autograd.Function):
    """Routed rows (sorted by expert) back to tokens: out[t] = sum_k w[t, k] * y[unorder[t*K + k]] in one pass;
    both gradients are gathers again (no atomics)."""

    @staticmethod
    def forward(ctx, y_RZ, w_TK, order, unorder):
        ctx.save_for_backward(y_RZ, w_TK, order, unorder)
        return fused.sum_routed(y_RZ, unorder, w_TK)

    @staticmethod
    def backward(ctx, g_TZ):
        y_RZ, w_TK, order, unorder = ctx.saved_tensors
        g_TZ = g_TZ.contiguous()
        grad_y = fused.spread_to_routed(g_TZ, order, w_TK) if ctx.needs_input_grad[0] else None
        grad_w = fused.routed_dots(y_RZ, unorder, g_TZ) if ctx.needs_input_grad[1] else None
        return grad_y, grad_w, None, None


def _source_to_expert_order(cnt_SJ, R):
    """Rows arrive source-major (s, then local expert j); experts want (j, then s). Returns that gather index.
    R = cnt_SJ.sum(), known on the host already (no second sync)."""
    S, J = cnt_SJ.shape
    seg_len = cnt_SJ.T.reshape(-1)                               # segments in (j, s) order
    in_start = (torch.cumsum(cnt_SJ.reshape(-1), 0) - cnt_SJ.reshape(-1)).view(S, J).T.reshape(-1)
    out_start = torch.cumsum(seg_len, 0) - seg_len
    seg_id = torch.repeat_interleave(torch.arange(S * J, device=cnt_SJ.device), seg_len, output_size=R)
    return in_start[seg_id] + torch.arange(R, device=cnt_SJ.device) - out_start[seg_id]


class DeepEPDispatch:
    """DeepEP (V1 `Buffer`) intranode dispatch/combine behind the same call as the all_to_all path."""

    def __init__(self, ep_group, num_experts):
        try:
            import deep_ep
        except ImportError as e:
            raise SystemExit("--moe-dispatcher deepep needs the deep_ep package (DeepEP >= 1.1 built for this "
                             "torch/CUDA); it is not installed. Use --moe-dispatcher alltoall.") from e
        self.deep_ep, self.group, self.num_experts, self.buffer = deep_ep, ep_group, num_experts, None

    def __call__(self, x_TZ, topk_idx, topk_w, experts):
        if self.buffer is None:
            hidden_bytes = x_TZ.shape[1] * max(x_TZ.element_size(), 2)
            n = dist.get_world_size(self.group)
            cfgs = (self.deep_ep.Buffer.get_dispatch_config(n), self.deep_ep.Buffer.get_combine_config(n))
            nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, n) for c in cfgs)
            self.buffer = self.deep_ep.Buffer(self.group, nvl, 0)
        return _DeepEPRoundTrip.apply(x_TZ, topk_idx, topk_w, experts.up_proj, experts.down_proj, self)


class _DeepEPRoundTrip(torch.autograd.Function):
    """dispatch -> local experts (weighted by received probs) -> combine; backward mirrors it with the handle."""

    @staticmethod
    def forward(ctx, x_TZ, topk_idx, topk_w, w_up, w_down, disp):
        buf = disp.buffer
        n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(topk_idx, disp.num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x_TZ, topk_idx=topk_idx, topk_weights=topk_w.float(), num_tokens_per_rank=n_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_exp)
        with torch.enable_grad():
            recv_x = recv_x.detach().requires_grad_()
            recv_w = recv_w.detach().requires_grad_()
            w_up_, w_down_ = w_up.detach().requires_grad_(), w_down.detach().requires_grad_()
            y = _local_experts(recv_x, recv_idx, recv_w, w_up_, w_down_, counts)
        combined, _, _ = buf.combine(y.detach(), handle)
        ctx.save_for_backward(recv_x, recv_w, w_up_, w_down_, y)
        ctx.handle, ctx.buf = handle, buf
        return combined

    @staticmethod
    def backward(ctx, grad):
        recv_x, recv_w, w_up, w_down, y = ctx.saved_tensors
        grad_y, _, _, _, _, _ = ctx.buf.dispatch(grad.contiguous(), handle=ctx.handle)
        gx, gw, gup, gdown = torch.autograd.grad(y, (recv_x, recv_w, w_up, w_down), grad_y)
        grad_x, grad_w, _ = ctx.buf.combine(gx, ctx.handle, topk_weights=gw)
        return grad_x, None, grad_w, gup, gdown, None


def _local_experts(recv_x, recv_idx, recv_w, w_up, w_down, counts):
    """Rows received from DeepEP (one per token and rank; local expert ids, -1 = not here) through the experts.
    counts (rows per local expert) is DeepEP's host list, so nothing here waits for the GPU: the -1 slots sort
    last and the first sum(counts) of the order are the routed ones."""
    K = recv_idx.shape[1]
    flat = recv_idx.reshape(-1)
    order = torch.argsort(torch.where(flat >= 0, flat, len(counts)), stable=True)[:sum(counts)]
    rows = order // K
    cnt = torch.tensor(counts, dtype=torch.int64)
    if recv_x.is_cuda:   # from pinned memory the copy does not wait for the stream
        cnt = cnt.pin_memory().to(recv_x.device, non_blocking=True)
    out = expert_ffn(recv_x[rows], w_up, w_down, cnt)
    out = out * recv_w.reshape(-1)[order, None].to(recv_x.dtype)
    return torch.zeros_like(recv_x).index_add(0, rows, out)


@torch.no_grad()
def update_expert_bias(model, rate=None, group=None):
    """Aux-loss-free balancing, once per optimizer step: b += rate * sign(mean - count), the counts summed over the
    language tp x dp x cp group first (each rank counted distinct tokens), then reset. -> the summed counts [MoE
    layers, E] (logged), or None without MoE layers. rate None (a dropped step): the counts reset, nothing else."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not routers or rate is None:
        for r in routers:
            r.tokens_per_expert.zero_()
        return None
    counts = torch.stack([r.tokens_per_expert for r in routers])
    if comm.group_size(group) > 1:
        dist.all_reduce(counts, group=group)
    for r, n in zip(routers, counts):
        r.e_score_correction_bias += rate * torch.sign(n.mean() - n)
        r.tokens_per_expert.zero_()
    return counts
