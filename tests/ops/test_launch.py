"""k3cli/ops/launch.py: the host-side grid arithmetic, the switch, and the pass-through where direct launches
do not apply (Triton's interpreter, as in CI). The direct launches themselves need a GPU: the GPU tier's
test_chunk_kda_fast_launch_gpu_is_exact compares them with Triton's path bit for bit."""
import types

import pytest
import torch
import triton
import triton.language as tl

from k3cli.ops import launch

knobs = launch.knobs


def test_grid_arithmetic_matches_triton():
    assert all(launch.next_pow2(n) == triton.next_power_of_2(n) for n in range(0, 4097))
    assert all(launch.cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in range(1, 70))


@launch.fast_launch
@triton.jit
def _scale_kernel(x, y, n, s, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < n) * s, mask=o < n)


@pytest.mark.triton
def test_wrapped_kernel_runs_and_exposes_the_kernel(monkeypatch):
    """On CUDA (without the interpreter) the first launch goes through Triton and the next ones hit the cache."""
    dev = "cuda" if _scale_kernel.usable and torch.cuda.is_available() else "cpu"
    misses = []
    miss = launch.FastLaunch._miss
    monkeypatch.setattr(launch.FastLaunch, "_miss", lambda self, *a: misses.append(1) or miss(self, *a))
    x = torch.arange(37, dtype=torch.float32, device=dev)
    try:
        on = launch.configure(True)
        for _ in range(3):
            y = torch.empty_like(x)
            _scale_kernel[(launch.cdiv(37, 16),)](x, y, 37, 2.0, BLOCK=16)
            assert torch.equal(y, 2 * x)
    finally:
        launch.configure(True)
    assert list(_scale_kernel.arg_names) == ["x", "y", "n", "s", "BLOCK"]   # reads reach the wrapped kernel
    if _scale_kernel.usable and on:
        assert len(misses) == 1 and len(_scale_kernel.launches) == 1
    else:
        # the interpreter's kernels are not JITFunctions, so every launch takes Triton's path
        assert not misses and not _scale_kernel.launches


class _FakeLauncher:
    """Triton 3.6's CudaLauncher as the direct path uses it: no scratch, the C launch function as .launch."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)


class _FakeTriton:
    """Stands for the wrapped kernel: `[grid](...)` is Triton's own path, counted, returning one compiled kernel."""

    def __init__(self):
        self.kernel = types.SimpleNamespace(run=_FakeLauncher(), function=7, packed_metadata="meta")
        self.calls = 0

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls += 1
            return self.kernel
        return run


def _fake_fast(monkeypatch):
    def kernel(x, n, BLOCK=16):
        pass
    fl = object.__new__(launch.FastLaunch)
    fl.__dict__.update(wrapped=_FakeTriton(), tuner=None, launches={}, usable=True, names=("x", "n", "BLOCK"),
                       defaults={"BLOCK": 16}, jit=types.SimpleNamespace(fn=kernel, pre_run_hooks=[]))
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: 99)
    return fl


def test_direct_launch_path_with_a_stand_in_kernel(monkeypatch):
    """The direct path's bookkeeping, without a GPU: one miss through Triton's path, then the C launch function
    with the grid, the stream, the kernel's handle and metadata, tensors as data pointers and the constexpr tail;
    and every case where it must step aside."""
    fl = _fake_fast(monkeypatch)
    x = torch.zeros(8)
    try:
        assert launch.configure(True)
        for _ in range(3):
            fl[(2,)](x, 5)
        assert fl.wrapped.calls == 1
        calls = fl.wrapped.kernel.run.calls
        assert calls == [(2, 1, 1, 99, 7, False, False, None, None, "meta", None, None, None, x.data_ptr(), 5, 16)] * 2
        fl[lambda meta: (meta["n"], meta["BLOCK"])](x, 5)   # a grid callable sees the arguments and the tail
        assert calls[-1][:3] == (5, 16, 1) and fl.wrapped.calls == 1
        fl[(2,)](x, True)   # True == 1 as a key, but another specialisation: a miss
        assert fl.wrapped.calls == 2
        # keyword tensors are never cached
        fl[(2,)](x, 5, BLOCK=x)
        fl[(2,)](x, 5, BLOCK=x)
        assert fl.wrapped.calls == 4
        # pre-run hooks run only on Triton's path
        fl.jit.pre_run_hooks.append(lambda *a, **k: None)
        fl[(2,)](x, 5)
        assert fl.wrapped.calls == 5
        fl.jit.pre_run_hooks.clear()
        # switched off, and in Triton's debug mode: Triton's path
        launch.configure(False)
        fl[(2,)](x, 5)
        assert fl.wrapped.calls == 6
        if knobs is not None:
            monkeypatch.setattr(knobs.runtime, "debug", True)
            assert not launch.configure(True)
            fl[(2,)](x, 5)
            assert fl.wrapped.calls == 7
    finally:
        monkeypatch.undo()
        launch.configure(True)


def test_configure_follows_switch_and_launch_hooks():
    if knobs is None:
        pytest.skip("this Triton has no knobs (< 3.4): direct launches are off")
    try:
        assert launch.configure(True)
        assert not launch.configure(False)
        assert not launch.configure(), "configure() keeps the last choice (chunk_kda calls it on every call)"
        assert launch.configure(True) and launch.configure()
        hooks = knobs.runtime.launch_enter_hook
        if not hasattr(hooks, "add"):
            pytest.skip("this Triton keeps launch hooks as a plain callable")
        hook = lambda metadata: None  # noqa: E731
        hooks.add(hook)
        try:
            assert not launch.configure(True), "a launch hook is set: launches must go through Triton's path"
        finally:
            hooks.remove(hook)
        assert launch.configure(True)
    finally:
        launch.configure(True)


def test_launch_key_separates_what_triton_specialises_apart():
    """The cache key must be at least as fine as Triton's specialisation: a hit reuses the compiled kernel."""
    buf = torch.zeros(64)
    a, b = torch.zeros(16), torch.ones(16)
    key = lambda *args, **kw: launch.launch_key(0, args, kw)[0]  # noqa: E731
    # same dtype, device and alignment: one key, whatever the values or the pointer
    assert key(a, 3, BLOCK=16) == key(b, 3, BLOCK=16)
    # 16-byte alignment (Triton's "D" hint), dtype, int value (Triton: 1 is a constexpr, % 16 a hint)
    assert key(buf[4:20], 3) != key(buf[1:17], 3)
    assert key(a, 3) != key(a.half(), 3)
    assert key(a, 3) != key(a, 1) and key(a, 16) != key(a, 17)
    # True == 1 == 1.0 as Python keys; Triton: bool -> u1, 1 -> constexpr 1, 1.0 -> fp32
    assert len({key(a, True), key(a, 1), key(a, 1.0)}) == 3
    assert len({key(a, FLAG=True), key(a, FLAG=1), key(a, FLAG=1.0)}) == 3
    assert key(a, None) != key(a, 0) and key(a, BV=32) != key(a, BV=64)
    # tensors reach the launcher as their data pointers
    assert launch.launch_key(0, (a, 3), {})[1] == [a.data_ptr(), 3]
