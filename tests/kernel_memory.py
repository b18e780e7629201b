"""Memory checks on every Triton launch the interpreter runs (TRITON_INTERPRET=1), installed by conftest.py.

The interpreter runs a launch's programs one after another on the host, where two faults that a GPU shows
only sometimes pass silently: an access outside the tensors the kernel was given (on a GPU an illegal
address, or another tensor's data), and programs of one launch that depend on each other's stores (on a GPU
a race). Checked here, per launch:
- the masked-in addresses of each load, store and atomic lie inside one tensor argument (a block may not run
  from one argument into its neighbour), or, for a load through a pointer table (AttnRes' sources), inside
  the tensors the table addresses;
- no address is stored by two programs, and no program loads an address that another program stores.
A violation raises inside the kernel, so the test fails with the interpreter's error naming the kernel.
Written against Triton 3.6's interpreter (GridExecutor, InterpreterBuilder).
"""
from __future__ import annotations

import numpy as np
import torch
import triton.runtime.interpreter as interp


class MemoryFault(RuntimeError):
    pass


class _Launch:
    """One launch: its arguments' byte ranges, the ranges its pointer tables address, and what each program
    loaded and stored, as (address << PID_BITS) | program."""

    def __init__(self, name: str, ranges: list[tuple[int, int]], table_ranges: list[tuple[int, int]]):
        self.name, self.ranges, self.table_ranges = name, ranges, table_ranges
        self.loads: list[np.ndarray] = []
        self.stores: list[np.ndarray] = []

    @property
    def track(self) -> bool:
        """Whether program ids fit beside the addresses (host addresses lie below 2**47 on Linux)."""
        gx, gy, gz = interp.interpreter_builder.grid_dim
        return gx * gy * gz <= 1 << PID_BITS


PID_BITS = 17
_launch: list[_Launch | None] = [None]
_tables: dict[int, list[tuple[int, int]]] = {}   # a pointer table's data_ptr -> the ranges of its tensors


def extent(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, one past the last byte] a tensor's elements occupy, or None when it has none."""
    if t.numel() == 0:
        return None
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


def _program() -> int:
    (x, y, z), (gx, gy, _) = interp.interpreter_builder.grid_idx, interp.interpreter_builder.grid_dim
    return x + gx * (y + gy * z)


def _tagged(p: np.ndarray) -> np.ndarray:
    return (p << np.uint64(PID_BITS)) | np.uint64(_program())


def _access(ptrs, mask, what: str) -> np.ndarray | None:
    """The masked-in addresses of one access, checked against the launch's ranges."""
    launch = _launch[0]
    if launch is None:
        return None
    p = np.asarray(ptrs.data).astype(np.uint64, copy=False)
    # masks arrive as int1 arrays of 0/1: as an index they would gather, not select
    p = p[np.broadcast_to(np.asarray(mask.data).astype(bool, copy=False), p.shape)]
    if p.size == 0:
        return None
    lo, hi = int(p.min()), int(p.max())
    if any(a <= lo and hi < b for a, b in launch.ranges):
        return p
    if launch.table_ranges:
        inside = np.zeros(p.shape, bool)
        for a, b in launch.table_ranges:
            inside |= (p >= a) & (p < b)
        if inside.all():
            return p
    hit = [f"{b - a} B argument at +{(lo - a):d}" for a, b in launch.ranges if a <= hi and lo < b]
    raise MemoryFault(f"{launch.name}: program {interp.interpreter_builder.grid_idx} {what}s "
                      f"{p.size} addresses outside any one tensor argument ({', '.join(hit) or 'none of them'})")


def _check_programs(launch: _Launch) -> None:
    """No address stored by two programs, none loaded by a program other than the one that stores it."""
    if not launch.stores:
        return
    shift, low = np.uint64(PID_BITS), np.uint64((1 << PID_BITS) - 1)
    stored = np.unique(np.concatenate(launch.stores))   # distinct (address, program) pairs, by address
    addr = stored >> shift
    twice = addr[1:] == addr[:-1]
    if twice.any():
        raise MemoryFault(f"{launch.name}: {int(twice.sum())} addresses stored by more than one program "
                          f"(first {int(addr[1:][twice][0]):#x})")
    if not launch.loads:
        return
    loaded = np.unique(np.concatenate(launch.loads))
    i = np.searchsorted(addr, loaded >> shift)
    hit = (i < len(addr)) & (addr[np.minimum(i, len(addr) - 1)] == loaded >> shift)
    other = (stored[i[hit]] & low) != (loaded[hit] & low)
    if other.any():
        raise MemoryFault(f"{launch.name}: program {int(loaded[hit][other][0] & low)} loads {int(other.sum())} "
                          f"addresses that another program of the launch stores")


def install() -> None:
    """Wrap the interpreter's launches, loads, stores and atomics, and AttnRes' address tables."""
    executor, builder = interp.GridExecutor, interp.InterpreterBuilder
    init_args, call = executor._init_args_hst, executor.__call__
    load, store, atomic = builder.create_masked_load, builder.create_masked_store, builder.create_atomic_rmw

    def _init_args_hst(self, args_dev, kwargs):
        args, kw = init_args(self, args_dev, kwargs)
        tensors = [a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)]
        ranges = [e for e in map(extent, tensors) if e]
        tables = [r for t in tensors for r in _tables.get(t.data_ptr(), ())]
        _launch[0] = _Launch(self.fn.__name__, ranges, tables)
        return args, kw

    def __call__(self, *args, **kwargs):
        try:
            result = call(self, *args, **kwargs)
            if _launch[0] is not None:
                _check_programs(_launch[0])
            return result
        finally:
            _launch[0] = None

    def create_masked_load(self, ptrs, mask, other, *rest):
        p = _access(ptrs, mask, "load")
        if p is not None and _launch[0].track:
            _launch[0].loads.append(_tagged(p))
        return load(self, ptrs, mask, other, *rest)

    def create_masked_store(self, ptrs, value, mask, *rest):
        p = _access(ptrs, mask, "store")
        if p is not None and _launch[0].track:
            _launch[0].stores.append(_tagged(p))
        return store(self, ptrs, value, mask, *rest)

    def create_atomic_rmw(self, op, ptr, val, mask, *rest):
        _access(ptr, mask, "atomic")
        return atomic(self, op, ptr, val, mask, *rest)

    executor._init_args_hst, executor.__call__ = _init_args_hst, __call__
    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
    builder.create_atomic_rmw = create_atomic_rmw

    from k3cli.ops.attnres import fused
    address_table = fused.address_table

    def tracked_address_table(srcs):
        table = address_table(srcs)
        _tables[table.data_ptr()] = [e for e in map(extent, srcs) if e]
        return table

    fused.address_table = tracked_address_table
