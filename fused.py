"""Memory-bound passes written once in plain PyTorch (docs/speed.md §2): eager on the CPU, one torch.compile'd kernel
each on CUDA, where eager every op ran as its own kernel with a full-size intermediate (the cross-entropy wrote and
re-read the fp32 logits about ten times). The norms' torch kernels already are one pass.

Shape suffixes: N token positions, V vocab (this rank's shard), T tokens of an MoE layer, K experts per token, R
routed rows (T x K, sorted by expert), D a row's width.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F


def compiled_on_cuda(fn, flat=False):
    """fn itself on CPU tensors; its torch.compile'd version on CUDA tensors, compiled at the first CUDA call (so
    importing costs nothing). flat: fn is elementwise on its tensors (all of x's shape, no other arguments),
    compiled once for every shape and rank by running it flattened, the lengths marked dynamic (Dynamo's automatic
    dynamic shapes compiled again at each new size and rank, seconds each); dynamic=False keeps a later recompile
    from guarding the views' bases and rank."""
    compiled = None

    @functools.wraps(fn)
    def call(x, *args, **kwargs):
        nonlocal compiled
        if not x.is_cuda:
            return fn(x, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False if flat else None)
        if not flat:
            return compiled(x, *args, **kwargs)
        flats = [t.reshape(-1) for t in (x, *args)]
        if x.numel() > 1:
            for t in flats:
                torch._dynamo.mark_dynamic(t, 0)
        return compiled(*flats).view(x.shape)
    return call


def rms_norm(x, weight, eps):
    """RMSNorm in the input's dtype (torch's kernel accumulates in fp32): autocast would hand the next GEMM an fp32
    tensor to cast back. Not compiled: 0.55 ms compiled (all host time) against 0.18 ms here, on one H100."""
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)


def layer_norm(x, norm):
    """nn.LayerNorm `norm` applied like rms_norm (0.68 ms under autocast, 0.29 ms here, on one H100)."""
    with torch.autocast(x.device.type, enabled=False):
        return F.layer_norm(x, norm.normalized_shape, norm.weight.to(x.dtype), norm.bias.to(x.dtype), norm.eps)


class RMSNorm(nn.Module):
    """The module around rms_norm: a weight of ones."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


@functools.partial(compiled_on_cuda, flat=True)
def squared_relu(x):
    """relu(x)^2 computed in fp32, returned in x's dtype: autocast would run square (pow) in fp32 and hand the next
    GEMM an fp32 [rows, ffn] tensor to cast back (measured: 5 ms of a 176 ms 20l step on one H100)."""
    return F.relu(x).float().square().to(x.dtype)


@functools.partial(compiled_on_cuda, flat=True)
def squared_relu_grad(x, grad):
    """d relu(x)^2 / dx times grad = grad * 2 relu(x), computed in fp32 like squared_relu, returned in x's dtype."""
    return (grad.float() * (2 * F.relu(x).float())).to(x.dtype)


# ---------------------------------------------------------------- cross-entropy on a vocab shard

@compiled_on_cuda
def logsumexp_and_pick(logits_NV, local_t_N):
    """Per row: logsumexp of this vocab shard (fp32) and the logit at local_t (the caller masks misses)."""
    z = logits_NV.float()
    return torch.logsumexp(z, -1), z.gather(-1, local_t_N[:, None]).squeeze(-1)


@compiled_on_cuda
def cross_entropy_grad(logits_NV, lse_N, local_t_N, hit_N, g_N):
    """d(loss)/d(logits) = (softmax - onehot(target)) * g per row, in the logits' dtype, one pointwise pass. lse:
    over the whole vocab; hit: the row's target lies in this shard."""
    cols = torch.arange(logits_NV.shape[-1], device=logits_NV.device)
    onehot = (cols[None, :] == local_t_N[:, None]) & hit_N[:, None]
    grad = (torch.exp(logits_NV.float() - lse_N[:, None]) - onehot.float()) * g_N[:, None]
    return grad.to(logits_NV.dtype)


# ---------------------------------------------------------------- MoE: routed rows <-> (token, k) order

@compiled_on_cuda
def sum_routed(y_RD, unorder_R, w_TK):
    """out[t] = sum_k w[t, k] * y[unorder[t*K + k]]: the routed copies of each token, weighted and summed (fp32
    accumulation). unorder maps (token, k) to its row in y."""
    T, K = w_TK.shape
    y_TKD = y_RD[unorder_R].view(T, K, -1).float()
    return (y_TKD * w_TK[..., None].float()).sum(1).to(y_RD.dtype)


@compiled_on_cuda
def spread_to_routed(g_TD, order_R, w_TK):
    """The adjoint of sum_routed in y: row i of the result is w.flat[order[i]] * g[order[i] // K]."""
    K = w_TK.shape[1]
    return (g_TD[order_R // K].float() * w_TK.reshape(-1)[order_R][:, None].float()).to(g_TD.dtype)


@compiled_on_cuda
def routed_dots(y_RD, unorder_R, g_TD):
    """The adjoint of sum_routed in w: [T, K] dot products of each routed copy with its token's gradient."""
    T = g_TD.shape[0]
    return (y_RD[unorder_R].view(T, -1, y_RD.shape[-1]).float() * g_TD[:, None, :].float()).sum(-1)
