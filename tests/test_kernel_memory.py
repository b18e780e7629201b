"""The interpreter's memory checks (kernel_memory.py, installed by conftest.py) catch what they claim to."""
import os

import pytest
import torch

from k3cli.ops.attnres import fused_attnres

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the checks wrap the Triton interpreter")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _copy(x, y, n, SHIFT: tl.constexpr, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y + o, tl.load(x + o + SHIFT, mask=o < n), mask=o < n)


@triton.jit
def _same_slot(x, y, B: tl.constexpr):
    tl.store(y + tl.arange(0, B), tl.load(x + tl.program_id(0) * B + tl.arange(0, B)))


@triton.jit
def _read_neighbour(y, B: tl.constexpr):
    i = tl.program_id(0)
    o = tl.arange(0, B)
    tl.store(y + i * B + o, tl.load(y + ((i + 1) % 2) * B + o) + 1.)


def test_a_correct_kernel_passes_and_its_result_is_kept():
    x, y = torch.arange(10.), torch.zeros(10)
    _copy[(3,)](x, y, 10, SHIFT=0, B=4)
    assert torch.equal(y, x)


def test_a_read_past_the_end_into_the_next_tensor_is_a_fault():
    # one buffer holds x and y side by side: the overrun lands in memory the launch owns, yet not in x
    buf = torch.zeros(20)
    x, y = buf[:10], buf[10:]
    with pytest.raises(Exception, match="outside any one tensor argument"):
        _copy[(3,)](x, y, 10, SHIFT=1, B=4)


def test_two_programs_storing_one_address_is_a_fault():
    with pytest.raises(Exception, match="stored by more than one program"):
        _same_slot[(2,)](torch.arange(8.), torch.zeros(4), B=4)


def test_a_program_reading_another_programs_store_is_a_fault():
    with pytest.raises(Exception, match="that another program of the launch stores"):
        _read_neighbour[(2,)](torch.zeros(8), B=4)


def test_loads_through_a_pointer_table_stay_inside_its_tensors():
    srcs = [torch.randn(1, 3, 20) for _ in range(3)]
    h = fused_attnres(srcs, torch.randn(20), torch.ones(20))
    assert h.shape == (1, 3, 20) and torch.isfinite(h).all()
