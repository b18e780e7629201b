"""Cheaper Triton launches for kernels launched many times per call (chunk_kda's ranges and stages).

`kernel[grid](*args, **meta)` through Triton's JITFunction.run (and Autotuner.run) re-binds and re-specialises
every argument on every launch, and its C launcher asks the driver about every tensor's pointer: on an H200
host 32-44 us for an empty kernel with 20 tensor arguments, so chunk_kda's 16-launch forward at B1 T16384 spent
0.73-1.46 ms of host time per ~1.2 ms on the device (0.55 ms with these launches).
`fast_launch` wraps a kernel (JITFunction or Autotuner) so that, after the first launch with a given
specialisation has gone through Triton's own path (compile, autotune, pointer checks), later launches with
the same one call the compiled kernel's C launch function directly, tensors passed as their data pointers.

The cache key is finer than Triton's specialisation, so a hit always means the kernel Triton would run:
tensors by (dtype, on CUDA or not, 16-byte alignment of the data pointer); every other argument (ints,
floats, None, the constexpr meta-parameters, num_warps / num_stages) by type and value; the current device.
An Autotuner's choice is a function of its key arguments' values and the tensors' dtypes, both in the key.
Where that does not hold the wrapper steps aside: Triton's interpreter, Triton other than 3.6 (whose
launcher convention this uses), a launch hook set (profilers) or Triton's debug / instrumentation mode
(checked by `configure`), pre-run hooks on the kernel (checked per launch), an autotuner config with a
pre-hook, tensors passed by keyword (never cached). Skipped on a hit, as the key cannot change them:
Triton's check that the kernel's global constants have not changed since it was compiled.
`configure(False)` sends every launch through Triton's path (the exactness test compares the two).
"""
from __future__ import annotations

import inspect

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

try:
    from triton import knobs  # Triton >= 3.4; the direct launches need 3.6 anyway (FastLaunch.usable)
except ImportError:
    knobs = None

_ENABLED = True   # configure(enabled): the caller's choice, kept until changed
_ON = True   # configure(): enabled, and no launch hook set
_MAX_ENTRIES = 512   # per kernel; cleared when full (ints are keyed by value, so varying T adds entries)


def _current_device() -> int:
    return torch.cuda.current_device()


def _raw_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


try:   # the calls Triton itself uses for the current stream and device (without torch's lazy-init check)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream  # noqa: F811
    from torch._C import _cuda_getDevice as _current_device  # noqa: F811
except ImportError:   # CPU-only torch builds: launches never reach these
    pass


class FastLaunch:
    """A Triton kernel whose `kernel[grid](...)` launches skip Triton's per-launch binding once cached."""

    def __init__(self, fn):
        jit = fn
        while not isinstance(jit, JITFunction) and hasattr(jit, "fn"):
            jit = jit.fn
        # Triton's interpreter (TRITON_INTERPRET=1) makes InterpretedFunction, not JITFunction: not usable; the
        # launcher's calling convention used here is Triton 3.6's (pyproject allows older: their path instead)
        self.__dict__.update(wrapped=fn, jit=jit, tuner=fn if isinstance(fn, Autotuner) else None, launches={},
                             usable=isinstance(jit, JITFunction) and triton.__version__.startswith("3.6."))
        if self.usable:
            self.names = tuple(jit.arg_names)
            self.defaults = {n: p.default for n, p in inspect.signature(jit.fn).parameters.items()
                             if p.default is not inspect.Parameter.empty}

    def __getattr__(self, name):   # .fn, .cache, .configs, ... of the wrapped kernel (reads only)
        try:
            wrapped = self.__dict__["wrapped"]
        except KeyError:   # not initialised (copy / pickle probing): no such attribute
            raise AttributeError(name) from None
        return getattr(wrapped, name)

    def __getitem__(self, grid):
        if not (_ON and self.usable) or self.jit.pre_run_hooks:
            return self.wrapped[grid]
        return lambda *args, **kw: self._launch(grid, args, kw)

    def _launch(self, grid, args, kw):
        device = _current_device()
        key, vals = launch_key(device, args, kw)
        hit = self.launches.get(key)
        if hit is None:
            return self._miss(grid, args, kw, key)
        kernel, run, tail, meta = hit
        if callable(grid):
            grid = grid({**dict(zip(self.names, args)), **meta})
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(device), *vals, *tail)
        return kernel

    def _miss(self, grid, args, kw, key):
        kernel = self.wrapped[grid](*args, **kw)   # Triton's own path: compiles and autotunes where needed
        if kernel is None or any(isinstance(v, torch.Tensor) for v in kw.values()):
            return kernel   # keyword tensors: the key would hold them by value (and keep them alive)
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
        self.launches[key] = (kernel, _direct_run(kernel), tail, meta)
        return kernel


def launch_key(device: int, args: tuple, kw: dict) -> tuple[tuple, list]:
    """(cache key, launch arguments) of one launch. Tensors go to the launcher as their data pointers (ints): it
    then skips calling data_ptr() again and the driver's pointer query per tensor (the first launch, through
    Triton, has checked them already); in the key as (dtype, on CUDA, 16-byte aligned). Everything else by type
    and value: True == 1 == 1.0 as dict keys, but Triton specialises them apart."""
    spec, vals = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            p = a.data_ptr()
            spec.append((a.dtype, a.is_cuda, not p & 15))
            vals.append(p)
        else:
            spec.append(a.__class__)
            spec.append(a)
            vals.append(a)
    return (device, tuple(spec), tuple(kw.items()), tuple(map(type, kw.values()))), vals


def _direct_run(kernel):
    """run(gx, gy, gz, stream, *kernel_args) for a compiled kernel whose handles are loaded: its C launch
    function itself where the launcher needs no scratch buffers, else the launcher object; no launch hooks."""
    launcher, function, packed = kernel.run, kernel.function, kernel.packed_metadata
    raw = getattr(launcher, "launch", None)
    if raw is not None and not getattr(launcher, "global_scratch_size", 1) \
            and not getattr(launcher, "profile_scratch_size", 1):
        coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl

        def run(gx, gy, gz, stream, *args):
            raw(gx, gy, gz, stream, function, coop, pdl, None, None, packed, None, None, None, *args)
    else:
        def run(gx, gy, gz, stream, *args):
            launcher(gx, gy, gz, stream, function, packed, None, None, None, *args)
    return run


def _hooks_set() -> bool:
    """Whether a launch hook is set (profilers: Triton's proton, torch's): Triton 3.6 keeps them in HookChain
    objects (empty when none), earlier versions as a callable or None."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def configure(enabled: bool | None = None) -> bool:
    """Turn the direct launches on or off (None: keep the last choice; chunk_kda calls this on every forward
    and backward to re-check the rest); they stay off while a launch hook is set, which only Triton's path
    calls, and in Triton's debug or instrumentation modes, which select other binaries than the cached ones.
    Returns whether they are on."""
    global _ENABLED, _ON
    if enabled is not None:
        _ENABLED = enabled
    _ON = (_ENABLED and knobs is not None and not _hooks_set() and not knobs.runtime.debug
           and not getattr(knobs.compilation, "instrumentation_mode", ""))
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


configure()
