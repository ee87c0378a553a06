"""Everything after backward, in one class (Megatron's distributed optimizer, by hand: docs/memory.md §1, the rules
it keeps docs/parallel.md §8), and the learning-rate schedule. train.py calls `norm, ok = opt.finish(n_tokens,
max_norm)`, then, if ok, `opt.step()`.

A data-parallel domain's trained parameters (vision dp, language dp-cp, experts' edp) are packed into buckets, each
with one persistent fp32 gradient buffer that a post-accumulate hook adds every micro-batch's gradient into
(`main_grad`, as Megatron), so the sum is fp32 whatever the weights' dtype. finish():
  1. tp-partial sums  adapters whose gradient is a partial sum per tp rank (lora.py `tp_partial`): all-reduced
  2. data parallel    sharded: reduce-scattered, a rank keeping the fp32 main weights and moments of its shard only;
                      replicated (--no-distributed-optimizer): all-reduced, the one-shard case of the same code
  3. norm             every element once (comm.counted_in_replica), fp64, one all-reduce over WORLD that also sums
                      every local copy, so an inf / nan on any rank makes every rank skip
  4. scale            the token count and clipping as one factor, which the fused AdamW applies as it reads each
                      gradient (grad_scale, GradScaler's hook): a pass over the gradients fewer
Checkpoints hold per-parameter state (gather_state, load), so a run resumes into any dp and either mode.
"""
import math

import torch
import torch.distributed as dist

import comm

BUCKET_BYTES = 64 * 2**20


def build(par, vision, lm, cfg, device):
    """The run's optimizer, on every rank (one that trains nothing still joins finish()'s collectives). Its fp32
    main weights start from the weights as they are (as Megatron's). Modules built otherwise than by init.py
    (bench.py, tests) are cast to weight_dtypes here."""
    opt = AdamW(domains(par, vision, lm), cfg.lr, cfg.weight_decay, device, cfg.distributed_optimizer,
                cfg.activation_checkpointing)
    dtypes = weight_dtypes(par, vision, lm, cfg, device)
    for m in (m for m in (vision, lm) if m is not None):
        for p in m.parameters():
            p.data = p.data.to(dtypes[id(p)])   # a no-op for init.py's weights and the aliased fp32 views
    return opt


def fp32_weights(sharded, domain_size, expert, cuda, checkpointing):
    """Whether trained weights stay fp32 as views of their main weights: replicated always; sharded, a one-shard
    bucket on the CPU, or on CUDA routed experts at edp 1 under --activation-checkpointing (their bf16 casts, made
    in moe.grouped_mm, are recomputed per layer: 16 bytes instead of 18, the same numbers)."""
    return not sharded or (domain_size == 1 and (not cuda or (expert and checkpointing)))


def _fp32_domain(group, params, sharded, cuda, checkpointing):
    return bool(params) and fp32_weights(sharded, comm.group_size(group), comm.is_expert(params[0]), cuda,
                                         checkpointing)


def weight_dtypes(par, vision, lm, cfg, device):
    """{id(param): the dtype it trains in}: bf16 on CUDA under the distributed optimizer, frozen ones included,
    but the trained weights that stay fp32 as views of their main weights (fp32_weights); fp32 otherwise."""
    cuda, sharded = device.type == "cuda", cfg.distributed_optimizer
    low = torch.bfloat16 if cuda and sharded else torch.float32
    out = {id(p): low for m in (vision, lm) if m is not None for p in m.parameters()}
    for group, _, params in domains(par, vision, lm):
        if _fp32_domain(group, params, sharded, cuda, cfg.activation_checkpointing):
            out.update((id(p), torch.float32) for p in params)
    return out


def domains(par, vision, lm):
    """(group, ModuleGroups, trained parameters) per data-parallel domain of the modules this rank holds."""
    out = []
    if vision is not None:
        out.append((par.vision.dp_cp, par.vision, [p for p in vision.parameters() if p.requires_grad]))
    if lm is not None:
        trained = [p for p in lm.parameters() if p.requires_grad]
        out.append((par.lm.dp_cp, par.lm, [p for p in trained if not comm.is_expert(p)]))
        out.append((par.lm.edp, par.lm, [p for p in trained if comm.is_expert(p)]))
    return out


class Bucket:
    """Parameters packed flat (offsets) and their fp32 gradient buffer, padded to n x shard; this rank owns [lo,
    lo + shard). values: {id(param): tensor} the main weights start from (default: the parameters)."""

    def __init__(self, params, group, groups, decay, sharded, fp32, values=None):
        self.params, self.group, self.groups, self.decay, self.sharded = params, group, groups, decay, sharded
        size, rank = comm.group_size(group), comm.group_rank(group)
        self.n = size if sharded else 1
        self.counts = sharded or rank == 0   # whose copy of the reduced gradient the norm counts
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.shard = -(-self.offsets[-1] // self.n)
        self.lo = rank * self.shard if sharded else 0
        self.main = self.local(values or {id(p): p.detach() for p in params})
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
        """This rank's fp32 shard of {id(param): full tensor}, zeros where a parameter is missing or for padding."""
        out = torch.zeros(self.shard, dtype=torch.float32, device=self.params[0].device)
        for p, a, b, s in self.segments():
            if id(p) in tensors:
                out[s:s + b - a] = tensors[id(p)].reshape(-1)[a:b]
        return out

    def gather(self, shard):
        if self.n == 1:
            return shard
        full = torch.empty(self.shard * self.n, dtype=shard.dtype, device=shard.device)
        comm.all_gather(full, shard.contiguous(), group=self.group)
        return full

    def split(self, full):
        """{id(param): view of the full bucket shaped like the parameter}."""
        return {id(p): full[off:off + p.numel()].view(p.shape) for p, off in zip(self.params, self.offsets)}

    def reduce(self):
        """The gradient buffer summed over the domain -> main.grad, this rank's shard of it."""
        if self.n > 1:
            self.main.grad = torch.empty_like(self.main)
            comm.reduce_scatter(self.main.grad, self.grad, group=self.group)
            return
        if comm.group_size(self.group) > 1:
            dist.all_reduce(self.grad, group=self.group)
        self.main.grad = self.grad


class AdamW:
    """AdamW (betas 0.9, 0.95; decay on >= 2-D parameters) over the buckets of every domain. `param_groups` are its
    inner torch AdamW's: train.py sets lr on them."""

    def __init__(self, domain_list, lr, weight_decay, device, sharded=True, checkpointing=False):
        self.lr, self.weight_decay, self.sharded = lr, weight_decay, sharded
        self.buckets, self.partial = [], []
        for group, groups, params in domain_list:
            fp32 = _fp32_domain(group, params, sharded, device.type == "cuda", checkpointing)
            for decay in (True, False):
                bucket, size = [], 0
                for p in (p for p in params if (p.ndim >= 2) == decay):
                    bucket.append(p)
                    size += p.numel() * 4
                    if size >= BUCKET_BYTES:
                        self.buckets.append(Bucket(bucket, group, groups, decay, sharded, fp32))
                        bucket, size = [], 0
                if bucket:
                    self.buckets.append(Bucket(bucket, group, groups, decay, sharded, fp32))
            partial = [p for p in params if getattr(p, "tp_partial", False)]
            if partial and groups.tp_size > 1:
                self.partial.append((groups.tp, partial))
        for p in self.params():
            p.register_post_accumulate_grad_hook(_accumulate_fp32)
        self.inner = self._inner()

    def _inner(self):
        groups = [{"params": [b.main for b in self.buckets if b.decay], "weight_decay": self.weight_decay},
                  {"params": [b.main for b in self.buckets if not b.decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95), fused=True) if groups else None

    @property
    def param_groups(self):   # AdamW.load_state_dict replaces its list
        return self.inner.param_groups if self.inner is not None else []

    def params(self):
        return [p for b in self.buckets for p in b.params]

    def finish(self, n_tokens, max_norm):
        """Steps 1-4 of the module docstring -> (norm of the divided gradients, ok); not ok: gradients dropped.
        Collective: every rank calls it once a step."""
        for b in self.buckets:
            for p in b.params:
                if getattr(p, "main_grad", None) is None:   # no micro-batch reached it (or a p.grad set outside):
                    p.grad_view.copy_(p.grad) if p.grad is not None else p.grad_view.zero_()   # it steps like zeros
                p.grad = p.main_grad = None
        for group, params in self.partial:   # one flat all-reduce of the adapters' partial sums
            flat = torch.cat([p.grad_view.reshape(-1) for p in params])
            dist.all_reduce(flat, group=group)
            for p, r in zip(params, flat.split([p.numel() for p in params])):
                p.grad_view.copy_(r.view_as(p.grad_view))
        counted, copies = [], []
        for b in self.buckets:
            b.reduce()
            for p, a, e, s in b.segments():
                piece = b.main.grad[s:s + e - a]
                (counted if b.counts and comm.counted_in_replica(p, b.groups) else copies).append(piece)
        n = max(n_tokens, 1)
        norm = _global_norm(counted, copies) / n   # the norm scales with the gradients
        ok = math.isfinite(norm)                   # the same value on every rank: all step or all skip
        if ok:
            factor = (min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0) / n   # max_norm 0: no clipping
            if self.inner is not None:   # the fused kernel divides each gradient by it (step 4)
                self.inner.grad_scale = None if factor == 1.0 else \
                    torch.tensor(1.0 / factor, device=self.buckets[0].main.device)
        else:
            self.zero_grad()
        return norm, ok

    def step(self):
        """AdamW on the shards, then every rank's updated shard into the model's weights (gathered in the weights'
        dtype: half the bytes of fp32 on CUDA, and the same rounding)."""
        if self.inner is None:
            return
        self.inner.step()
        with torch.no_grad():
            for b in (b for b in self.buckets if not b.alias):
                full = b.main if b.n == 1 else b.gather(b.main.to(b.params[0].dtype))
                torch._foreach_copy_(b.params, list(b.split(full).values()))

    def zero_grad(self):
        for b in self.buckets:
            b.main.grad = None
            for p in b.params:
                p.grad = p.main_grad = None

    def gather_state(self, wanted=None):
        """{id(param): {"main", "exp_avg", "exp_avg_sq": full fp32 (this rank's tp / ep slice) on the CPU, "step"}},
        for the parameters in `wanted` (ids; None: all). Collective over every bucket's group."""
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
        """fp32 main weights {id(param): full tensor} (and AdamW states alike, unless None) into this rank's shards.
        A parameter missing from `mains` keeps its main weights, one missing from `states` starts fresh."""
        if states is not None:
            self._split_by_age(states)
        sd = self.inner.state_dict() if self.inner is not None else {"state": {}}
        sd["state"] = {}
        in_order = [b for b in self.buckets if b.decay] + [b for b in self.buckets if not b.decay]   # _inner's order
        for i, b in enumerate(in_order):
            with torch.no_grad():
                for p, a, e, s in b.segments():
                    if id(p) in mains:
                        b.main[s:s + e - a] = mains[id(p)].reshape(-1)[a:e].float()
            if states is not None and id(b.params[0]) in states:   # split by age: all of the bucket has state, or none
                sd["state"][i] = {"step": states[id(b.params[0])]["step"],
                                  **{k: b.local({id(p): states[id(p)][k] for p in b.params})
                                     for k in ("exp_avg", "exp_avg_sq")}}
        if self.inner is not None:
            self.inner.load_state_dict(sd)

    def _split_by_age(self, states):
        """AdamW counts steps per bucket: every bucket whose parameters' saved states differ in age (none: 0) becomes
        one bucket per age, and the inner AdamW is rebuilt (it has no state yet). A domain's ranks split alike."""
        age = lambda p: float(states[id(p)]["step"]) if id(p) in states else 0.0   # noqa: E731
        out = []
        for b in self.buckets:
            ages = sorted({age(p) for p in b.params})
            if len(ages) == 1:
                out.append(b)
                continue
            values = b.split(b.gather(b.main))   # fp32, whatever the weights' dtype
            out += [Bucket([p for p in b.params if age(p) == a], b.group, b.groups, b.decay, b.sharded, b.alias,
                           values) for a in ages]
        if len(out) != len(self.buckets):
            self.buckets = out
            self.inner = self._inner()
        for p in self.params():   # a fresh parameter's state is none, not step 0
            if id(p) in states and age(p) == 0.0:
                del states[id(p)]


def _accumulate_fp32(p):
    """Post-accumulate hook: each micro-batch's gradient into its fp32 view of the bucket's gradient buffer at once
    (the sum over micro-batches is not rounded to bf16). main_grad is None until the step's first writes it."""
    if getattr(p, "main_grad", None) is None:
        p.main_grad = p.grad_view
        p.main_grad.copy_(p.grad)
    else:
        p.main_grad.add_(p.grad)
    p.grad = None


def _global_norm(counted, copies):
    """sqrt(sum of squares of `counted`) over every rank; the same all-reduce sums `copies` too, so an inf / nan
    anywhere makes the result nan on every rank."""
    local = torch.zeros(2, dtype=torch.float64, device=comm.device())
    if counted or copies:                  # counted first, so the norm is a prefix of one batched norm
        sq = torch.stack(torch._foreach_norm(counted + copies, dtype=torch.float64)) ** 2  # fp64: the same
        # value however the gradients are cut into pieces (shards)
        local[0] = sq[:len(counted)].sum()
        local[1] = sq.sum()
    dist.all_reduce(local)
    total, check = local.tolist()
    return math.sqrt(total) if math.isfinite(total) and math.isfinite(check) else float("nan")


# ---------------------------------------------------------------- the learning-rate schedule

def step_lr(cfg, counters):   # a skipped step does not advance the schedule
    return learning_rate(cfg, counters["good_steps"])


def schedule_change(cfg, saved, counters, where):
    """A resumed run whose flags change the LR schedule moves its LR at once (e.g. a longer --steps re-stretches the
    cosine): print the LR at the resume step under both."""
    now, before = step_lr(cfg, counters), step_lr(saved, counters)
    if now != before:
        print(f"{where}: the learning rate at step {counters['step'] + 1} is {now:.3g} (it was {before:.3g} under "
              "the saved schedule)", flush=True)


def learning_rate(cfg, it):
    """LR after `it` successful steps: linear warmup, then cosine / WSD / constant."""
    warm, end, tail = cfg.lr_warmup_iters, cfg.lr_decay_iters or cfg.steps, cfg.lr_wsd_decay_iters
    if it < warm:
        return cfg.lr * (it + 1) / warm
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "cosine":
        progress = min(max((it - warm) / max(end - warm, 1), 0.0), 1.0)
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    tail = tail or max((end - warm) // 10, 1)
    f = min(max((it - (end - tail)) / tail, 0.0), 1.0)          # 0 while stable, 1 at the end of the tail
    drop = f if cfg.lr_wsd_decay_style == "linear" else math.sqrt(f)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1 - drop)
