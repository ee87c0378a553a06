"""The optimizer: AdamW, plain or distributed (Megatron's distributed optimizer, written by hand on torch.distributed).

Distributed (the default): every trained parameter belongs to one data-parallel domain, the group over which its
gradient is summed (vision dp for the tower, language dp-cp for dense weights, edp for routed experts). A domain's
parameters are packed into buckets (flat, decay and no-decay apart, about BUCKET_BYTES each), each cut into equal
contiguous shards, one per rank of the domain. A rank keeps, for its shard only, the fp32 main weights
and the AdamW moments: 12 / dp bytes per parameter instead of 12. The step:
  reduce_scatter_grads  the bucket's fp32 gradient buffer -> reduce-scatter (SUM) over the domain -> this rank's shard
  (norm, clip: parallel.finalize_gradients on the shards; each element is counted once per model replica)
  step                  torch AdamW on the shards (elementwise, so the same numbers as unsharded AdamW), then the
                        updated shards are all-gathered and copied into the model's weights
On CUDA those weights are bf16 (2 bytes, and no autocast cast per micro-batch), and each accumulates its
micro-batch gradients into an fp32 `main_grad` (a hook, as Megatron does) so their sum is not rounded to bf16;
each main_grad is a view of its bucket's persistent fp32 gradient buffer, which is what gets reduce-scattered:
2 + 4 + 12 / dp bytes. A domain of one rank (experts at edp 1) has one shard, the whole bucket: 18 bytes, as
plain AdamW's 16 plus the bf16 copy autocast keeps of every trained fp32 weight for backward. Where a one-rank
bucket's weights stay fp32 they are views of its main weights (no second fp32 copy, nothing to gather): always on
the CPU, and on CUDA for routed experts under --activation-checkpointing, whose bf16 casts (made in
moe.grouped_mm) are then dropped after each layer and recomputed: 16 bytes instead of 18, the same numbers, one
cast more per micro-batch (fp32_weights). Frozen weights are bf16 on CUDA, fp32 on the CPU.
Why by hand, not FSDP2: the tower, dense and expert weights of one module step over three different groups, on two
different grids (hetero), next to hand-written TP / EP; a bucket over an explicit group is all that needs.
Checkpoints keep the per-parameter format (checkpoint.py): gather_state assembles full moments and fp32 main
weights, load takes this rank's shard of them, so a run resumes into any dp.
"""
import torch
import torch.distributed as dist

import comm

BUCKET_BYTES = 64 * 2**20
# torch 2.13 renamed these two (and warns on the old names), the CUDA image has torch 2.11
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def plain(modules, lr, weight_decay, device):
    """torch AdamW over the trainable parameters (--no-distributed-optimizer): fp32 weights, state and gradients."""
    decay, no_decay = [], []
    for m in modules:
        for p in m.parameters():
            if p.requires_grad:  # norms, biases, A_log, D, dt_bias are the 1-D parameters
                (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def build(par, vision, lm, cfg, device):
    """None where nothing trains; plain AdamW with --no-distributed-optimizer; else DistributedAdamW, and on CUDA
    bf16 weights (frozen ones too: they have no fp32 copy anywhere)."""
    modules = [m for m in (vision, lm) if m is not None]
    trains = any(p.requires_grad for m in modules for p in m.parameters())
    if not cfg.distributed_optimizer:
        return plain(modules, cfg.lr, cfg.weight_decay, device) if trains else None
    opt = DistributedAdamW(domains(par, vision, lm), cfg.lr, cfg.weight_decay, device,
                           cfg.activation_checkpointing) if trains else None
    if device.type == "cuda":   # after the fp32 main weights were taken from the fp32 initial weights
        aliased = {id(p) for b in opt.buckets if b.alias for p in b.params} if opt else set()
        for m in modules:
            for p in m.parameters():
                if id(p) not in aliased:
                    p.data = p.data.to(torch.bfloat16)
    return opt


def fp32_weights(domain_size, expert, cuda, checkpointing):
    """Whether trained weights stay fp32 as views of their main weights (see the module docstring)."""
    return domain_size == 1 and (not cuda or (expert and checkpointing))


def domains(par, vision, lm):
    """(group, ModuleGroups, trainable parameters) per data-parallel domain this rank is in."""
    out = []
    if vision is not None:
        out.append((par.vision.dp_cp, par.vision, [p for p in vision.parameters() if p.requires_grad]))
    if lm is not None:
        trained = [p for p in lm.parameters() if p.requires_grad]
        out.append((par.lm.dp_cp, par.lm, [p for p in trained if not comm.is_expert(p)]))
        out.append((par.lm.edp, par.lm, [p for p in trained if comm.is_expert(p)]))
    return out


class Bucket:
    """Parameters packed flat (offsets), padded to group size x shard; this rank owns [lo, lo + shard)."""

    def __init__(self, params, group, groups, decay, fp32):
        self.params, self.group, self.groups, self.decay = params, group, groups, decay
        self.n, rank = comm.group_size(group), comm.group_rank(group)
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.shard = -(-self.offsets[-1] // self.n)
        self.lo = rank * self.shard
        self.main = self.local({id(p): p.detach() for p in params})
        self.grad = torch.zeros(self.shard * self.n, dtype=torch.float32, device=self.main.device)
        for p, g in zip(params, self.split(self.grad).values()):
            p.grad_view = g   # its main_grad once a micro-batch reaches it (_accumulate_fp32)
        self.alias = fp32 and self.n == 1   # the weights become views of main: AdamW updates them in place
        if self.alias:
            for p, w in zip(params, self.split(self.main).values()):
                p.data = w

    def segments(self):
        """(parameter, start, end in the parameter's flat view, start in the shard) of every piece this rank owns."""
        for p, off in zip(self.params, self.offsets):
            a, b = max(off, self.lo), min(off + p.numel(), self.lo + self.shard)
            if a < b:
                yield p, a - off, b - off, a - self.lo

    def local(self, tensors):
        """This rank's fp32 shard of {id(param): full tensor} (zeros where the bucket is padding)."""
        out = torch.zeros(self.shard, dtype=torch.float32, device=self.params[0].device)
        for p, a, b, s in self.segments():
            out[s:s + b - a] = tensors[id(p)].reshape(-1)[a:b]
        return out

    def gather(self, shard):
        """All ranks' shards of this bucket, concatenated."""
        if self.n == 1:
            return shard
        full = torch.empty(self.shard * self.n, dtype=shard.dtype, device=shard.device)
        _all_gather(full, shard.contiguous(), group=self.group)
        return full

    def split(self, full):
        """{id(param): view of the full bucket shaped like the parameter}."""
        return {id(p): full[off:off + p.numel()].view(p.shape) for p, off in zip(self.params, self.offsets)}


class DistributedAdamW:
    """AdamW over the fp32 shards of the buckets of every domain; `param_groups` are its inner AdamW's (train.py
    sets lr on them)."""

    def __init__(self, domain_list, lr, weight_decay, device, checkpointing=False):
        self.buckets = []
        for group, groups, params in domain_list:
            fp32 = bool(params) and fp32_weights(comm.group_size(group), comm.is_expert(params[0]),
                                                 device.type == "cuda", checkpointing)
            for decay in (True, False):
                bucket, size = [], 0
                for p in (p for p in params if (p.ndim >= 2) == decay):
                    bucket.append(p)
                    size += p.numel() * 4
                    if size >= BUCKET_BYTES:
                        self.buckets.append(Bucket(bucket, group, groups, decay, fp32))
                        bucket, size = [], 0
                if bucket:
                    self.buckets.append(Bucket(bucket, group, groups, decay, fp32))
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(_accumulate_fp32)
        groups = [{"params": [b.main for b in self.buckets if b.decay], "weight_decay": weight_decay},
                  {"params": [b.main for b in self.buckets if not b.decay], "weight_decay": 0.0}]
        self.inner = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")

    @property
    def param_groups(self):   # AdamW.load_state_dict replaces its list
        return self.inner.param_groups

    def params(self):
        return [p for b in self.buckets for p in b.params]

    def reduce_scatter_grads(self):
        """SUM each bucket's gradients over its group into this rank's fp32 shard (main.grad); frees the
        parameters' gradients. A missing gradient is zeros (see parallel.allreduce_grads).
        Returns (counted, copies): the gradient pieces the global norm counts, and the other local ones."""
        counted, copies = [], []
        for b in self.buckets:
            for p in b.params:
                if getattr(p, "main_grad", None) is None:   # no micro-batch reached it (or a p.grad set outside)
                    p.grad_view.copy_(p.grad) if p.grad is not None else p.grad_view.zero_()
                p.grad = p.main_grad = None
            if b.n == 1:
                b.main.grad = b.grad
            else:
                b.main.grad = torch.empty_like(b.main)
                _reduce_scatter(b.main.grad, b.grad, group=b.group)
            for p, a, e, s in b.segments():
                piece = b.main.grad[s:s + e - a]
                (counted if comm.counted_in_replica(p, b.groups) else copies).append(piece)
        return counted, copies

    def shard_grads(self):
        return [b.main.grad for b in self.buckets if b.main.grad is not None]

    def step(self):
        """AdamW on the shards, then every rank's updated shard into the model's weights (gathered in the weights'
        dtype: bf16 on CUDA, half the bytes of the fp32 shards, and the same rounding as copying fp32 into them)."""
        self.inner.step()
        with torch.no_grad():
            for b in (b for b in self.buckets if not b.alias):
                full = b.main if b.n == 1 else b.gather(b.main.to(b.params[0].dtype))
                torch._foreach_copy_(b.params, list(b.split(full).values()))

    def zero_grad(self, set_to_none=True):
        for b in self.buckets:
            b.main.grad = None
            for p in b.params:
                p.grad = p.main_grad = None

    def gather_state(self, wanted=None):
        """{id(param): {"main", "exp_avg", "exp_avg_sq": full fp32 (this rank's tp / ep slice) on the CPU, "step"}},
        for the parameters in `wanted` (ids; None: all). Collective over every bucket's group (all ranks of the
        domains call it, in the same bucket order); only the wanted parameters are copied to the CPU."""
        out = {}
        for b in self.buckets:
            st = self.inner.state.get(b.main, {})
            step = st["step"].float().cpu() if "step" in st else torch.tensor(0.0)
            for key in ("main", "exp_avg", "exp_avg_sq"):
                shard = b.main.detach() if key == "main" else st.get(key, torch.zeros_like(b.main))
                for p, t in zip(b.params, b.split(b.gather(shard)).values()):
                    if wanted is None or id(p) in wanted:
                        out.setdefault(id(p), {"step": step.clone()})[key] = t.to("cpu", copy=True)
        return out

    def load(self, mains, states=None):
        """fp32 main weights {id(param): full tensor} (and, unless None, AdamW states alike) into this rank's
        shards. Parameters missing from `mains` keep their main weights, missing from `states` start fresh."""
        by_main = {id(b.main): b for b in self.buckets}
        sd = self.inner.state_dict()
        sd["state"] = {}
        for i, b in enumerate(by_main[id(t)] for g in self.inner.param_groups for t in g["params"]):
            if all(id(p) in mains for p in b.params):
                b.main.data.copy_(b.local({id(p): mains[id(p)].float() for p in b.params}))
            if states is not None and all(id(p) in states for p in b.params):
                sd["state"][i] = {"step": states[id(b.params[0])]["step"],
                                  **{k: b.local({id(p): states[id(p)][k] for p in b.params})
                                     for k in ("exp_avg", "exp_avg_sq")}}
        self.inner.load_state_dict(sd)


def _accumulate_fp32(p):
    """Post-accumulate hook: each micro-batch's gradient goes into its fp32 view of the bucket's gradient buffer
    at once (bf16 weights: the sum over micro-batches is not rounded to bf16; fp32 weights: the same additions
    autograd would do). main_grad is None until the step's first micro-batch writes it."""
    if getattr(p, "main_grad", None) is None:
        p.main_grad = p.grad_view
        p.main_grad.copy_(p.grad)
    else:
        p.main_grad.add_(p.grad)
    p.grad = None
