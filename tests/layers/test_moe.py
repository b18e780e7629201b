"""LatentMoE: grouped == tiled == loop == dense (values, grads), routing, balancing, SiTU (docs/math.md §4, §7.5)."""
import copy

import pytest
import torch

from k3cli.layers.ffn import situ_glu
from k3cli.layers.moe import LatentMoE
from k3cli.testing import assert_close

# max |a − b| / max(1, max |b|), fp64
TOL = {"y": 1e-12, "grad": 1e-12, "shared": 1e-12}


def make(D=16, E=6, k=2, n_s=2, d_ff=12, latent=8, seed=0, **kw) -> LatentMoE:
    torch.manual_seed(seed)
    # init_std 0.3 so the experts produce O(1) outputs and the comparisons are not trivially small
    m = LatentMoE(D, E, k, n_s, d_ff, latent, init_std=0.3, **kw).double()
    for p in m.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return m


def run(m, x, dispatch):
    m.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y = m(x, dispatch=dispatch)
    # drawn in fp64 for every dtype, so that fp32 runs see the fp64 runs' dy
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y))
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()}
    return y.detach(), {"x": x.grad, **grads}


# (id, B, T, E, k, forced expert via bias or None)
CASES = [
    ("basic", 2, 9, 6, 2, None),
    ("T1", 1, 1, 6, 2, None),
    ("top1", 2, 7, 5, 1, None),
    ("k_equals_E", 1, 6, 3, 3, None),
    ("all_to_one_expert", 2, 8, 6, 1, 4),
    ("empty_experts", 1, 2, 16, 2, None),
]


# grouped runs in fp32 (torch's grouped matmul has no fp64): max |a − b| / max(1, max |b|) against the fp64
# dense form, a few fp32 roundings of sums over at most 16 terms
GROUPED_TOL = 2e-6


@pytest.mark.parametrize("B,T,E,k,forced", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_dispatch_modes_agree(B, T, E, k, forced):
    m = make(E=E, k=k)
    if forced is not None:
        m.router_bias[forced] = 100.0
    x = torch.randn(B, T, 16, dtype=torch.float64)
    ids, _ = m.route(x.reshape(-1, 16))
    if forced is not None:
        assert (ids[:, 0] == forced).all()
    y_ref, g_ref = run(m, x, "dense")
    for mode, dtype, tol in (("tiled", torch.float64, TOL["y"]), ("loop", torch.float64, TOL["y"]),
                             ("grouped", torch.float32, GROUPED_TOL)):
        y, g = run(copy.deepcopy(m).to(dtype), x.to(dtype), mode)
        assert y.dtype == dtype
        assert_close(f"y {mode}", y.double(), y_ref, tol)
        for name in g_ref:
            assert_close(f"d{name} {mode}", g[name].double(), g_ref[name], tol)


def test_grouped_spans_uneven_groups():
    """257 tokens over 16 experts (empty, single-row and long groups), then every first choice on one expert."""
    m = make(E=16, k=2)
    x = torch.randn(1, 257, 16, dtype=torch.float64)
    for forced in (None, 15):
        if forced is not None:
            m.router_bias[forced] = 100.0
        y_ref, g_ref = run(m, x, "loop")
        y, g = run(copy.deepcopy(m).float(), x.float(), "grouped")
        assert_close(f"y grouped {forced}", y.double(), y_ref, GROUPED_TOL)
        for name in g_ref:
            assert_close(f"d{name} grouped {forced}", g[name].double(), g_ref[name], GROUPED_TOL)


def test_grouped_is_deterministic():
    m = make(E=8, k=2).float()
    x = torch.randn(3, 11, 16)
    a, ga = run(m, x, "grouped")
    b, gb = run(m, x, "grouped")
    assert torch.equal(a, b) and all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("dtype,d_ff", [(torch.float64, 12), (torch.float32, 5)], ids=["fp64", "fp32-unaligned"])
def test_grouped_runs_the_tiled_form_where_grouped_matmul_does_not(dtype, d_ff):
    """fp64 (no grouped matmul in torch) and rows of 5 fp32 values (20 bytes, not a multiple of 16)."""
    from k3cli.layers.moe import grouped_mm_runs

    m = make(E=6, k=2, d_ff=d_ff).to(dtype)
    x = torch.randn(2, 9, 16, dtype=dtype)
    assert not grouped_mm_runs(x, 8, d_ff)
    a, ga = run(m, x, "grouped")
    b, gb = run(m, x, "tiled")
    assert torch.equal(a, b) and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_grouped_mm_runs_rule():
    from k3cli.layers.moe import grouped_mm_runs

    assert grouped_mm_runs(torch.zeros(1, 8), 8, 12)                       # fp32 on the CPU, 32 and 48 bytes
    assert grouped_mm_runs(torch.zeros(1, 8, dtype=torch.bfloat16), 8, 96)
    assert not grouped_mm_runs(torch.zeros(1, 8, dtype=torch.bfloat16), 8, 12)   # 24 bytes
    assert not grouped_mm_runs(torch.zeros(1, 8, dtype=torch.float16), 8, 16)
    assert not grouped_mm_runs(torch.zeros(1, 8, dtype=torch.float64), 8, 16)
    seen = []
    torch.compile(lambda x: seen.append(grouped_mm_runs(x, 8, 12)) or x, backend="eager")(torch.zeros(1, 8))
    assert seen == [False]   # fp32 under torch.compile: tiled
    assert not grouped_mm_runs(torch.zeros(1, 8, device="meta"), 8, 12)   # neither CPU nor CUDA


@pytest.mark.parametrize("capability,fast", [((9, 0), True), ((10, 0), True), ((8, 0), False), ((12, 0), False)])
def test_grouped_mm_runs_on_cuda_only_where_torch_has_its_kernel(monkeypatch, capability, fast):
    """Elsewhere torch's grouped matmul loops over the groups and reads their sizes to the host: a sync
    per MoE layer, so the tiled form runs. The rule holds under torch.compile too (a constant there)."""
    from types import SimpleNamespace

    from k3cli.layers.moe import grouped_mm_kernel_on, grouped_mm_runs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    bf16 = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, element_size=lambda: 2)
    fp32 = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32, element_size=lambda: 4)
    assert grouped_mm_runs(bf16, 8, 96) == fast and not grouped_mm_runs(fp32, 8, 96)
    torch._dynamo.reset()   # the constant is not guarded: a graph compiled for another capability would be reused
    compiled = torch.compile(lambda x: x + 1 if grouped_mm_kernel_on(torch.device("cuda", 0)) else x - 1,
                             backend="eager", fullgraph=True)
    assert compiled(torch.zeros(2)).tolist() == ([1.0, 1.0] if fast else [-1.0, -1.0])


def test_tiled_is_deterministic():
    m = make(E=8, k=2)
    x = torch.randn(3, 11, 16, dtype=torch.float64)
    a, ga = run(m, x, "tiled")
    b, gb = run(m, x, "tiled")
    assert torch.equal(a, b) and all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("T,E,k", [(300, 4, 2), (257, 16, 2), (64, 3, 3)])
def test_tiled_spans_many_tiles(T, E, k):
    """Groups of several tiles each (R = 16 here), a partial last tile, and all tokens on one expert."""
    from k3cli.layers.moe import tile_rows

    assert tile_rows(T * k, E) * 3 <= T * k   # more than one tile per expert on average
    m = make(E=E, k=k)
    x = torch.randn(1, T, 16, dtype=torch.float64)
    y_ref, g_ref = run(m, x, "loop")
    y, g = run(m, x, "tiled")
    assert_close("y tiled", y, y_ref, TOL["y"])
    for name in g_ref:
        assert_close(f"d{name} tiled", g[name], g_ref[name], TOL["grad"])
    m.router_bias[E - 1] = 100.0   # every token's first choice: one group of T tiles-worth
    y_ref, g_ref = run(m, x, "loop")
    y, g = run(m, x, "tiled")
    assert_close("y tiled one expert", y, y_ref, TOL["y"])
    for name in g_ref:
        assert_close(f"d{name} tiled one expert", g[name], g_ref[name], TOL["grad"])


def test_tile_rows_keeps_padding_and_copies_bounded():
    from k3cli.layers.moe import tile_rows

    for S, E in ((4096, 16), (65536, 32), (100, 4), (10**7, 8)):
        R = tile_rows(S, E)
        assert 16 <= R <= 1024 and R & (R - 1) == 0
        assert R == 1024 or E * R <= S / 4 or R == 16   # padding at most a quarter of the slots


def test_routing_weights_use_unbiased_scores():
    m = make(E=6, k=2)
    m.router_bias.copy_(torch.tensor([5.0, 5.0, 0, 0, 0, 0], dtype=torch.float64))
    x = torch.randn(10, 16, dtype=torch.float64)
    ids, w = m.route(x)
    scores = torch.sigmoid(x @ m.router.weight.T)
    assert (ids.sort(-1).values == torch.tensor([0, 1])).all()
    top = scores.gather(1, ids)
    assert_close("weights", w, top / top.sum(-1, keepdim=True), TOL["y"])
    assert_close("sum", w.sum(-1), torch.ones(10, dtype=torch.float64), TOL["y"])


def test_two_shared_experts_equal_one_of_double_width():
    two = make(n_s=2, d_ff=12)
    one = make(n_s=1, d_ff=24)
    a, b = two.shared
    with torch.no_grad():
        one.shared[0].gate_proj.weight.copy_(torch.cat([a.gate_proj.weight, b.gate_proj.weight], 0))
        one.shared[0].up_proj.weight.copy_(torch.cat([a.up_proj.weight, b.up_proj.weight], 0))
        one.shared[0].down_proj.weight.copy_(torch.cat([a.down_proj.weight, b.down_proj.weight], 1))
        # silence the routed branch in both so the MoE output is the shared sum alone
        two.up_proj.weight.zero_()
        one.up_proj.weight.zero_()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert_close("shared", one(x), two(x), TOL["shared"])


def test_router_bias_gets_no_gradient():
    m = make()
    assert "router_bias" not in dict(m.named_parameters())
    assert "router_bias" in m.state_dict()
    m(torch.randn(2, 5, 16, dtype=torch.float64)).sum().backward()
    assert m.router_bias.grad is None and not m.router_bias.requires_grad
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_situ_is_bounded(dtype):
    vals = torch.cat([torch.linspace(-1e4, 1e4, 401), torch.tensor([-1e4, 1e4, 0.0])])
    g, u = torch.meshgrid(vals, vals, indexing="ij")
    out = situ_glu(g.to(dtype), u.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert out.float().abs().max() <= 100.0


def test_update_bias_moves_toward_balance():
    m = make(E=4, k=1, bias_update_rate=0.01)
    m.router_bias[2] = 100.0  # every token to expert 2
    m.train()
    m(torch.randn(2, 8, 16, dtype=torch.float64))
    stats = m.load_stats()
    assert stats["load"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert stats["max_over_mean"] == pytest.approx(4.0)
    before = m.router_bias.clone()
    m.update_bias()
    delta = (m.router_bias - before).tolist()
    assert delta == pytest.approx([0.01, 0.01, -0.01, 0.01])
    assert m.load_counts.sum() == 0


def test_eval_mode_does_not_count_load():
    m = make().eval()
    m(torch.randn(1, 4, 16, dtype=torch.float64))
    assert m.load_counts.sum() == 0


def test_unknown_dispatch_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown MoE dispatch 'padded'.*grouped, tiled"):
        make(dispatch="padded")


def test_parameter_shapes():
    m = LatentMoE(16, 6, 2, 2, 12, 8)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    expected = {"router.weight": (6, 16), "down_proj.weight": (8, 16), "w_gate": (6, 8, 12),
                "w_up": (6, 8, 12), "w_down": (6, 12, 8), "u_norm.weight": (8,), "up_proj.weight": (16, 8)}
    for j in range(2):
        expected |= {f"shared.{j}.gate_proj.weight": (12, 16), f"shared.{j}.up_proj.weight": (12, 16),
                     f"shared.{j}.down_proj.weight": (16, 12)}
    assert shapes == expected


def _host_syncs(fn) -> int:
    """Calls that read a tensor value back to the host (a device sync on a GPU) while fn runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_few_tokens_take_the_dense_path():
    """Configured tiled: up to num_experts tokens (decode) run the dense form, more the tiled one;
    same values either way."""
    m = make(E=6, k=2)
    for T in (1, 6, 7):
        x = torch.randn(1, T, 16, dtype=torch.float64)
        with torch.no_grad():
            assert_close(f"T{T} auto vs dense", m(x), m(x, dispatch="dense"), TOL["y"])
            assert_close(f"T{T} auto vs tiled", m(x), m(x, dispatch="tiled"), TOL["y"])


def test_training_step_reads_nothing_back():
    """The tiled dispatch, the load counts and the backward take no host read-back (a device sync
    on a GPU): every shape follows from T, K, E alone."""
    m = make(E=6, k=2).train()
    x = torch.randn(2, 40, 16, dtype=torch.float64, requires_grad=True)

    def step():
        m(x).square().sum().backward()

    assert _host_syncs(step) == 0
    assert m.load_counts.sum() == 2 * 40 * 2


def test_tiled_compiles_to_one_graph():
    m = make(E=6, k=2).train()
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    explain = torch._dynamo.explain(lambda x: m(x).sum())(x)
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_gather_rows_and_gather_experts_match_indexing_with_gradients():
    """The tiled dispatch's gathers (gradient by a second gather, weights by a one-hot product) against plain
    indexing and its autograd, fp64: token rows each read twice plus zero rows, then the inverse direction."""
    from k3cli.layers.moe import gather_experts, gather_rows
    g = torch.Generator().manual_seed(0)
    T, K, L = 5, 2, 3
    perm = torch.randperm(T * K + 3, generator=g)             # 3 padding rows among the T·K slot rows
    row_tok_S = perm[: T * K]
    slot_PR = torch.full((T * K + 3,), T * K).scatter_(0, row_tok_S, torch.arange(T * K))
    x = torch.randn(T, L, dtype=torch.float64, generator=g, requires_grad=True)
    y = gather_rows(x, slot_PR // K, row_tok_S.view(T, K))
    y_ref = torch.cat([x, x.new_zeros(1, L)])[slot_PR // K]
    dy = torch.randn(y.shape, dtype=torch.float64, generator=g)
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(y_ref, x, dy)[0],
                               rtol=0, atol=1e-14)
    z = gather_rows(y_ref.detach().requires_grad_(), row_tok_S, slot_PR[:, None])
    assert torch.equal(z, y_ref[row_tok_S])
    w = torch.randn(4, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.tensor([0, 0, 2, 3, 3, 3])
    dw = torch.randn(6, 2, 3, dtype=torch.float64, generator=g)
    assert torch.equal(gather_experts(w, idx), w[idx])
    torch.testing.assert_close(torch.autograd.grad(gather_experts(w, idx), w, dw)[0],
                               torch.autograd.grad(w[idx], w, dw)[0], rtol=0, atol=1e-14)
