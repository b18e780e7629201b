"""LatentMoE's options (docs/math.md §4): routed scaling, renormalisation, grouped routing, the experts'
activation and the latent switch. Values and every gradient against a reference written here from the
equations, in every dispatch mode; the defaults unchanged; the counts of layout.py and flops.py; and
transformers' Kimi Linear MoE block reproduced by the matching options."""
import copy

import pytest
import torch

from k3cli.config import ConfigError, load_config
from k3cli.layers.moe import LatentMoE
from k3cli.models.k3_config import K3Config, MoEConfig
from k3cli.testing import assert_close, relative_rms_error

TOL = 1e-12            # fp64: max |a − b| / max(1, max |b|)
GROUPED_TOL = 2e-6     # grouped runs in fp32 (no fp64 grouped matmul); against the fp64 reference
MODES = ("grouped", "tiled", "loop", "dense")


def make(D=16, E=8, k=2, n_s=2, d_ff=12, latent_dim=8, seed=0, bias_std=0.1, **opts) -> LatentMoE:
    torch.manual_seed(seed)
    m = LatentMoE(D, E, k, n_s, d_ff, latent_dim, init_std=0.3, **opts).double()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.3)
        if m.latent:
            m.u_norm.weight.copy_(1 + 0.2 * torch.randn(latent_dim, dtype=torch.float64))
        # a non-zero balancing bias, so that it takes part in choosing the experts and the groups
        m.router_bias.copy_(bias_std * torch.randn(E, dtype=torch.float64))
    return m


# ---------------------------------------------------------------- the reference, from the equations

def cap(z, c):
    return c * torch.tanh(z / c)


def act(name, g, u):
    if name == "situ":
        return cap(g, 4.0) * torch.sigmoid(g) * cap(u, 25.0)
    return g * torch.sigmoid(g) * u          # silu(g) · u


def choose(b, E, k, G, kept_groups):
    """One token's experts from its biased scores b (a list): the best k among the experts of the best
    `kept_groups` of G equal groups, a group scored by the sum of its two best biased scores."""
    n = E // G
    allowed = range(E)
    if G > 1:
        group_score = [sum(sorted(b[g * n:(g + 1) * n], reverse=True)[:2]) for g in range(G)]
        best = sorted(range(G), key=lambda g: -group_score[g])[:kept_groups]
        allowed = [e for e in range(E) if e // n in best]
    return sorted(allowed, key=lambda e: -b[e])[:k]


def reference(P: dict, x: torch.Tensor, m: LatentMoE) -> torch.Tensor:
    """y_t = Σ_j Wd_j act(Wg_j x_t, Wu_j x_t) + R_t, one token at a time, with
    p = σ(W_r x_t)[ids] (/ Σ if renormalised) · scale, and R_t = W_↑ RMSNorm(Σ_i p_i E_{ids_i}(W_↓ x_t)),
    or Σ_i p_i E_{ids_i}(x_t) without the latent; E_e(z) = W_down[e]ᵀ act(W_gate[e]ᵀ z, W_up[e]ᵀ z)."""
    E, k, a = m.num_experts, m.top_k, m.expert_act
    n_s = len(m.shared)
    scores = torch.sigmoid(x @ P["router.weight"].T)
    biased = (scores.detach() + m.router_bias).tolist()
    rows = []
    for t in range(x.shape[0]):
        ids = choose(biased[t], E, k, m.num_expert_groups, m.topk_groups)
        p = scores[t, ids]
        if m.renormalize:
            p = p / p.sum()
        p = p * m.routed_scaling_factor
        xt = x[t]
        y = torch.zeros_like(xt)
        for j in range(n_s):
            h = act(a, P[f"shared.{j}.gate_proj.weight"] @ xt, P[f"shared.{j}.up_proj.weight"] @ xt)
            y = y + P[f"shared.{j}.down_proj.weight"] @ h
        z = P["down_proj.weight"] @ xt if m.latent else xt
        u = torch.zeros_like(z)
        for i, e in enumerate(ids):
            u = u + p[i] * (act(a, z @ P["w_gate"][e], z @ P["w_up"][e]) @ P["w_down"][e])
        if m.latent:
            u = P["up_proj.weight"] @ (u / torch.sqrt(u.square().mean() + m.u_norm.eps) * P["u_norm.weight"])
        rows.append(y + u)
    return torch.stack(rows)


def dy_like(y):
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y)


def run(m, x, dispatch):
    m.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y = m(x, dispatch=dispatch)
    y.backward(dy_like(y))
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()}
    return y.detach(), {"x": x.grad, **grads}


def run_reference(m, x):
    P = {n: p.detach().clone().requires_grad_(True) for n, p in m.named_parameters()}
    xr = x.detach().clone().requires_grad_(True)
    y = reference(P, xr.reshape(-1, x.shape[-1]), m).view(x.shape)
    y.backward(dy_like(y))
    return y.detach(), {"x": xr.grad, **{n: p.grad if p.grad is not None else torch.zeros_like(p)
                                         for n, p in P.items()}}


# (id, layer sizes and options); sizes D, E, k, n_s, d_ff, latent_dim
CASES = [
    ("scale", dict(routed_scaling_factor=2.5)),
    ("no_renorm", dict(renormalize=False)),
    ("no_renorm_scaled", dict(renormalize=False, routed_scaling_factor=0.7)),
    ("G2_keep1", dict(E=8, k=2, num_expert_groups=2, topk_groups=1)),
    ("G2_keep2", dict(E=8, k=3, num_expert_groups=2, topk_groups=2)),
    ("G4_keep1", dict(E=8, k=2, num_expert_groups=4, topk_groups=1)),
    ("G4_keep2", dict(E=12, k=4, num_expert_groups=4, topk_groups=2)),
    ("G4_keep4", dict(E=8, k=3, num_expert_groups=4, topk_groups=4)),
    ("silu", dict(expert_act="silu")),
    ("no_latent", dict(latent=False)),
    ("no_latent_no_shared", dict(latent=False, n_s=0)),
    ("no_latent_one_shared_situ", dict(latent=False, n_s=1, routed_scaling_factor=1.5)),
    ("odd_G3_silu_no_renorm", dict(D=13, E=9, k=5, n_s=1, d_ff=7, latent_dim=5, num_expert_groups=3,
                                   topk_groups=2, expert_act="silu", renormalize=False,
                                   routed_scaling_factor=1.7)),
    ("odd_G2_latent_scale", dict(D=11, E=6, k=1, n_s=3, d_ff=5, latent_dim=3, num_expert_groups=2,
                                 topk_groups=1, routed_scaling_factor=3.0)),
    ("kimi_like", dict(E=8, k=3, n_s=2, num_expert_groups=4, topk_groups=2, expert_act="silu", latent=False,
                       routed_scaling_factor=2.5)),
    ("kimi_like_odd", dict(D=15, E=10, k=3, n_s=2, d_ff=9, num_expert_groups=5, topk_groups=2,
                           expert_act="silu", latent=False, renormalize=False, routed_scaling_factor=2.5)),
]


@pytest.mark.parametrize("opts", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_options_match_the_reference_in_every_dispatch(opts):
    """fp64: dense, loop, tiled (and grouped, which runs tiled in fp64) against the reference and each other;
    then grouped in fp32 against the fp64 reference; values and the gradients of x and every parameter."""
    m = make(**opts)
    D = m.router.weight.shape[1]
    x = torch.randn(2, 11, D, dtype=torch.float64)
    y_ref, g_ref = run_reference(m, x)
    y_dense, g_dense = run(m, x, "dense")
    assert set(g_ref) == set(g_dense)
    for mode in MODES:
        y, g = run(m, x, mode)
        assert_close(f"y {mode}", y, y_ref, TOL)
        assert_close(f"y {mode} vs dense", y, y_dense, TOL)
        for name in g_ref:
            assert_close(f"d{name} {mode}", g[name], g_ref[name], TOL)
            assert_close(f"d{name} {mode} vs dense", g[name], g_dense[name], TOL)
    y, g = run(copy.deepcopy(m).float(), x.float(), "grouped")
    assert_close("y grouped fp32", y.double(), y_ref, GROUPED_TOL)
    for name in g_ref:
        assert_close(f"d{name} grouped fp32", g[name].double(), g_ref[name], GROUPED_TOL)


@pytest.mark.parametrize("opts", [c[1] for c in CASES if c[0] in ("G4_keep2", "kimi_like", "no_latent")],
                         ids=["G4_keep2", "kimi_like", "no_latent"])
def test_options_over_many_tokens_and_one_crowded_expert(opts):
    """129 tokens (several tiles per expert), then every token's first choice on one expert."""
    m = make(**opts)
    x = torch.randn(1, 129, 16, dtype=torch.float64)
    for forced in (None, 1):
        if forced is not None:
            m.router_bias[forced] = 100.0
        y_ref, g_ref = run_reference(m, x)
        for mode, dtype, tol in (("tiled", torch.float64, TOL), ("loop", torch.float64, TOL),
                                 ("grouped", torch.float32, GROUPED_TOL)):
            y, g = run(copy.deepcopy(m).to(dtype), x.to(dtype), mode)
            assert_close(f"y {mode} {forced}", y.double(), y_ref, tol)
            for name in g_ref:
                assert_close(f"d{name} {mode} {forced}", g[name].double(), g_ref[name], tol)


# ---------------------------------------------------------------- the defaults are today's layer

DEFAULTS = dict(routed_scaling_factor=1.0, renormalize=True, num_expert_groups=1, topk_groups=1,
                expert_act="situ", latent=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_default_options_are_bit_identical(dtype):
    """The options spelled out at their defaults change nothing, bit for bit: the same parameters from the
    same seed, the same outputs and gradients in every mode (and the automatic one); the routing weights
    are exactly the chosen scores over their sum, as before the options."""
    torch.manual_seed(3)
    a = LatentMoE(16, 6, 2, 2, 12, 8, init_std=0.3).to(dtype)
    torch.manual_seed(3)
    b = LatentMoE(16, 6, 2, 2, 12, 8, init_std=0.3, **DEFAULTS).to(dtype)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[n], sb[n]) for n in sa)
    x = torch.randn(2, 9, 16, dtype=torch.float64).to(dtype)
    for mode in (*MODES, None):
        ya, ga = run(a, x, mode)
        yb, gb = run(b, x, mode)
        assert torch.equal(ya, yb) and all(torch.equal(ga[n], gb[n]) for n in ga), mode
    x_TD = x.reshape(-1, 16)
    ids, w = a.route(x_TD)
    wd = torch.float64 if dtype == torch.float64 else torch.float32
    scores = torch.sigmoid(torch.nn.functional.linear(x_TD.to(wd), a.router.weight.to(wd)))
    top = scores.gather(1, ids)
    assert torch.equal(ids, torch.topk(scores + a.router_bias.to(wd), 2, dim=-1).indices)
    assert torch.equal(w, top / top.sum(-1, keepdim=True))


def test_default_config_keeps_todays_values():
    c = MoEConfig()
    assert (c.routed_scaling_factor, c.renormalize, c.num_expert_groups, c.topk_groups, c.expert_act,
            c.latent) == (1.0, True, 1, 1, "situ", True)


# ---------------------------------------------------------------- routing in detail

def test_scaling_and_renormalisation_of_the_weights():
    base = make(E=8, k=3)
    x = torch.randn(20, 16, dtype=torch.float64)
    ids, w = base.route(x)
    scores = torch.sigmoid(torch.nn.functional.linear(x, base.router.weight))
    top = scores.gather(1, ids)
    for renorm in (True, False):
        for scale in (1.0, 2.5):
            m = copy.deepcopy(base)
            m.renormalize, m.routed_scaling_factor = renorm, scale
            ids2, w2 = m.route(x)
            assert torch.equal(ids2, ids)
            expected = (top / top.sum(-1, keepdim=True) if renorm else top) * scale
            assert_close(f"weights renorm={renorm} scale={scale}", w2, expected, TOL)
            if renorm:
                assert_close("sum", w2.sum(-1), torch.full((20,), scale, dtype=torch.float64), TOL)


def test_group_score_is_the_sum_of_its_two_best():
    """Group 0 holds the best single expert (0.9) but scores 0.9 + 0.1; group 1 scores 0.6 + 0.6 and wins:
    with one group kept the top-2 is {4, 5}, never expert 0; without groups it is {0, 4} (or {0, 5})."""
    m = make(E=8, k=2, num_expert_groups=2, topk_groups=1)
    with torch.no_grad():
        m.router.weight.zero_()                           # every score 0.5: the bias decides
        m.router_bias.copy_(torch.tensor([0.4, -0.4, -0.4, -0.4, 0.1, 0.1, -0.4, -0.4], dtype=torch.float64))
        m.router_bias[5] -= 1e-9                           # no tie between 4 and 5
    x = torch.randn(5, 16, dtype=torch.float64)
    ids, w = m.route(x)
    assert (ids.sort(-1).values == torch.tensor([4, 5])).all()
    assert_close("weights", w, torch.full((5, 2), 0.5, dtype=torch.float64), TOL)
    m.topk_groups = 2
    ids, _ = m.route(x)
    assert (ids[:, 0] == 0).all() and (ids[:, 1] == 4).all()
    m.num_expert_groups, m.topk_groups = 1, 1
    ids1, _ = m.route(x)
    assert torch.equal(ids1, ids)


@pytest.mark.parametrize("E,G,kept,k", [(8, 2, 1, 2), (8, 2, 2, 4), (8, 4, 1, 2), (8, 4, 2, 4), (12, 4, 3, 5),
                                        (9, 3, 1, 3)])
def test_grouped_routing_stays_in_the_best_groups(E, G, kept, k):
    m = make(E=E, k=k, num_expert_groups=G, topk_groups=kept, bias_std=0.3)
    x = torch.randn(64, 16, dtype=torch.float64)
    ids, _ = m.route(x)
    scores = torch.sigmoid(torch.nn.functional.linear(x, m.router.weight)) + m.router_bias
    for t in range(64):
        assert sorted(ids[t].tolist()) == sorted(choose(scores[t].tolist(), E, k, G, kept))
        assert len(set((ids[t] // (E // G)).tolist())) <= kept
    # all groups kept: plain top-k
    m.topk_groups = G
    ids_all, _ = m.route(x)
    assert torch.equal(ids_all.sort(-1).values, torch.topk(scores, k, dim=-1).indices.sort(-1).values)


def test_router_gradient_flows_through_the_weights_only():
    """The bias and the group choice pick experts and get no gradient; the router gets one through p."""
    m = make(E=8, k=2, num_expert_groups=4, topk_groups=2, renormalize=False, routed_scaling_factor=2.0)
    m(torch.randn(2, 5, 16, dtype=torch.float64)).sum().backward()
    assert m.router_bias.grad is None and m.router.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("kw,match", [
    (dict(E=6, num_expert_groups=4), "must divide"),
    (dict(E=4, k=1, num_expert_groups=4), "at least 2"),
    (dict(E=8, num_expert_groups=2, topk_groups=3), "topk_groups=3"),
    (dict(E=8, num_expert_groups=2, topk_groups=0), "topk_groups=0"),
    (dict(E=8, k=3, num_expert_groups=4, topk_groups=1), "top_k=3"),
    (dict(expert_act="gelu"), "unknown MoE expert_act 'gelu'.*situ, silu"),
])
def test_layer_rejects_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


@pytest.mark.parametrize("kw,key,text", [
    (dict(num_routed_experts=6, num_expert_groups=4), "num_expert_groups", "must divide"),
    (dict(num_routed_experts=4, num_expert_groups=4, top_k=1), "num_expert_groups", "at least 2"),
    (dict(num_routed_experts=8, num_expert_groups=0), "num_expert_groups", ">= 1"),
    (dict(num_routed_experts=8, num_expert_groups=2, topk_groups=3), "topk_groups", "[1, num_expert_groups=2]"),
    (dict(num_routed_experts=8, num_expert_groups=2, topk_groups=0), "topk_groups", "[1, num_expert_groups=2]"),
    (dict(num_routed_experts=8, num_expert_groups=4, topk_groups=1, top_k=3), "top_k", "<= 2"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor", "> 0"),
])
def test_config_rejects_bad_options(kw, key, text):
    with pytest.raises(ConfigError) as e:
        MoEConfig(**kw).validate("model.moe")
    assert f"model.moe.{key}" in str(e.value) and text in str(e.value)


def test_config_takes_the_options_and_names_the_activations():
    assert MoEConfig.CHOICES["expert_act"] == ("situ", "silu")
    cfg = load_config("k3-toy", overrides=[
        "model.moe={num_routed_experts: 8, top_k: 3, num_expert_groups: 4, topk_groups: 2}",
        "model.moe.expert_act=silu", "model.moe.latent=false", "model.moe.renormalize=false",
        "model.moe.routed_scaling_factor=2.5"])
    m = cfg.model.moe
    assert (m.num_expert_groups, m.topk_groups, m.expert_act, m.latent, m.renormalize,
            m.routed_scaling_factor) == (4, 2, "silu", False, False, 2.5)
    with pytest.raises(ConfigError, match="model.moe.expert_act"):
        load_config("k3-toy", overrides=["model.moe.expert_act=gelu"])


# ---------------------------------------------------------------- parameters and FLOPs

def build(cfg: K3Config) -> LatentMoE:
    c = cfg.moe
    return LatentMoE(cfg.hidden_size, c.num_routed_experts, c.top_k, c.num_shared_experts, c.d_ff,
                     cfg.moe_latent_dim, routed_scaling_factor=c.routed_scaling_factor, renormalize=c.renormalize,
                     num_expert_groups=c.num_expert_groups, topk_groups=c.topk_groups, expert_act=c.expert_act,
                     latent=c.latent)


@pytest.mark.parametrize("latent", [True, False], ids=["latent", "full_width"])
@pytest.mark.parametrize("n_s", [0, 2])
def test_parameter_and_flop_counts_follow_the_options(latent, n_s):
    from k3cli.models.flops import flops_per_token
    from k3cli.models.layout import moe_params, param_counts, routed_expert_params

    cfg = K3Config(hidden_size=24, num_hidden_layers=4, moe=MoEConfig(
        num_routed_experts=8, top_k=3, num_shared_experts=n_s, d_ff=10, latent_dim=6, num_expert_groups=4,
        topk_groups=2, expert_act="silu", latent=latent, routed_scaling_factor=2.5))
    cfg.validate()
    m = build(cfg)
    names = {n for n, _ in m.named_parameters()}
    latent_names = {"down_proj.weight", "u_norm.weight", "up_proj.weight"}
    assert (latent_names <= names) if latent else not (latent_names & names)
    width = 6 if latent else 24
    assert m.w_gate.shape == (8, width, 10) and m.w_up.shape == (8, width, 10) and m.w_down.shape == (8, 10, width)
    assert sum(p.numel() for p in m.parameters()) == moe_params(cfg)
    per_expert = (m.w_gate.numel() + m.w_up.numel() + m.w_down.numel()) // 8
    assert routed_expert_params(cfg) == per_expert
    counts = param_counts(cfg)
    n_moe = len(cfg.layer_specs())
    assert counts["total"] - counts["active"] == n_moe * (8 - 3) * per_expert
    f = flops_per_token(cfg, 32)["forward_components"]
    assert f["moe_routed_experts"] == 2 * n_moe * 3 * per_expert
    lat_proj = (m.down_proj.weight.numel() + m.up_proj.weight.numel()) if latent else 0
    assert f["moe_latent_proj"] == 2 * n_moe * lat_proj
    assert f["moe_shared_experts"] == 2 * n_moe * sum(p.numel() for p in m.shared.parameters())
    assert f["moe_router"] == 2 * n_moe * m.router.weight.numel()


def test_default_counts_are_unchanged():
    """With the defaults the formulas are today's: 3·ℓ·d_ff per routed expert and W_↓, u_norm, W_↑."""
    from k3cli.models.layout import moe_params, routed_expert_params

    cfg = K3Config()
    D, m, lat = cfg.hidden_size, cfg.moe, cfg.moe_latent_dim
    assert routed_expert_params(cfg) == 3 * lat * m.d_ff
    assert moe_params(cfg) == (m.num_shared_experts * 3 * D * m.d_ff + D * m.num_routed_experts + D * lat
                               + m.num_routed_experts * 3 * lat * m.d_ff + lat + lat * D)
    assert moe_params(cfg) == sum(p.numel() for p in build(cfg).parameters())


# ---------------------------------------------------------------- decode and torch.compile

@pytest.mark.parametrize("opts", [c[1] for c in CASES if c[0] in ("kimi_like", "odd_G2_latent_scale")],
                         ids=["kimi_like", "odd_G2_latent_scale"])
def test_decode_steps_and_compiled_graph(opts):
    """A few tokens (decode) take the dense form with the options; the layer compiles to one graph
    (fullgraph), forward and backward, with the eager values and gradients."""
    m = make(**opts).eval()
    D = m.router.weight.shape[1]
    with torch.no_grad():
        for T in (1, 3):
            x = torch.randn(1, T, D, dtype=torch.float64)
            y_ref = reference(dict(m.named_parameters()), x.reshape(T, D), m).view(x.shape)
            assert_close(f"T{T} auto vs reference", m(x), y_ref, TOL)
    m.train()
    x = torch.randn(2, 20, D, dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y_ref, g_ref = run(m, x, None)
    m.zero_grad()
    xc = x.clone().requires_grad_(True)
    y = compiled(xc)
    y.backward(dy_like(y))
    assert_close("compiled y", y.detach(), y_ref, TOL)
    assert_close("compiled dx", xc.grad, g_ref["x"], TOL)
    for n, p in m.named_parameters():
        assert_close(f"compiled d{n}", p.grad, g_ref[n], TOL)
    with torch.no_grad():
        x1 = torch.randn(1, 1, D, dtype=torch.float64)
        m.eval()
        assert_close("compiled decode step", compiled(x1), m(x1), TOL)


# ---------------------------------------------------------------- Kimi Linear's MoE block

KIMI = [(2, 1, 2, True), (2, 2, 3, False), (4, 1, 2, False), (4, 2, 3, True), (4, 4, 5, True)]


@pytest.mark.parametrize("n_group,topk_group,k,norm", KIMI, ids=[f"G{g}-keep{t}-k{k}-{'norm' if n else 'raw'}"
                                                                 for g, t, k, n in KIMI])
def test_kimi_linear_moe_block(n_group, topk_group, k, norm):
    """transformers' KimiLinearMoE (fp32, CPU) and a LatentMoE with the matching options and its weights:
    the same outputs in every dispatch mode."""
    pytest.importorskip("transformers")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

    D, E, I, n_s = 16, 8, 12, 2
    kcfg = KimiLinearConfig(vocab_size=32, hidden_size=D, moe_intermediate_size=I, num_local_experts=E,
                            num_experts_per_tok=k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
                            norm_topk_prob=norm, n_shared_experts=n_s, hidden_act="silu", num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2)
    kcfg._experts_implementation = "eager"
    torch.manual_seed(0)
    kimi = KimiLinearMoE(kcfg).float().eval()
    with torch.no_grad():
        for p in kimi.parameters():
            p.normal_(0.0, 0.3)
        kimi.gate.e_score_correction_bias.normal_(0.0, 0.1)
    m = LatentMoE(D, E, k, n_s, I, latent_dim=8, routed_scaling_factor=2.5, renormalize=norm,
                  num_expert_groups=n_group, topk_groups=topk_group, expert_act="silu", latent=False).float().eval()
    with torch.no_grad():
        m.router.weight.copy_(kimi.gate.weight)
        m.router_bias.copy_(kimi.gate.e_score_correction_bias)
        gate_up, down = kimi.experts.gate_up_proj, kimi.experts.down_proj   # [E, 2I, D], [E, D, I]
        m.w_gate.copy_(gate_up[:, :I].transpose(1, 2))                     # [E, D, I]
        m.w_up.copy_(gate_up[:, I:].transpose(1, 2))
        m.w_down.copy_(down.transpose(1, 2))                                 # [E, I, D]
        se = kimi.shared_experts                                             # one MLP of width n_s·I
        for j, e in enumerate(m.shared):
            e.gate_proj.weight.copy_(se.gate_proj.weight[j * I:(j + 1) * I])
            e.up_proj.weight.copy_(se.up_proj.weight[j * I:(j + 1) * I])
            e.down_proj.weight.copy_(se.down_proj.weight[:, j * I:(j + 1) * I])
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        expected = kimi(x)
        _, w_kimi, ids_kimi = kimi.gate(x)
        ids, w = m.route(x.reshape(-1, D))
        order, order_kimi = ids.argsort(-1), ids_kimi.argsort(-1)
        assert torch.equal(ids.gather(1, order), ids_kimi.gather(1, order_kimi))
        assert_close("routing weights", w.gather(1, order), w_kimi.gather(1, order_kimi), 1e-6)
        for mode in MODES:
            y = m(x, dispatch=mode)
            assert_close(f"y {mode}", y, expected, 1e-5)
            assert_close(f"y {mode}", y, expected, 1e-5, relative_rms_error)
