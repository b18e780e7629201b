"""Cheaper Triton launches for kernels launched many times per call (chunk_kda's ranges and stages).

`kernel[grid](*args, **meta)` through Triton's JITFunction.run (and Autotuner.run) re-binds and re-specialises
every argument on every launch: on the H200's host about 32 us for an empty kernel with 20 tensor arguments
(session 9, scripts/kda_host_profile.py), so chunk_kda's 16-launch forward at B1 T16384 spent ~0.8-1.0 ms of
host time per ~1.2 ms on the device. `fast_launch` wraps a kernel (JITFunction or Autotuner) so that, after
the first launch with a given specialisation has gone through Triton's own path (compile, autotune), later
launches with the same one call the compiled kernel's launcher directly.

The cache key is finer than Triton's specialisation, so a hit always means the kernel Triton would run:
tensors by (dtype, 16-byte alignment of the data pointer); every other argument (ints, floats, None, the
constexpr meta-parameters, num_warps / num_stages) by value; the current device. An Autotuner's choice is a
function of its key arguments' values and the tensors' dtypes, both in the key. Where that does not hold the
wrapper steps aside: Triton's interpreter, a launch hook set (profilers; checked by `configure`), an autotuner
config with a pre-hook. `configure(False)` (chunk.TUNING fast_launch) sends every launch through Triton's path.
"""
from __future__ import annotations

import inspect

import torch
from triton import knobs
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

_ON = True   # configure(): chunk.TUNING fast_launch, and no launch hook set
_MAX_ENTRIES = 512   # per kernel; cleared when full (ints are keyed by value, so varying T adds entries)


def _raw_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


try:   # the call Triton itself uses for the current stream
    from torch._C import _cuda_getCurrentRawStream as _raw_stream  # noqa: F811
except ImportError:   # pragma: no cover - CPU-only torch builds
    pass


class FastLaunch:
    """A Triton kernel whose `kernel[grid](...)` launches skip Triton's per-launch binding once cached."""

    def __init__(self, fn):
        jit = fn
        while not isinstance(jit, JITFunction) and hasattr(jit, "fn"):
            jit = jit.fn
        # Triton's interpreter (TRITON_INTERPRET=1) makes InterpretedFunction, not JITFunction: not usable
        self.__dict__.update(fn=fn, jit=jit, tuner=fn if isinstance(fn, Autotuner) else None, launches={},
                             usable=isinstance(jit, JITFunction))
        if self.usable:
            self.names = tuple(jit.arg_names)
            self.defaults = {n: p.default for n, p in inspect.signature(jit.fn).parameters.items()
                             if p.default is not inspect.Parameter.empty}

    def __getattr__(self, name):   # .fn, .cache, .configs, ... of the wrapped kernel (reads only)
        return getattr(self.__dict__["fn"], name)

    def __getitem__(self, grid):
        if not (_ON and self.usable):
            return self.fn[grid]
        return lambda *args, **kw: self._launch(grid, args, kw)

    def _launch(self, grid, args, kw):
        device = torch.cuda.current_device()
        key = (device, tuple([(a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a for a in args]),
               tuple(kw.items()))
        hit = self.launches.get(key)
        if hit is None:
            return self._miss(grid, args, kw, key)
        kernel, tail, meta = hit
        if callable(grid):
            grid = grid({**dict(zip(self.names, args)), **meta})
        n = len(grid)
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *tail)
        return kernel

    def _miss(self, grid, args, kw, key):
        kernel = self.fn[grid](*args, **kw)   # Triton's own path: compiles and autotunes where needed
        if kernel is None:
            return kernel
        cfg = {}
        if self.tuner is not None:
            best = self.tuner.best_config
            if best.pre_hook is not None:
                return kernel
            cfg = best.kwargs
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        meta = {**self.defaults, **{k: v for k, v in kw.items() if k in self.names}, **cfg}
        try:
            tail = tuple(meta[n] for n in self.names[len(args):])
        except KeyError:   # a parameter neither passed nor defaulted: Triton raised already; keep its path
            return kernel
        if len(self.launches) >= _MAX_ENTRIES:
            self.launches.clear()
        self.launches[key] = (kernel, tail, meta)
        return kernel


def _hooks_set() -> bool:
    """Whether a launch hook is set (profilers: Triton's proton, torch's): Triton 3.6 keeps them in HookChain
    objects (empty when none), earlier versions as a callable or None."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def configure(enabled: bool = True) -> bool:
    """Turn the direct launches on or off (chunk_kda calls this with chunk.TUNING fast_launch on every call);
    they stay off while a launch hook is set, which only Triton's path calls. Returns whether they are on."""
    global _ON
    _ON = enabled and not _hooks_set()
    return _ON


def fast_launch(fn) -> FastLaunch:
    """Decorator (outermost, above @triton.autotune / @triton.jit) for kernels launched from the host."""
    return FastLaunch(fn)


# Host-side arithmetic for launch grids: triton.cdiv / triton.next_power_of_2 are constexpr functions in
# Triton 3.6 whose host calls unwrap their arguments first (a few us each, ~30 per chunk_kda forward).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0   # as triton.next_power_of_2 (0 -> 0)


configure(True)
