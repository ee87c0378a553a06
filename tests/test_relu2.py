"""moe.relu2_down: the down projection over relu(h)^2 saves h and recomputes relu(h)^2 in backward. On CPU in fp32:
what autograd keeps (the squared ReLU gone), and outputs and gradients equal to up GEMM, relu(x)**2, down GEMM run
by autograd, for the routed experts (an expert without rows too), a whole MoE layer (the router's gradient), the
dense MLP, the vision projector, LoRA adapters on both projections, and the DeepEP path's local experts."""
import torch
import torch.nn.functional as F

import config
import fused
import lora
import model
import moe
import radio


def tiny_layer(kind, seed=0, **overrides):
    cfg = config.resolve("tiny", overrides)
    lm = model.LanguageModel(cfg)
    model.init_weights(lm, seed, {}, cfg)
    return cfg, next(b for b in lm.backbone.layers.values() if b.kind == kind).mixer


def plain_relu2_down(h_RI, counts, *w_GOI):
    """What relu2_down replaced: relu(h)^2, then each GEMM, all under autograd."""
    a_RI = F.relu(h_RI) ** 2
    return tuple(F.linear(a_RI, w) if counts is None else moe.grouped_mm(a_RI, w, counts) for w in w_GOI)


def saved_bytes(fn, module):
    """Bytes of the distinct storages autograd keeps for fn()'s backward, the module's parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(kept.values())


def grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


def test_squared_relu_is_not_kept(monkeypatch):
    """One MoE layer (tiny: 22 tokens x top 2 = 44 routed rows of ffn 32, a shared expert of 64) and one dense MLP:
    what they keep shrinks by the squared ReLU's [R, I] (CPU eager kept relu(h) and relu(h)^2, h is kept now),
    less the experts' row counts ([8] int64) that relu2_down keeps."""
    cfg, layer = tiny_layer("E", hybrid_override_pattern="E-")
    mlp = model.LanguageModel(cfg).backbone.layers["1"].mixer
    x = torch.randn(2, 11, cfg.hidden_size, requires_grad=True)
    R, T = 2 * 11 * cfg.num_experts_per_tok, 2 * 11
    after = saved_bytes(lambda: layer(x), layer), saved_bytes(lambda: mlp(x), mlp)
    monkeypatch.setattr(moe, "relu2_down", plain_relu2_down)
    before = saved_bytes(lambda: layer(x), layer), saved_bytes(lambda: mlp(x), mlp)
    gone = (4 * R * cfg.moe_intermediate_size + 4 * T * cfg.moe_shared_expert_intermediate_size
            - 8 * cfg.n_routed_experts, 4 * T * cfg.intermediate_size)
    assert (before, after) == ((53492, 16896), (42292, 11264)) and gone == (11200, 5632)
    assert tuple(b - a for b, a in zip(before, after)) == gone


def test_experts_equal_plain_autograd_with_an_empty_expert():
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 9, 3])
    x = torch.randn(17, 8, requires_grad=True)
    w_up = torch.randn(4, 6, 8, requires_grad=True)
    w_down = torch.randn(4, 8, 6, requires_grad=True)
    y = moe.expert_ffn(x, w_up, w_down, counts)
    g = torch.randn_like(y)
    ref = torch.cat([F.linear(F.relu(F.linear(xs, wu)) ** 2, wd)
                     for xs, wu, wd in zip(x.split(counts.tolist()), w_up, w_down)])
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    got, want = grads(y, (x, w_up, w_down), g), grads(ref, (x, w_up, w_down), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert got[1][1].abs().max() == 0 == got[2][1].abs().max()   # the expert without rows


def test_moe_layer_and_mlp_gradients_equal_plain_autograd(monkeypatch):
    """The whole MoE layer (router weight, experts, shared expert, input) and the dense MLP."""
    cfg, layer = tiny_layer("E", hybrid_override_pattern="E-")
    mlp = model.LanguageModel(cfg).backbone.layers["1"].mixer
    x = torch.randn(2, 11, cfg.hidden_size, requires_grad=True)
    g = torch.randn(2, 11, cfg.hidden_size)
    for module in (layer, mlp):
        params = [p for _, p in sorted(module.named_parameters())]
        out = module(x)
        got = grads(out, [x] + params, g)
        with monkeypatch.context() as m:
            m.setattr(moe, "relu2_down", plain_relu2_down)
            ref = module(x)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        for a, b in zip(got, grads(ref, [x] + params, g)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert layer.gate.weight.requires_grad


def test_lora_adapters_through_relu2_down(monkeypatch):
    """Adapters on the experts' and the MLP's down projections read the recomputed relu(h)^2: the adapted output
    and every trained gradient (A and B of up and down) equal the plain path's, and the squared ReLU is not kept."""
    cfg, layer = tiny_layer("E", hybrid_override_pattern="E-", lora_rank=2, lora_alpha=4)
    mlp = model.LanguageModel(cfg).backbone.layers["1"].mixer
    lora.apply({"language": layer}, cfg)
    lora.apply({"language": mlp}, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in list(layer.named_parameters()) + list(mlp.named_parameters()):
            if "lora_" in name:
                p.normal_()
    x = torch.randn(2, 11, cfg.hidden_size, requires_grad=True)
    g = torch.randn(2, 11, cfg.hidden_size)
    for module in (layer, mlp):
        trained = [p for _, p in sorted(module.named_parameters()) if p.requires_grad]
        assert len(trained) == {id(layer): 8, id(mlp): 4}[id(module)]   # A, B of each projection
        out = module(x)
        got = grads(out, [x] + trained, g)
        with monkeypatch.context() as m:
            m.setattr(moe, "relu2_down", plain_relu2_down)
            m.setattr(moe, "relu2_linear", lambda h, lin: lin(fused.squared_relu(h)))   # LoRA's own hook
            ref = module(x)
            before = saved_bytes(lambda: module(x), module)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        for a, b in zip(got, grads(ref, [x] + trained, g)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert saved_bytes(lambda: module(x), module) < before


def test_deepep_local_experts_gradients():
    """The DeepEP path runs its experts through expert_ffn too: the local step's gradients equal a per-row loop's."""
    torch.manual_seed(0)
    R, K, D, F_, E = 7, 3, 8, 5, 4
    recv_x, recv_w = torch.randn(R, D, requires_grad=True), torch.rand(R, K, requires_grad=True)
    recv_idx = torch.randint(-1, E, (R, K))
    w_up, w_down = torch.randn(E, F_, D, requires_grad=True), torch.randn(E, D, F_, requires_grad=True)
    counts = [int((recv_idx == e).sum()) for e in range(E)]
    out = moe._local_experts(recv_x, recv_idx, recv_w, w_up, w_down, counts)
    ref = torch.stack([sum((recv_w[r, k] * (F.relu(recv_x[r] @ w_up[e].T) ** 2 @ w_down[e].T)
                            for k, e in enumerate(recv_idx[r].tolist()) if e >= 0), torch.zeros(D))
                       for r in range(R)])
    g = torch.randn(R, D)
    for a, b in zip(grads(out, (recv_x, recv_w, w_up, w_down), g), grads(ref, (recv_x, recv_w, w_up, w_down), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pointwise_and_weight_gradient_helpers():
    torch.manual_seed(0)
    h = torch.randn(6, 5, requires_grad=True)
    g = torch.randn(6, 5)
    (want,) = torch.autograd.grad(fused.squared_relu(h), h, g)
    assert torch.equal(fused.squared_relu_grad(h.detach(), g), want)
    x, w, gy, counts = torch.randn(9, 4), torch.randn(3, 7, 4, requires_grad=True), torch.randn(9, 7), \
        torch.tensor([4, 0, 5])
    (want,) = torch.autograd.grad(moe.grouped_mm(x, w, counts), w, gy)
    torch.testing.assert_close(moe.grouped_mm_weight_grad(gy, x, counts), want, rtol=0, atol=1e-6)


def test_vision_projector(monkeypatch):
    """The projector (Linear, relu^2, Linear: radio.VisionModel.mlp1) runs through relu2_linear: the same output and
    gradients, its [Q, projector_hidden] squared ReLU not kept (4 image rows here: 16 patches after the 2 x 2 pixel
    shuffle)."""
    cfg = config.resolve("tiny")
    torch.manual_seed(0)
    vision = radio.VisionModel(cfg)
    grids = [(4, 4)]
    patches = [torch.randn(16, 3 * cfg.vit_patch ** 2)]
    params = [p for _, p in sorted(vision.named_parameters())]
    out = vision(patches, grids)
    g = torch.randn_like(out)
    got, after = grads(out, params, g), saved_bytes(lambda: vision(patches, grids), vision)
    monkeypatch.setattr(moe, "relu2_down", plain_relu2_down)
    ref = vision(patches, grids)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, grads(ref, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert saved_bytes(lambda: vision(patches, grids), vision) - after == 4 * 4 * cfg.projector_hidden
