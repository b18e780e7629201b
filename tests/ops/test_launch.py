"""k3cli/ops/launch.py: the host-side grid arithmetic, the switch, and the pass-through where direct launches
do not apply (Triton's interpreter, as in CI). The direct launches themselves need a GPU: the GPU tier's
test_chunk_kda_fast_launch_gpu_is_exact compares them with Triton's path bit for bit."""
import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from k3cli.ops import launch


def test_grid_arithmetic_matches_triton():
    assert all(launch.next_pow2(n) == triton.next_power_of_2(n) for n in range(0, 4097))
    assert all(launch.cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in range(1, 70))


@launch.fast_launch
@triton.jit
def _scale_kernel(x, y, n, s, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < n) * s, mask=o < n)


@pytest.mark.triton
def test_wrapped_kernel_runs_and_exposes_the_kernel():
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # CPU: Triton's interpreter (TRITON_INTERPRET=1)
    x = torch.arange(37, dtype=torch.float32, device=dev)
    for _ in range(3):
        y = torch.empty_like(x)
        _scale_kernel[(launch.cdiv(37, 16),)](x, y, 37, 2.0, BLOCK=16)
        assert torch.equal(y, 2 * x)
    assert list(_scale_kernel.arg_names) == ["x", "y", "n", "s", "BLOCK"]   # reads reach the wrapped kernel
    if dev == "cuda":
        # the first launch went through Triton and filled the cache; the next two hit it
        assert launch.configure(True) and len(_scale_kernel.launches) == 1
    else:
        # the interpreter's kernels are not JITFunctions, so every launch takes Triton's path
        assert not _scale_kernel.usable and not _scale_kernel.launches


def test_configure_follows_switch_and_launch_hooks():
    try:
        assert launch.configure(True)
        assert not launch.configure(False)
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
