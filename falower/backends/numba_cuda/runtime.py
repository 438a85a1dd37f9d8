"""Compile, cache and launch the generated FA2 kernels.

The emitted source is written to `<cache dir>/<name>_<sha256[:16]>.py` (default cache dir
`~/.cache/falower/kernels`, override with `FALOWER_CACHE_DIR`) and imported from there, so Numba's
`cache=True` can keep the compiled kernel next to it and a second process skips compilation.

    kern = FA2ForwardKernel(spec)
    o, lse = kern(q, k, v, *captures)     # torch CUDA tensors, CUDA-array-interface arrays or numpy

Inputs are checked before anything is launched; a wrong dtype, rank, shape, layout or device raises a
one-line ValueError / TypeError.

Torch CUDA tensors take a direct path: each kernel is compiled once for its canonical signature
(`argtypes()`) when the kernel object is built, and launched with the driver's `cuLaunchKernel` on torch's
current stream from a ctypes argument buffer laid out as Numba's kernel ABI (`ArgLayout`), kept per input
signature (`_ForwardPlan`, `_BackwardPlan`) so that a call patches data pointers and launches: no typing of
arrays, no host synchronisation, capturable in a CUDA graph. numpy inputs, other CUDA arrays and the
simulator go through Numba's dispatcher (`prepare`). `FALOWER_DIRECT_LAUNCH=0` turns the direct path off.

The direct path's kernels come from falower's cubin cache when it has them (`cubin_cache`: `<cache
dir>/cubin/`, loaded with the driver through ctypes), so a warm process never imports Numba: the emitted
modules (and with them numba.cuda) are imported only when a kernel must be compiled or takes Numba's path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import math
import os
import re
import struct
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from ...passes.lse_cotangent import check_dlse
from . import cubin_cache, graph_capture
from .block_data import BlockTables
from .emit_fa2 import (cluster_parts, emit_block_mask, emit_fa2_forward, grid, smem_bytes, threads_per_block,
                       uses_fused_merge, uses_kv_maps, uses_o_map, uses_work_counter)
from .emit_fa2_bwd import (bwd_grid, bwd_smem_bytes, bwd_threads, delta_grid, delta_rows, dq_convert_launch, dq_grid,
                           dq_smem_bytes, dq_threads)
from .spec import FA2BackwardSpec, FA2ForwardSpec
from .tensor_maps import MAP_BYTES, TensorMaps, o_map_geometry, qkv_map_geometry

__all__ = ["FA2BackwardKernel", "FA2ForwardKernel", "cache_dir", "load_source", "ptx_of", "resource_usage"]

_NP_DTYPES = {"f16": np.float16, "f32": np.float32, "f64": np.float64}


def _acc_np(dtype: str):
    """numpy type of the f32 statistics and accumulators (lse, delta, dQ, tables' gradients); f64 for f64."""
    return np.float64 if dtype == "f64" else np.float32


def _acc_torch(dtype: str):
    import torch

    return torch.float64 if dtype == "f64" else torch.float32


def cache_dir() -> Path:
    d = os.environ.get("FALOWER_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "falower" / "kernels"


def load_source(source: str, stem: str) -> Any:
    """Write `source` to a content-addressed file under cache_dir() and import it as a module."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}_{digest}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    modname = f"falower_kernels.{stem}_{digest}"
    if modname in sys.modules:
        return sys.modules[modname]
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    spec.loader.exec_module(module)
    return module


_EMITTERS: list[str] = []  # a hash of the emitters' own source, read once per process


def _emitter_version() -> str:
    if not _EMITTERS:
        h = hashlib.sha256()
        here = Path(__file__).resolve().parent
        for name in sorted(p.name for p in here.glob("*.py")):
            h.update(name.encode())
            h.update((here / name).read_bytes())
        _EMITTERS.append(h.hexdigest()[:16])
    return _EMITTERS[0]


def emit_cached(emit: Any, spec: Any, what: str) -> str:
    """`emit(spec)`, remembered on disk next to the kernels: keyed by the spec (its repr: every field, the
    device functions' source included) and a hash of the backend's own files, so a new process with a warm
    cache reads the source instead of emitting it again (about 0.2 s a kernel), and an edited emitter
    emits anew."""
    key = hashlib.sha256(f"{what}|{_emitter_version()}|{spec!r}".encode()).hexdigest()[:24]
    directory = cache_dir() / "emitted"
    path = directory / f"{key}.py"
    try:
        return path.read_text()
    except OSError:
        pass
    source = emit(spec)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    os.replace(tmp, path)
    return source


def _ident(what: str, spec: Any, source: str) -> str:
    """What identifies a kernel in the cubin cache (cubin_cache.cache_key adds the device and toolchain): its
    role, its spec, its emitted source and the backend's own files (the argument types, the intrinsics)."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    return f"{what}|{_emitter_version()}|{digest}|{spec!r}"


# --------------------------------------------------------------------------------------------------
# Array handling
# --------------------------------------------------------------------------------------------------


def _kind(x: Any) -> str:
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    raise TypeError(f"expected a torch tensor, a CUDA array or a numpy array, got {type(x).__name__}")


def _dtype_name(x: Any, kind: str) -> str:
    if kind == "torch":
        import torch

        return {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
                torch.float64: "f64"}.get(x.dtype, str(x.dtype))
    dt = np.dtype(x.dtype) if kind == "numpy" else np.dtype(x.__cuda_array_interface__["typestr"])
    if dt.name == "bfloat16" or dt == np.dtype(np.uint16):  # ml_dtypes.bfloat16, or raw bf16 bits
        return "bf16"
    return {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}.get(dt, str(dt))


def _is_contiguous(x: Any, kind: str) -> bool:
    if kind == "torch":
        return x.is_contiguous()
    if kind == "numpy":
        return x.flags.c_contiguous
    cai = x.__cuda_array_interface__
    strides = cai.get("strides")
    if strides is None:
        return True
    item = np.dtype(cai["typestr"]).itemsize
    expect, acc = [], item
    for n in reversed(cai["shape"]):
        expect.append(acc)
        acc *= n
    return tuple(strides) == tuple(reversed(expect))


def _device_id(x: Any, kind: str) -> int | None:
    if kind == "torch":
        return x.device.index if x.is_cuda else None
    return -1 if kind == "cai" else None


# --------------------------------------------------------------------------------------------------
# Compile progress
# --------------------------------------------------------------------------------------------------
SLOW_COMPILE_S = 1.0  # a build that takes longer than this says so on stderr


@contextmanager
def compile_progress(label: str) -> Iterator[None]:
    """One line on stderr when building `label` (emission and Numba's compile) passes SLOW_COMPILE_S, one
    with the seconds when it is done; nothing for a fast build (a warm disk cache) or with FALOWER_QUIET=1."""
    if os.environ.get("FALOWER_QUIET") == "1":
        yield
        return
    start = time.perf_counter()
    said = threading.Event()

    def announce() -> None:
        said.set()
        print(f"[falower] compiling {label}...", file=sys.stderr, flush=True)

    timer = threading.Timer(SLOW_COMPILE_S, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            print(f"[falower] compiled {label} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _label(spec: Any, kind: str) -> str:
    """What the compile line names: the kernel, its pass, dtype, D, tiles and schedule (the kernel a call's sizes
    chose is visible as it builds: at D = 64 one compiled object may build two)."""
    if kind == "backward":
        from .emit_fa3_bwd import uses_wgmma

        sched = "wgmma" if uses_wgmma(spec) else "mma"
    else:
        sched = spec.extra.get("schedule") or "mma"
    first = ", short q tile first" if getattr(spec, "ragged_q_first", False) else ""
    if kind == "forward" and sched == "wgmma-ws":
        from .emit_fa3_ws import col_mma

        first += ", column term in S" if col_mma(spec) else ""  # ALiBi's slope times the column, by the product
    return f"{spec.name} ({kind}, {spec.dtype}, D={spec.head_dim}, {spec.block_q}x{spec.block_k} {sched}{first})"


def _simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


_GPU: Optional[bool] = None


def _has_gpu() -> bool:
    """A real CUDA device (not the simulator), asked of the driver through ctypes (no Numba import); once."""
    global _GPU
    if _GPU is None:
        if _simulated():
            return False
        drv = cubin_cache.driver()
        _GPU = bool(drv is not None and drv.available())
    return _GPU


def _ask_device(attribute: str) -> Any:
    """`Driver.<attribute>(device)` of the current device (the driver's current context, else device 0), through
    ctypes (no Numba import); None in the simulator, where there is no GPU, or where the driver refuses."""
    if not _has_gpu():
        return None
    drv = cubin_cache.driver()
    try:
        return getattr(drv, attribute)(drv.current_device())
    except cubin_cache.DriverError:
        return None


def device_cc() -> Optional[tuple[int, int]]:
    """Compute capability of the current device, or None (`_ask_device`). The automatic choice of the wgmma kernel
    reads it (compiler.py, emit_fa3.auto_extra)."""
    return _ask_device("compute_capability")


def device_sm_count() -> Optional[int]:
    """The current device's multiprocessor count, or None (`_ask_device`). The automatic choice sizes its persistent
    launch by it (emit_fa3.auto_extra)."""
    return _ask_device("sm_count")


def _direct_enabled() -> bool:
    return os.environ.get("FALOWER_DIRECT_LAUNCH", "1") != "0" and _has_gpu()


# --------------------------------------------------------------------------------------------------
# Direct launches: Numba's kernel ABI, packed by hand
# --------------------------------------------------------------------------------------------------
class ArgLayout:
    """Where each argument of a Numba CUDA kernel lives among its parameters, in Numba's ABI
    (`numba.cuda.dispatcher._Kernel._prepare_args`): an N-d array is 5 + 2N parameters (meminfo, parent,
    nitems, itemsize, data pointer, shape[0..N-1], strides[0..N-1] in bytes; meminfo and parent are null),
    a scalar is one parameter of its C type. Every parameter gets an 8-byte slot of one int64 buffer (the
    driver copies each parameter's own size from its slot, little-endian), so a call patches slots in place.
    Pure bookkeeping: testable without a GPU."""

    def __init__(self, argtypes: tuple) -> None:
        self._build(describe_argtypes(argtypes), tuple(argtypes))

    @classmethod
    def from_description(cls, description: tuple) -> "ArgLayout":
        """The layout of `describe()`'s output: how a kernel loaded from falower's cubin cache (no Numba in the
        process) gets its layout."""
        layout = cls.__new__(cls)
        layout._build(tuple(description), tuple(f"{k}[{nd}d]" if k == "array" else k for k, nd, _ in description))
        return layout

    def describe(self) -> tuple[tuple[str, int, int], ...]:
        """(kind, ndim, itemsize) per argument: all the layout depends on, as plain data (stored in the cache)."""
        return tuple(zip(self.kinds, self.ndim, self.itemsize))

    def _build(self, description: tuple, argtypes: tuple) -> None:
        self.argtypes = argtypes
        self.first: list[int] = []     # first slot of each argument
        self.ndim: list[int] = []      # array rank, or -1 for a scalar
        self.itemsize: list[int] = []  # array element size, or the scalar's size
        self.kinds: list[str] = []     # "array", "int", "f16", "f32", "f64", "bool"
        n = 0
        for kind, ndim, itemsize in description:
            if kind not in _ARG_KINDS or (kind == "array") != (ndim >= 0):
                raise ValueError(f"not an argument description: {(kind, ndim, itemsize)}")
            self.first.append(n)
            self.kinds.append(kind)
            self.ndim.append(int(ndim))
            self.itemsize.append(int(itemsize))
            n += 5 + 2 * ndim if kind == "array" else 1
        self.nslots = n

    def data_slot(self, i: int) -> int:
        """The slot of array argument i's data pointer."""
        return self.first[i] + 4

    def array_slots(self, i: int, shape: tuple[int, ...]) -> dict[int, int]:
        """Every slot of array argument i but its data pointer, for a C-contiguous array of `shape`."""
        nd = self.ndim[i]
        if nd < 0:
            raise TypeError(f"argument {i} is a scalar ({self.argtypes[i]}), not an array")
        if len(shape) != nd:
            raise ValueError(f"argument {i} is a {nd}-d array, got shape {tuple(shape)}")
        f, item = self.first[i], self.itemsize[i]
        out = {f: 0, f + 1: 0, f + 2: int(np.prod(shape, dtype=np.int64)) if shape else 1, f + 3: item}
        stride = item
        for d in reversed(range(nd)):
            out[f + 5 + d] = int(shape[d])
            out[f + 5 + nd + d] = stride
            stride *= int(shape[d])
        return out

    def scalar_slot(self, i: int, value: Any) -> tuple[int, int]:
        """(slot, int64 bit pattern) of scalar argument i holding `value`, as the kernel reads its C type."""
        kind = self.kinds[i]
        if kind == "array":
            raise TypeError(f"argument {i} is an array ({self.argtypes[i]}), not a scalar")
        return self.first[i], pack_scalar(kind, value, self.itemsize[i])


_ARG_KINDS = ("array", "int", "f16", "f32", "f64", "bool")


def describe_argtypes(argtypes: tuple) -> tuple[tuple[str, int, int], ...]:
    """(kind, ndim, itemsize) of each Numba argument type, as ArgLayout takes them (ndim -1 for a scalar)."""
    from numba import types
    from numba.np.numpy_support import as_dtype

    out = []
    for t in argtypes:
        if isinstance(t, types.Array):
            if t.layout != "C":
                raise TypeError(f"direct launches take C-contiguous arrays, got {t}")
            out.append(("array", t.ndim, as_dtype(t.dtype).itemsize))
            continue
        if isinstance(t, types.Boolean):
            kind = "bool"
        elif isinstance(t, types.Integer):
            kind = "int"
        elif t in (types.float16, types.float32, types.float64):
            kind = {types.float16: "f16", types.float32: "f32", types.float64: "f64"}[t]
        else:
            raise TypeError(f"direct launches take arrays, integers, floats and booleans, got {t}")
        out.append((kind, -1, as_dtype(t).itemsize))
    return tuple(out)


def pack_scalar(kind: str, value: Any, size: int) -> int:
    """The signed int64 whose low `size` bytes hold `value` as a C scalar of `kind` (little-endian)."""
    if kind == "bool":
        bits = 1 if value else 0
    elif kind == "int":
        v = int(value)
        if not -(1 << (8 * size - 1)) <= v < (1 << (8 * size)):  # (signed or unsigned: the kernel's C type says)
            raise ValueError(f"{v} does not fit the kernel's {8 * size}-bit integer argument")
        bits = v & ((1 << (8 * size)) - 1)
    elif kind == "f16":
        bits = int(np.array(value, dtype=np.float16).view(np.uint16))
    elif kind == "f32":
        bits = struct.unpack("<I", struct.pack("<f", float(value)))[0]
    else:
        bits = struct.unpack("<Q", struct.pack("<d", float(value)))[0]
    return bits - (1 << 64) if bits >= 1 << 63 else bits


class ArgBuffer:
    """The parameters of one launch: an int64 slot per parameter and the array of pointers to the slots
    that cuLaunchKernel reads (`address`). The driver copies the parameters when the launch is enqueued,
    so one buffer serves every call (one thread at a time)."""

    __slots__ = ("layout", "vals", "params", "address")

    def __init__(self, layout: ArgLayout) -> None:
        self.layout = layout
        n = max(layout.nslots, 1)
        self.vals = (ctypes.c_int64 * n)()
        base = ctypes.addressof(self.vals)
        self.params = (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
        self.address = ctypes.addressof(self.params)

    def set(self, slots: dict[int, int]) -> None:
        vals = self.vals
        for i, x in slots.items():
            vals[i] = x

    def array(self, i: int, shape: tuple[int, ...], ptr: int = 0) -> int:
        """Fill array argument i's slots; returns the slot of its data pointer (patched at each call)."""
        self.set(self.layout.array_slots(i, shape))
        slot = self.layout.data_slot(i)
        self.vals[slot] = ptr
        return slot

    def scalar(self, i: int, value: Any) -> int:
        slot, bits = self.layout.scalar_slot(i, value)
        self.vals[slot] = bits
        return slot


class DirectKernel:
    """One generated kernel for the direct launches. Its image (cubin, entry symbol, parameter layout) comes
    from falower's cubin cache (`cubin_cache`: the process never imports Numba) or else from Numba's compile
    for `argtypes` (`compile_unbound`, linked by `link_cubin`), and is then stored there; `function(device)` loads it with
    the driver (cuModuleLoadData) in the device's primary context, shared memory limit raised once.

    `dispatcher` and `argtypes` are functions, called only when the kernel must be compiled (both import
    Numba). `ident` names the kernel and the code that made it (role, spec, emitted source, a hash of the
    backend's files): the cache key but for the device's compute capability. Built for `device` (default:
    the current context's device), so that constructing the kernel object is where a compile happens."""

    def __init__(self, dispatcher: Callable[[], Any], argtypes: Callable[[], tuple], smem: int, ident: str,
                 device: Optional[int] = None) -> None:
        self._dispatcher, self._argtypes = dispatcher, argtypes
        self.smem = smem
        self.ident = ident
        self._images: dict[tuple[int, int], tuple[str, cubin_cache.KernelImage, bool]] = {}  # cc -> key, image, cached
        self._funcs: dict[int, int] = {}
        self._layout: Optional[ArgLayout] = None
        drv = cubin_cache.driver()
        self.image(drv.compute_capability(drv.current_device() if device is None else device))

    @property
    def layout(self) -> ArgLayout:
        if self._layout is None:
            self._layout = ArgLayout(self._argtypes())
        return self._layout

    def image(self, cc: tuple[int, int]) -> cubin_cache.KernelImage:
        """The kernel compiled for compute capability `cc`: from the cache, else compiled and stored."""
        got = self._images.get(cc)
        if got is None:
            key = cubin_cache.cache_key(self.ident, cc)
            img = cubin_cache.load(key)
            cached = img is not None
            if img is None:
                img = self.compile(cc)
                cubin_cache.store(key, img)
            got = self._images[cc] = (key, img, cached)
            if self._layout is None:
                self._layout = ArgLayout.from_description(img.layout)
        return got[1]

    def compile(self, cc: tuple[int, int]) -> cubin_cache.KernelImage:
        """Numba's compile of the kernel for exactly `argtypes`, linked for `cc`, as a cacheable image."""
        argtypes = tuple(self._argtypes())
        compiled = compile_unbound(self._dispatcher(), argtypes)
        lib = compiled._codelibrary
        if lib._setup_functions or getattr(compiled, "debug", False) or getattr(compiled, "cooperative", False) \
                or getattr(compiled, "shared_memory_carveout", None) is not None:
            raise RuntimeError("falower's direct launches load a plain cubin: a kernel with module setup, debug, "
                               "a cooperative launch or a carveout needs Numba's launch (FALOWER_DIRECT_LAUNCH=0)")
        # the target Numba itself links for (CUDACodeLibrary._ensure_cc): sm_90a, not sm_90, on an H100, so
        # architecture-specific PTX (wgmma) assembles
        target = (cc[0], cc[1], "a" if tuple(cc) >= (9, 0) else "")
        return cubin_cache.KernelImage(lib._entry_name, link_cubin(lib, target), describe_argtypes(argtypes), self.smem)

    def function(self, device: int) -> int:
        """The CUfunction in `device`'s primary context (torch's and Numba's), loaded on first use. A cached
        cubin the driver refuses is dropped from the cache and compiled again, once."""
        func = self._funcs.get(device)
        if func is None:
            drv = cubin_cache.driver()
            cc = drv.compute_capability(device)
            img = self.image(cc)
            try:
                func = drv.load_function(device, img.cubin, img.name, img.smem)
            except cubin_cache.DriverError as e:
                key, _, cached = self._images[cc]
                if not cached:
                    raise
                print(f"[falower] cached kernel {key} did not load ({e}); compiling it again", file=sys.stderr)
                cubin_cache.discard(key)
                img = self.compile(cc)
                cubin_cache.store(key, img)
                self._images[cc] = (key, img, False)
                func = drv.load_function(device, img.cubin, img.name, img.smem)
            self._funcs[device] = func
        return func


_CU: Any = None


def _cu() -> Any:
    global _CU
    if _CU is None:
        from cuda.bindings import driver as cu

        _CU = cu
    return _CU


def _ctypes_launch() -> Any:
    """libcuda's cuLaunchKernel through ctypes (about a microsecond a call; the cuda.bindings wrapper
    measured 5.5 us on an H100 host, building a parameter helper and handle objects each call), or None."""
    u = ctypes.c_uint
    return cubin_cache.libcuda_function("cuLaunchKernel", [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p,
                                                           ctypes.c_void_p, ctypes.c_void_p])


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID: the kernel may start before the one before it ends
_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID: the blocks run in clusters of (x, y, z)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte value union (8-aligned)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def _ctypes_launch_ex() -> Any:
    """libcuda's cuLaunchKernelEx through ctypes (launch attributes), or None."""
    return cubin_cache.libcuda_function("cuLaunchKernelEx", [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                                             ctypes.c_void_p, ctypes.c_void_p])


def _launch_config(grid: tuple, block: int, smem: int, attr: _LaunchAttribute) -> _LaunchConfig:
    """cuLaunchKernelEx's configuration: `grid`, `block` threads along x, `smem` bytes, the one attribute `attr`
    (which the caller keeps alive: the configuration points into it)."""
    return _LaunchConfig(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(block, 1, 1), smem=smem,
                         attrs=ctypes.pointer(attr), num_attrs=1)


def _cluster_attribute(width: int) -> _LaunchAttribute:
    """The launch attribute of clusters of `width` blocks along x."""
    attr = _LaunchAttribute(id=_CLUSTER_DIMENSION)
    attr.value[0] = int(width) | (1 << 32)  # clusterDim {x, y, z}: x and y in the union's first 8 bytes
    attr.value[1] = 1  # z
    return attr


def _programmatic_launcher(handle: int, grid: tuple, block: int, smem: int, address: int, plain: Any) -> Any:
    """`plain`'s launch with programmatic stream serialization: the kernel's blocks may be placed while the kernel
    before it on the stream still runs (once that one's blocks have all run griddep_launch_dependents), and it
    waits for that kernel's writes at its griddep_wait (sm_90: what hides split-kv's merge's launch behind the
    parts' last items). Where the driver refuses the attribute, `plain` from then on. FALOWER_PDL=0 turns it off."""
    fn = _ctypes_launch_ex()
    if fn is None or os.environ.get("FALOWER_PDL", "1") == "0":
        return plain
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed, the union's first int (little-endian)
    config = _launch_config(grid, block, smem, attr)
    ref = ctypes.byref(config)  # (made once: a call's byref costs host time)
    refused: list = []

    def run(stream: int) -> None:
        if refused:
            return plain(stream)
        config.stream = stream
        err = fn(ref, handle, address, None)
        if err:
            refused.append(err)
            from ...passes.manager import debug_level

            if debug_level() >= 1:
                print(f"[falower] cuLaunchKernelEx refused the programmatic launch (CUresult {err}): plain "
                      "launches from now on", file=sys.stderr)
            plain(stream)

    run.keep = (attr, config)  # type: ignore[attr-defined]  # the structures the pointers above point into
    return run


def _cluster_launcher(handle: int, grid: tuple, block: int, smem: int, address: int, width: int) -> Any:
    """A launch of `handle` in clusters of `width` blocks along x (cuLaunchKernelEx's cluster dimension attribute:
    emit_fa3_ws.cluster_merge's kernels, whose merge waits for the q tile's parts: their pushes or a cluster
    barrier). No plain fallback: such a kernel launched without clusters would merge parts not yet written."""
    fn = _ctypes_launch_ex()
    if fn is None:
        raise RuntimeError("this kernel merges split-kv's parts in a cluster and needs cuLaunchKernelEx, which "
                           "libcuda does not have here: set extra cluster_merge=False")
    attr = _cluster_attribute(width)
    config = _launch_config(grid, block, smem, attr)
    ref = ctypes.byref(config)  # (made once: a call's byref costs host time)

    def run(stream: int) -> None:
        config.stream = stream
        err = fn(ref, handle, address, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx refused the launch in clusters of {width} (CUresult {err}; grid "
                               f"{tuple(grid)}): set extra cluster_merge=False")

    run.keep = (attr, config)  # type: ignore[attr-defined]  # the structures the pointers above point into
    return run


def _ctypes_max_active_clusters() -> Any:
    """libcuda's cuOccupancyMaxActiveClusters through ctypes, or None."""
    argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig)]
    return cubin_cache.libcuda_function("cuOccupancyMaxActiveClusters", argtypes)


def max_active_clusters(func: int, block: int, smem: int, width: int) -> Optional[int]:
    """How many clusters of `width` blocks of `func` (`block` threads, `smem` bytes of dynamic shared memory each)
    the device runs at once (cuOccupancyMaxActiveClusters: a cluster's blocks share a GPC, so this is the GPCs' SMs
    in whole clusters, not the SMs over `width`); 0 where the query fails, None where the driver has no such entry
    point."""
    fn = _ctypes_max_active_clusters()
    if fn is None:
        return None
    attr = _cluster_attribute(width)
    config = _launch_config((width, 1, 1), block, smem, attr)
    n = ctypes.c_int()
    return n.value if fn(ctypes.byref(n), func, ctypes.byref(config)) == 0 else 0


_CLUSTERS_HELD: dict[tuple[int, int], Optional[int]] = {}  # (device, width) -> device_clusters_held's answer


def device_clusters_held(width: int) -> Optional[int]:
    """How many clusters of `width` blocks the current device runs at once where each block takes an SM alone (the
    persistent kernels' one block an SM: decoding's split-kv parts), asked once a device and width of a kernel that
    does nothing (cubin_cache.Driver.probe: its shared memory the device's opt-in most), before any real kernel
    exists, so that the part count can take it (compiler._fewer_parts_held; the H200 holds 66 of 2, 30 of 4, 15 of
    8). Decoding's own kernels read the same counts (tests/gpu/test_split_kv_gpu.py): at D = 128 their shared
    memory gives each an SM; at D = 64 (83 KB) their registers do (launch bounds of one block an SM). The first
    call loads the probe on the device (its primary context retained, as a kernel's first launch would). None where
    there is no GPU (the simulator, CI) or the driver cannot say."""
    probe = _ask_device("probe")
    if probe is None:
        return None
    drv = cubin_cache.driver()
    dev = drv.current_device()
    if (dev, width) not in _CLUSTERS_HELD:
        try:
            with drv.current(dev):
                _CLUSTERS_HELD[dev, width] = max_active_clusters(probe[0], 128, probe[1], width) or None
        except cubin_cache.DriverError:
            _CLUSTERS_HELD[dev, width] = None
    return _CLUSTERS_HELD[dev, width]


def _arrivals_len(spec: FA2ForwardSpec, B: int, H: int, M: int) -> int:
    """The fused merge's counts (emit_fa3_ws.fused_merge): one a consumer warpgroup's 64 rows of every q tile (one,
    unused, where the merge runs in a cluster: cluster_merge)."""
    if cluster_parts(spec):
        return 1
    return B * H * -(-M // spec.block_q) * (spec.block_q // 64)


def _split_shapes(spec: FA2ForwardSpec, B: int, H: int, M: int, D: int) -> Optional[tuple]:
    """split-kv's workspace shapes (FA2ForwardKernel.split_workspaces): the parts' O [P B, H, M, D] and LSE
    [P B, H, M], and the fused merge's counts where it has them; None without parts."""
    P = spec.kv_parts
    if P == 1:
        return None
    return ((P * B, H, M, D), (P * B, H, M)) + (((_arrivals_len(spec, B, H, M),),) if uses_fused_merge(spec) else ())


def merge_programmatic(merge_blocks: int, idle_sms: int) -> bool:
    """Whether split-kv's merge is launched programmatically (_programmatic_launcher): where its blocks fit the SMs
    the kernel's grid leaves idle. Measured (H200 2026-11-30, CUDA graphs, benchmarks/NOTES.md "Decoding's tiles"):
    decoding M = 1 (one merge block, 4 idle SMs) 0.8-1.1 us faster of 12-16; M = 64 (64 blocks) 2.0-2.5 us slower,
    as the early blocks pile onto the few SMs free when the kernel's producers run out of items."""
    return 0 < merge_blocks <= idle_sms


def _launcher(func: Any, grid: tuple, block: int, smem: int, buf: ArgBuffer, programmatic: bool = False,
              cluster: int = 0):
    """A function of the stream that enqueues `func` with `buf`'s parameters (grid and block fixed);
    `programmatic`: may start while the kernel before it runs (_programmatic_launcher; the ctypes path only);
    `cluster` > 1: in clusters of that many blocks along x (_cluster_launcher)."""
    gx, gy, gz = (tuple(int(g) for g in grid) + (1, 1))[:3]
    address = buf.address
    if cluster > 1:
        return _cluster_launcher(int(func), (gx, gy, gz), block, smem, address, cluster)
    fast = _ctypes_launch()
    if fast is not None and os.environ.get("FALOWER_LAUNCH") != "bindings":
        handle = int(func)
        if programmatic:
            plain = _launcher(func, grid, block, smem, buf)
            return _programmatic_launcher(handle, (gx, gy, gz), block, smem, address, plain)

        def run_ctypes(stream: int) -> None:
            err = fast(handle, gx, gy, gz, block, 1, 1, smem, stream, address, None)
            if err:
                raise RuntimeError(f"cuLaunchKernel failed: CUresult {err}")

        return run_ctypes
    cu = _cu()
    launch = cu.cuLaunchKernel
    ok = cu.CUresult.CUDA_SUCCESS
    if isinstance(func, int):  # a handle from cubin_cache.Driver
        func = cu.CUfunction(func)

    def run(stream: int) -> None:
        err = launch(func, gx, gy, gz, block, 1, 1, smem, stream, address, 0)[0]
        if err != ok:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")

    return run


def _raw_stream_getter() -> Any:
    """torch's current raw stream of a device index (torch._C's, else the public API's)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda d: torch.cuda.current_stream(d).cuda_stream


_TORCH_ELEM = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "i32": "int32",
               "i8": "int8", "bool": "bool"}


def _torch_capture_dtype(dtype: str) -> Any:
    import torch

    return getattr(torch, _TORCH_ELEM[dtype])


def _tensor_strides(x: Any) -> tuple[int, int, int, int]:
    """(batch, head, row) element strides of a [B, H, N, D] tensor and the span of elements it covers."""
    st = x.stride()
    span = 1 + sum((int(n) - 1) * int(t) for n, t in zip(x.shape, st))
    return int(st[0]), int(st[1]), int(st[2]), span


def _fast_ok(x: Any, aligned: bool, tma: bool = False) -> bool:
    """A q/k/v/do view the kernels read in place (what _strided_view would not copy)."""
    if x.dim() != 4 or (x.shape[3] > 1 and x.stride(3) != 1) or min(x.stride()) < 0:
        return False
    return not (aligned and any(st % 8 for st in x.stride()[:3])) and not (tma and _broadcast(x.stride(), x.shape))


def _broadcast(strides: Any, shape: Any) -> bool:
    """Whether a Q / K / V view (torch's strides or numpy's) has a stride a TMA map cannot take
    (emit_fa3_ws.tma_loads): 0 on a dimension of more than one index (a broadcast view), which cp.async reads in
    place but a map's strides must be positive multiples of 16 bytes (tensor_maps.qkv_map_geometry gives a
    dimension of one index a dense stride)."""
    return any(st == 0 and n > 1 for st, n in zip(tuple(strides)[:3], tuple(shape)[:3]))


def _qkv_geometries(spec: FA2ForwardSpec, q: Any, k: Any, v: Any, strides: list) -> list:
    """(input index, map geometry, name) of Q's, K's and V's tensor maps (emit_fa3_ws.tma_loads), over the element
    strides the kernel takes (`strides`: q's three, then k's, then v's): boxes of a consumer warpgroup's 64 rows of Q,
    of a kv tile's rows of K and V."""
    B, D = int(q.shape[0]), spec.head_dim
    return [(i, qkv_map_geometry(B, int(x.shape[1]), int(x.shape[2]), D, tuple(strides[3 * i:3 * i + 3]),
                                 64 if i == 0 else spec.block_k), name)
            for i, (x, name) in enumerate(((q, "Q"), (k, "K"), (v, "V")))]


def _cap_shape(x: Any) -> Optional[tuple[int, ...]]:
    """The array shape a capture takes (a 0-d tensor is a 1-element array), None for a Python number."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    return tuple(int(n) for n in shape) or (1,)


class _ForwardPlan:
    """The forward's launches for one signature of torch inputs (shapes, strides, dtypes, device): grid,
    argument buffers with every size and stride filled in; a call allocates o and lse (and the block table),
    patches the data pointers that moved since the last call and enqueues the kernels on torch's current stream."""

    def __init__(self, kern: "FA2ForwardKernel", q: Any, k: Any, v: Any, caps: tuple) -> None:
        import torch

        s = kern.spec
        B, H, M, D = (int(n) for n in q.shape)
        N = int(k.shape[2])
        nq, nk = -(-M // s.block_q), -(-N // s.block_k)
        mma = s.path == "mma"
        self.aligned = mma
        self.device = q.device
        self.dev_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        self.o_shape = (B, H, M, D)
        self.lse_shape = (B, H, M)
        self.lse_dtype = _acc_torch(s.dtype)
        main = kern._direct_kernel("main")
        buf = ArgBuffer(main.layout)
        self.slots = []  # data-pointer slots of q, k, v
        strides = []
        for i, x in enumerate((q, k, v)):
            sb, sh, sm, span = _tensor_strides(x)
            self.slots.append(buf.array(i, (span,)))
            strides += [sb, sh, sm]
        P = s.kv_parts  # split-kv: the kernel writes P parts into workspaces, a merge launch reads them
        n_o = P * B * H * M * D
        self.o_slot = buf.array(3, (n_o // 2 if mma else n_o,))
        self.lse_slot = buf.array(4, (P * B * H * M,))
        self.fused = uses_fused_merge(s)  # split-kv's merge in the kernel: no merge launch (emit_fa3_ws.fused_merge)
        self.ws_shapes = _split_shapes(s, B, H, M, D)
        for j, n in enumerate([B, H, M, N] + strides):
            buf.scalar(5 + j, n)
        nxt = 18
        self.table_n = B * H * nq * nk if kern.mask_source is not None else 0
        self.table_slots: list[tuple[ArgBuffer, int]] = []
        if self.table_n:
            self.table_slots.append((buf, buf.array(nxt, (self.table_n,))))
            nxt += 1
        self.kern = kern
        self.work_slot, self.work_stream = None, None
        if uses_work_counter(s):
            self.work_slot = buf.array(nxt, (2,))
            nxt += 1
        self.omap_slot = None
        if uses_o_map(s):  # O's tensor map: O is new each call, its map kept by O's address (tensor_maps.TensorMaps)
            self.omap_slot = buf.array(nxt, (MAP_BYTES,))
            nxt += 1
        self.kv_maps = []  # (slot, input index, geometry, name) of Q's, K's and V's maps (tma_loads)
        if uses_kv_maps(s):
            for i, geometry, name in _qkv_geometries(s, q, k, v, strides):
                self.kv_maps.append((buf.array(nxt, (MAP_BYTES,)), i, geometry, name))
                nxt += 1
        self.fused_slots: list[int] = []  # o_fin, lse_fin, arrivals (fused_merge)
        if self.fused:
            n_fin = B * H * M * D
            self.fused_slots = [buf.array(nxt, (n_fin // 2 if mma else n_fin,)), buf.array(nxt + 1, (B * H * M,)),
                                buf.array(nxt + 2, (self.ws_shapes[2][0],))]
            nxt += 3
        # whether a call asks torch if its stream captures a graph (a counter, a map, workspaces or a block table of
        # its own then)
        self.ask_capture = self.work_slot is not None or self.omap_slot is not None or bool(self.kv_maps) \
            or self.ws_shapes is not None or bool(self.table_n)
        self.bufs = [buf]
        self.cap_slots: list[list[tuple[ArgBuffer, int, int]]] = [[] for _ in caps]  # per capture
        self.cap_scalars: list[list[tuple[ArgBuffer, int, int]]] = [[] for _ in caps]
        mask_buf = None
        if self.table_n:
            mk = kern._direct_kernel("mask")
            mask_buf = ArgBuffer(mk.layout)
            self.table_slots.append((mask_buf, mask_buf.array(0, (self.table_n,))))
            for j, n in enumerate([B, H, M, N]):
                mask_buf.scalar(1 + j, n)
        for c, x in enumerate(caps):
            for b, first in ((buf, nxt), (mask_buf, 5)):
                if b is None:
                    continue
                i = first + c
                if b.layout.ndim[i] >= 0:
                    self.cap_slots[c].append((b, b.array(i, _cap_shape(x)), 0))
                else:
                    self.cap_scalars[c].append((b, i, 0))
        dev = self.dev_index
        self.launches = []
        self.tables, self.sizes = kern.block_tables, (B, H, M, N)
        if self.table_n:  # the dense block table: launched only for data not seen before (block_data.BlockTables)
            self.mask_launch = _launcher(kern._direct_kernel("mask").function(dev), (nk, nq, B * H), 128, 0,
                                         mask_buf)  # type: ignore[arg-type]
        main_grid = grid(s, B, H, M, N)
        self.launches.append(_launcher(main.function(dev), main_grid, kern.threads, kern.smem, buf,
                                       cluster=cluster_parts(s)))
        self.merge_slots: list[int] = []
        if P > 1 and not self.fused:  # the LSE merge of the parts into O and LSE (lse_merge.split_merge_kernel)
            from .lse_merge import merge_grid

            mk = kern._direct_kernel("merge")
            mbuf = ArgBuffer(mk.layout)
            rows = B * H * M
            self.merge_slots = [mbuf.array(i, (n,)) for i, n in enumerate((P * rows * D, P * rows, rows * D, rows))]
            mbuf.scalar(4, rows)
            mbuf.scalar(5, D)
            self.merge_buf = mbuf
            blocks, threads = merge_grid(rows, D, kern.merge_vec)
            idle = (device_sm_count() or 0) - int(np.prod(main_grid))  # SMs the kernel's persistent grid leaves
            self.launches.append(_launcher(mk.function(dev), (blocks,), threads, 0, mbuf,
                                           programmatic=merge_programmatic(blocks, idle)))
        self.stream = _raw_stream_getter()
        # What the last call not capturing a graph put in the argument slots that need a lookup (launch_into): per
        # tensor map (Q's, K's, V's, then O's) the (address, stream, kern.maps.dropped) it was made for: the map is
        # still in the kernel's cache, and so alive, while no map has been dropped since; and (stream, workspaces) of
        # split-kv's workspaces, which the kernel keeps. A call whose keys are the same skips the lookups and the
        # slots' writes (a decoding loop's K / V cache: 3.3 us of host time, H200). This holds because launch_into
        # is the only writer of the plan's argument buffers.
        self.map_memo: list[Optional[tuple]] = [None] * (len(self.kv_maps) + 1)
        self.ws_memo: Optional[tuple] = None
        self._output_slots()

    def _output_slots(self) -> None:
        """Where a call's O and LSE go (`out_slots`: (buffer values, slot) each) and, under split-kv, where each
        workspace goes (`ws_slots`: (buffer values, slot, index into split_workspaces' tuple)): the kernel writes
        O and LSE itself, or its parts into the workspaces, which the merge kernel reads (or the kernel's own merge,
        counting in the third) to write the call's O and LSE."""
        vals = self.bufs[0].vals
        kernel_out = [(vals, self.o_slot, 0), (vals, self.lse_slot, 1)]
        if self.ws_shapes is None:
            self.out_slots, self.ws_slots = [(b, s) for b, s, _ in kernel_out], []
        elif self.fused:
            self.out_slots = [(vals, s) for s in self.fused_slots[:2]]
            self.ws_slots = kernel_out + [(vals, s, 2 + j) for j, s in enumerate(self.fused_slots[2:])]
        else:
            mv = self.merge_buf.vals
            self.out_slots = [(mv, s) for s in self.merge_slots[2:]]
            self.ws_slots = kernel_out + [(mv, s, j) for j, s in enumerate(self.merge_slots[:2])]

    def __call__(self, q: Any, k: Any, v: Any, caps: tuple) -> Optional[tuple]:
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if self.aligned and (ptrs[0] | ptrs[1] | ptrs[2]) & 15:
            return None  # rows not 16-byte aligned: the Numba path copies them
        o = q.new_empty(self.o_shape)  # (q's dtype and device: 1.3 us less host time than torch.empty's two, H200)
        lse = q.new_empty(self.lse_shape, dtype=self.lse_dtype)
        self.launch_into(ptrs, caps, o, lse)
        return o, lse

    def launch_into(self, ptrs: tuple[int, int, int], caps: tuple, o: Any, lse: Any) -> None:
        """Enqueue the kernels on q, k and v at `ptrs` (their data pointers, 16-byte aligned where the plan is
        aligned) with O and LSE written into `o` and `lse` (allocated by the caller as __call__ does). A slot that
        needs a lookup (a tensor map, split-kv's workspaces) is written only when its key moved since the last call
        (map_memo, ws_memo)."""
        import torch

        vals = self.bufs[0].vals
        for slot, p in zip(self.slots, ptrs):
            vals[slot] = p
        stream = self.stream(self.dev_index)
        capturing = self.ask_capture and torch.cuda.is_current_stream_capturing()
        (ob, os_), (lb, ls) = self.out_slots  # the call's O and LSE (_output_slots)
        ob[os_] = o.data_ptr()
        lb[ls] = lse.data_ptr()
        o_k = o  # the O the kernel writes
        if self.ws_shapes is not None:  # split-kv: the parts into workspaces, merged into o and lse
            memo = self.ws_memo
            if capturing or memo is None or memo[0] != stream:
                ws = self.kern.split_workspaces(self.device, stream, self.ws_shapes, o.dtype, lse.dtype, capturing)
                self.ws_memo = None if capturing else (stream, ws)
                for b, slot, j in self.ws_slots:
                    b[slot] = ws[j].data_ptr()
            else:  # the slots hold this stream's workspaces from the last call
                ws = memo[1]
            o_k = ws[0]
        for c, x in enumerate(caps):
            for b, slot, _ in self.cap_slots[c]:
                b.vals[slot] = x.data_ptr()
            for b, i, _ in self.cap_scalars[c]:
                b.scalar(i, x)
        memo, maps = self.map_memo, self.kern.maps
        if self.omap_slot is not None:  # O's tensor map (the one made for this O's address before, if any)
            key = (o_k.data_ptr(), stream, maps.dropped)
            if capturing or memo[-1] != key:
                vals[self.omap_slot] = maps.torch_o(o_k, capturing, stream).data_ptr()
                memo[-1] = None if capturing else key
        for n, (slot, i, geometry, name) in enumerate(self.kv_maps):
            key = (ptrs[i], stream, maps.dropped)
            if capturing or memo[n] != key:
                vals[slot] = maps.torch(ptrs[i], self.device, geometry, capturing, stream, name).data_ptr()
                memo[n] = None if capturing else key
        if self.work_slot is not None:  # the counter of this stream (a captured launch: its own, work_counter)
            if capturing or self.work_stream != stream:
                vals[self.work_slot] = self.kern.work_counter("torch", self.device, stream).data_ptr()
                self.work_stream = None if capturing else stream
        if self.table_n:  # (while capturing, the graph's own table: BlockTables.entry)
            entry = self.tables.entry(caps, self.sizes, lambda: torch.empty(self.table_n, dtype=torch.int8,
                                                                            device=self.device), capturing)
            for b, slot in self.table_slots:
                b.vals[slot] = entry.table.data_ptr()
            self.tables.fill(entry, lambda: self.mask_launch(stream))
        for run in self.launches:
            run(stream)


class _BackwardPlan:
    """The backward's launches for one signature of torch inputs, as _ForwardPlan: Delta (zeroing dQ's
    accumulator), the block table, the main kernel, the per-block gradient sums and dQ's conversion (or the
    q-outer dQ kernel), each from its own argument buffer, all on torch's current stream."""

    def __init__(self, kern: "FA2BackwardKernel", q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any,
                 caps: tuple) -> None:
        import torch

        s = kern.spec
        B, H, M, D = (int(n) for n in q.shape)
        Hk, N = int(k.shape[1]), int(k.shape[2])
        nq, nk = -(-M // s.block_q), -(-N // s.block_k)
        mma = s.path == "mma"
        self.aligned = mma
        self.device = q.device
        self.dev_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        self.kern = kern
        self.acc = _acc_torch(s.dtype)
        self.rows = rows = B * H * M
        self.separate = s.dq == "separate"
        self.q_shape, self.kv_shape = (B, H, M, D), (B, Hk, N, D)
        per = 2 if mma else 1
        strides, spans = [], []
        for x in (q, k, v, do):
            sb, sh, sm, span = _tensor_strides(x)
            strides += [sb, sh, sm]
            spans.append(span)
        sizes = [B, H, M, N]
        self.nblk = bwd_grid(s, B, H, M, N)[0] if s.deterministic else 1
        self.grad_caps = [g.capture for g in s.grads]
        self.grad_n = [int(np.prod(_cap_shape(caps[i]) or (1,))) for i in self.grad_caps]
        self.table_n = B * H * nq * nk if kern.mask_source is not None else 0
        dev = self.dev_index
        # every pointer a call patches: (name, buffer, slot); name indexes what __call__ gathers
        self.patch: list[tuple[str, ArgBuffer, int]] = []
        self.cap_slots: list[tuple[int, ArgBuffer, int]] = []  # (capture index, buffer, slot) of array captures
        self.cap_scalars: list[tuple[int, ArgBuffer, int]] = []
        self.launches: list = []

        def buffer(which: str) -> tuple[DirectKernel, ArgBuffer]:
            dk = kern._direct_kernel(which)
            return dk, ArgBuffer(dk.layout)

        def arrays(buf: ArgBuffer, first: int, items: list) -> int:
            for i, (name, n) in enumerate(items):
                self.patch.append((name, buf, buf.array(first + i, (n,))))
            return first + len(items)

        def scalars(buf: ArgBuffer, first: int, values: list) -> int:
            for i, x in enumerate(values):
                buf.scalar(first + i, x)
            return first + len(values)

        def captures(buf: ArgBuffer, first: int) -> None:
            for c, x in enumerate(caps):
                i = first + c
                if buf.layout.ndim[i] >= 0:
                    self.cap_slots.append((c, buf, buf.array(i, _cap_shape(x))))
                else:
                    self.cap_scalars.append((c, buf, i))

        qkvdo = [("q", spans[0]), ("k", spans[1]), ("v", spans[2])]
        n_dq, n_kv = rows * D, B * Hk * N * D
        self.n_acc = n_acc = _dq_acc_len(s, B, H, M, D)  # dQ's accumulator (n_dq but under dq_ws)
        # Delta = rowsum(dO * O), and dQ's f32 accumulator zeroed
        dk_, buf = buffer("delta")
        nxt = arrays(buf, 0, [("do", spans[3]), ("o", rows * D), ("delta", rows),
                              ("dq32", rows if self.separate else n_acc)])
        scalars(buf, nxt, [H, M, *strides[9:12]])
        self.launches.append(_launcher(dk_.function(dev), delta_grid(B, H, M, delta_rows(s)), 128, 0, buf))
        self.tables, self.sizes = kern.block_tables, tuple(sizes)
        if self.table_n:  # the dense block table: launched only for data not seen before (block_data.BlockTables)
            dk_, buf = buffer("mask")
            nxt = arrays(buf, 0, [("table", self.table_n)])
            captures(buf, scalars(buf, nxt, sizes))
            self.mask_launch = _launcher(dk_.function(dev), (nk, nq, B * H), 128, 0, buf)
        dk_, buf = buffer("main")
        nxt = arrays(buf, 0, qkvdo + [("lse", rows), ("do", spans[3]), ("delta", rows),
                                      ("dq32", rows if self.separate else n_acc), ("dk", n_kv // per),
                                      ("dv", n_kv // per)])
        nxt = scalars(buf, nxt, sizes + strides)
        if self.table_n:
            nxt = arrays(buf, nxt, [("table", self.table_n)])
        nxt = arrays(buf, nxt, [(f"grad{j}", self.nblk * n) for j, n in enumerate(self.grad_n)])
        self.map_slots: list[tuple[str, int]] = []  # dK's and dV's tensor maps (emit_fa3_bwd.dkdv_tma)
        self.kv_geometry = o_map_geometry(B * Hk, N, D)
        self.main_buf = buf
        if _dkdv_maps(s):
            for name in ("dk", "dv"):
                self.map_slots.append((name, buf.array(nxt, (MAP_BYTES,))))
                nxt += 1
        captures(buf, nxt)
        self.launches.append(_launcher(dk_.function(dev), bwd_grid(s, B, H, M, N), kern.threads, kern.smem, buf))
        if kern.parts_source is not None:
            for j, n in enumerate(self.grad_n):
                dk_, buf = buffer("parts")
                scalars(buf, arrays(buf, 0, [(f"grad{j}", self.nblk * n), (f"sum{j}", n)]), [self.nblk, n])
                self.launches.append(_launcher(dk_.function(dev), (-(-n // 128),), 128, 0, buf))
        if self.separate:
            dk_, buf = buffer("dq")
            nxt = arrays(buf, 0, qkvdo + [("lse", rows), ("do", spans[3]), ("delta", rows), ("dq", n_dq // per)])
            nxt = scalars(buf, nxt, sizes + strides)
            if self.table_n:
                nxt = arrays(buf, nxt, [("table", self.table_n)])
            captures(buf, nxt)
            self.launches.append(_launcher(dk_.function(dev), dq_grid(s, B, H, M), dq_threads(s), kern.dq_smem, buf))
        else:
            dk_, buf = buffer("dq")
            scalars(buf, arrays(buf, 0, [("dq32", n_acc), ("dq", n_dq // per)]), [n_dq, M])
            self.launches.append(_launcher(dk_.function(dev), *dq_convert_launch(s, B, H, M, n_dq), 0, buf))
        self.final = "sum" if kern.parts_source is not None else "grad"
        self.stream = _raw_stream_getter()

    def __call__(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, caps: tuple,
                 dlse: Any = None) -> Optional[tuple]:
        import torch

        check_dlse(dlse, lse)
        ptr = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "do": do.data_ptr()}
        if self.aligned and (ptr["q"] | ptr["k"] | ptr["v"] | ptr["do"]) & 15:
            return None  # rows not 16-byte aligned: the Numba path copies them
        dev, acc = self.device, self.acc
        ptr["o"], ptr["lse"] = o.data_ptr(), lse.data_ptr()
        if self.separate:
            scratch = torch.empty(self.rows, dtype=acc, device=dev)
            ptr["delta"] = ptr["dq32"] = scratch.data_ptr()  # dq32 is not read: dQ comes from its own kernel
            delta = scratch
        else:  # dQ's accumulator (16-byte aligned, for the vector reductions), then Delta, in one allocation
            n_dq = self.n_acc
            scratch = torch.empty(n_dq + self.rows, dtype=acc, device=dev)
            ptr["dq32"] = scratch.data_ptr()
            ptr["delta"] = ptr["dq32"] + n_dq * scratch.element_size()
            delta = scratch[n_dq:]
        dq = torch.empty(self.q_shape, dtype=q.dtype, device=dev)
        dk = torch.empty(self.kv_shape, dtype=k.dtype, device=dev)
        dv = torch.empty(self.kv_shape, dtype=v.dtype, device=dev)
        ptr["dq"], ptr["dk"], ptr["dv"] = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
        grads = [torch.zeros(self.nblk * n, dtype=acc, device=dev) for n in self.grad_n]
        sums = [torch.empty(n, dtype=acc, device=dev) for n in self.grad_n] if self.final == "sum" else []
        for j, g in enumerate(grads):
            ptr[f"grad{j}"] = g.data_ptr()
        for j, g in enumerate(sums):
            ptr[f"sum{j}"] = g.data_ptr()
        capturing = torch.cuda.is_current_stream_capturing()
        if self.table_n:  # (while capturing, the graph's own table: BlockTables.entry)
            entry = self.tables.entry(caps, self.sizes, lambda: torch.empty(self.table_n, dtype=torch.int8, device=dev),
                                      capturing)
            ptr["table"] = entry.table.data_ptr()
        for name, buf, slot in self.patch:
            buf.vals[slot] = ptr[name]
        for c, buf, slot in self.cap_slots:
            buf.vals[slot] = caps[c].data_ptr()
        for c, buf, i in self.cap_scalars:
            buf.scalar(i, caps[c])
        stream = self.stream(self.dev_index)
        if self.map_slots:  # dK's and dV's maps (the ones made for these addresses before, if any)
            for name, slot in self.map_slots:
                self.main_buf.vals[slot] = self.kern.maps.torch(ptr[name], dev, self.kv_geometry, capturing, stream,
                                                                {"dk": "dK", "dv": "dV"}[name]).data_ptr()
        if self.table_n:
            self.tables.fill(entry, lambda: self.mask_launch(stream))
        for i, run in enumerate(self.launches):
            run(stream)
            if i == 0 and dlse is not None:  # Delta's kernel ran: Delta - dLSE (passes/lse_cotangent.py), on
                delta.sub_(dlse.detach().reshape(-1).to(acc))  # torch's current stream, the launches' own
        outs = [dq, dk, dv]
        for g, c in zip(sums or grads, self.grad_caps):
            x = caps[c]
            outs.append(g.reshape(x.shape).to(x.dtype))
        return tuple(outs)


def _host_rows(x: Any) -> np.ndarray:
    """A numpy copy of a numpy, CUDA-array or torch value (the LSE's cotangent on the host path)."""
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    from numba import cuda

    return cuda.as_cuda_array(x).copy_to_host() if hasattr(x, "__cuda_array_interface__") else np.asarray(x)


def check_sizes(sizes: dict[str, int], specs: Sequence[Any], captures: Sequence[Any]) -> None:
    """Refuse a size past value_ranges.SIZE_MAX (2^24): the kernels' integer code wraps to i32 only where a value
    can leave it for sizes up to that (from_ir._ScalarEmitter.expr), so larger inputs could differ from the IR."""
    from ...ir.value_ranges import SIZE_MAX

    named = list(sizes.items()) + [(f"capture {c.name}'s axis {d}", int(n)) for c, x in zip(specs, captures)
                                   if not np.isscalar(x) for d, n in enumerate(getattr(x, "shape", ()))]
    for name, n in named:
        if n > SIZE_MAX:
            raise ValueError(f"{name} is {n}: the kernels take sizes up to 2^24 = {SIZE_MAX}")


class FA2ForwardKernel:
    """One compiled FA2 forward kernel for `spec`.

    Attributes: `spec`, `source` (the generated module), `mask_source` (block-mask kernel, table mode).
    """

    def __init__(self, spec: FA2ForwardSpec) -> None:
        self.spec = spec
        self.threads = threads_per_block(spec)
        self.smem = smem_bytes(spec)
        self._smem_set: set[tuple] = set()
        self._direct: dict[str, DirectKernel] = {}
        self._plans: dict[tuple, Optional[_ForwardPlan]] = {}
        self._work: dict[tuple, Any] = {}  # work_counter's arrays
        self._captured: list[Any] = []  # what launches captured into CUDA graphs keep of their own (counters,
        # workspaces; block tables: BlockTables.entry), alive with them
        self._split_ws: dict[tuple, tuple[Any, Any]] = {}  # split-kv's workspaces (split_workspaces)
        self._cluster_fit: dict[int, Optional[int]] = {}  # device -> its clusters at once (max_active_clusters)
        self.cluster_asked = False  # the caller's cluster_merge True (set by the compiler): launched whatever fits
        self.maps = TensorMaps(spec.dtype)  # O's, K's and V's tensor maps (emit_fa2.uses_o_map, uses_kv_maps)
        self.block_tables = BlockTables()  # the dense block table (table mode), made once per distinct data
        with compile_progress(_label(spec, "forward")):
            self.source = emit_cached(emit_fa2_forward, spec, "forward")
            self.mask_source = emit_cached(emit_block_mask, spec, "block_mask") if spec.block_mask == "table" else None
            if _has_gpu():  # compile now (or find the cubin), for the one signature the direct launches use
                self._direct_kernel("main")
                if self.mask_source is not None:
                    self._direct_kernel("mask")
                if spec.kv_parts > 1 and not uses_fused_merge(spec):  # (a merge in the kernel launches none)
                    self._direct_kernel("merge")

    # Numba's dispatchers, made on first use: importing the emitted module imports numba.cuda, which a warm
    # process whose kernels come from the cubin cache never needs.
    @functools.cached_property
    def _kernel(self) -> Any:
        return getattr(load_source(self.source, self.spec.name), self.spec.name)

    @functools.cached_property
    def _mask_kernel(self) -> Any:
        if self.mask_source is None:
            return None
        return getattr(load_source(self.mask_source, self.spec.name + "_block_mask"), self.spec.name + "_block_mask")

    def _direct_kernel(self, which: str) -> DirectKernel:
        kern = self._direct.get(which)
        if kern is None:
            if which == "main":
                kern = DirectKernel(lambda: self._kernel, self.argtypes, self.smem,
                                    _ident("forward", self.spec, self.source))
            elif which == "merge":  # split-kv's LSE merge (lse_merge.split_merge_kernel)
                from .lse_merge import split_merge_kernel

                P, dt, vec = self.spec.kv_parts, self.spec.dtype, self.merge_vec
                kern = DirectKernel(lambda: split_merge_kernel(P, dt, vec), self.merge_argtypes, 0,
                                    _ident("lse_merge", self.spec, f"split_merge_kernel({P}, {dt!r}, {vec})"))
            else:
                kern = DirectKernel(lambda: self._mask_kernel, self.mask_argtypes, 0,
                                    _ident("block_mask", self.spec, self.mask_source))
            self._direct[which] = kern
        return kern

    @property
    def merge_vec(self) -> int:
        """Elements a thread of split-kv's merge takes (lse_merge.merge_vec over the 16-bit parts): the workspaces
        and O it reads and writes are fresh allocations, 16-byte aligned."""
        from .lse_merge import merge_vec

        return merge_vec(self.spec.head_dim, 2)

    def merge_argtypes(self) -> tuple:
        """Numba argument types of split-kv's merge: the parts' O words, their LSEs, O's words, LSE, rows, D."""
        from numba import types

        i16, f32 = types.Array(types.int16, 1, "C"), types.Array(types.float32, 1, "C")
        return (i16, f32, i16, f32, types.int64, types.int64)

    def mask_argtypes(self) -> tuple:
        """Numba argument types of the block-mask kernel (table mode): table, B, H, M, N, *captures."""
        from numba import types

        return (types.Array(types.int8, 1, "C"),) + (types.int64,) * 4 + tuple(_capture_types(self.spec))

    # ---------------------------------------------------------------------------- user helpers
    def print_kernel(self) -> None:
        print(self.source)
        if self.mask_source:
            print(self.mask_source)

    def argtypes(self) -> tuple:
        """Numba argument types of the forward kernel (flat contiguous arrays, int64 sizes)."""
        from numba import types

        s = self.spec
        elem = {"f32": types.float32, "f64": types.float64}.get(s.dtype, types.int16)
        acc = types.float64 if s.dtype == "f64" else types.float32
        arr = lambda t: types.Array(t, 1, "C")  # noqa: E731
        o = arr(types.int32) if s.path == "mma" else arr(elem)
        args = [arr(elem), arr(elem), arr(elem), o, arr(acc)] + [types.int64] * (4 + 9)
        if s.block_mask == "table":
            args.append(arr(types.int8))
        if uses_work_counter(s):
            args.append(arr(types.int32))
        if uses_o_map(s):
            args.append(arr(types.uint8))
        if uses_kv_maps(s):
            args += [arr(types.uint8)] * 3  # qmap, kmap, vmap
        if uses_fused_merge(s):
            args += [o, arr(acc), arr(types.int32)]  # o_fin, lse_fin, arrivals
        args += _capture_types(s)
        return tuple(args)

    def split_workspaces(self, device: Any, stream: int, shapes: tuple, dtype: Any, lse_dtype: Any,
                         capturing: bool = False) -> tuple:
        """split-kv's parts' O and LSE workspaces (torch, `shapes`) for launches on `stream`: one pair a (device,
        stream, shapes, dtype), made on first use and kept with the kernel. Calls on one stream run in its order, so
        a call's merge has read them before the next call's kernel writes them, whatever its input shapes (a
        decoding loop's growing N keeps one pair: the workspaces' size is P B H M D). A call allocating its own spent
        ~10 us of host time, longer than a small grid's kernel; the Numba path's temporaries could be freed while its
        default-stream launches still read them. A launch captured into a CUDA graph (`capturing`) gets a pair of its
        own, kept with the graph (two graphs may replay at once), as `work_counter` does; its counts are zeroed once,
        outside the graph (graph_capture.zeroed_int32)."""
        import torch

        key = (str(device), stream, shapes, dtype)
        ws = None if capturing else self._split_ws.get(key)
        if ws is None:  # (a third shape: the fused merge's counts, int32, zeroed: fused_merge keeps them mod P)
            zeros = (lambda shape: graph_capture.zeroed_int32(math.prod(shape), device)) if capturing else \
                (lambda shape: torch.zeros(shape, dtype=torch.int32, device=device))
            ws = (torch.empty(shapes[0], dtype=dtype, device=device),
                  torch.empty(shapes[1], dtype=lse_dtype, device=device)) + tuple(zeros(shape) for shape in shapes[2:])
            if capturing:
                self._captured.append(ws)
            else:
                self._split_ws[key] = ws
        return ws

    def work_counter(self, kind: str, device: Any = None, stream: int = 0) -> Any:
        """The `work` array of a kernel that takes its items from a counter (emit_fa2.uses_work_counter): int32
        [2], zeroed once when made; each launch leaves it zeroed (its last block resets it). One per (device,
        stream), so launches on two streams at once do not share tickets; launches on one stream run in order. A
        launch captured into a CUDA graph gets a counter of its own (two graphs captured on one stream may be
        replayed at once on two), zeroed once outside the graph (graph_capture.zeroed_int32: a zeroing in the graph
        ran on every replay)."""
        if kind == "torch":
            import torch

            if torch.cuda.is_current_stream_capturing():
                buf = graph_capture.zeroed_int32(2, device)
                self._captured.append(buf)
                return buf
        key = (kind, str(device), stream)
        buf = self._work.get(key)
        if buf is None:
            if kind == "torch":
                buf = torch.zeros(2, dtype=torch.int32, device=device)
            else:
                from numba import cuda

                buf = cuda.to_device(np.zeros(2, dtype=np.int32))
            self._work[key] = buf
        return buf

    def ptx(self, cc: tuple[int, int] = (9, 0)) -> str:
        """PTX of the forward kernel for compute capability `cc` (no GPU needed)."""
        return ptx_of(self._kernel, self.argtypes(), cc)

    # ---------------------------------------------------------------------------- checking
    def _check(self, q: Any, k: Any, v: Any, captures: tuple) -> str:
        s = self.spec
        kinds = {_kind(q), _kind(k), _kind(v)}
        if len(kinds) != 1:
            raise TypeError(f"q, k, v must be the same kind of array, got {sorted(kinds)}")
        kind = kinds.pop()
        for name, x in (("q", q), ("k", k), ("v", v)):
            dt = _dtype_name(x, kind)
            if dt != s.dtype:
                raise TypeError(f"{name} has dtype {dt}, this kernel was built for {s.dtype}")
            if len(x.shape) != 4:
                raise ValueError(f"{name} must be 4-D [B, heads, seq, D], got shape {tuple(x.shape)}")
            if kind == "torch" and x.shape[3] > 1 and x.stride(3) != 1:
                raise ValueError(f"the last dimension of {name} must be contiguous (stride 1), got strides "
                                 f"{tuple(x.stride())}")
            if kind == "numpy" and x.shape[3] > 1 and x.strides[3] != x.itemsize:
                raise ValueError(f"the last dimension of {name} must be contiguous, got strides {x.strides}")
            if kind == "cai" and not _is_contiguous(x, kind):
                raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")
        if kind == "torch":
            devs = {x.device for x in (q, k, v)}
            if len(devs) != 1 or not q.is_cuda:
                raise ValueError(f"q, k, v must be on one CUDA device, got {sorted(str(d) for d in devs)}")
        B, H, M, D = (int(n) for n in q.shape)
        Bk, Hk, N, Dk = (int(n) for n in k.shape)
        if tuple(int(n) for n in v.shape) != (Bk, Hk, N, Dk):
            raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
        if D != s.head_dim or Dk != s.head_dim:
            raise ValueError(f"head dim must be {s.head_dim}, got q {D}, k {Dk}")
        if Bk != B:
            raise ValueError(f"batch of q ({B}) and k/v ({Bk}) differ")
        if Hk * s.group_size != H:
            raise ValueError(f"q has {H} heads, k/v {Hk}: expected {H} = {Hk} * group_size {s.group_size}")
        if M < 1 or N < 1 or B < 1 or H < 1:
            raise ValueError(f"empty input: B={B} H={H} M={M} N={N}")
        if len(captures) != len(s.captures):
            raise ValueError(f"expected {len(s.captures)} captured tensors, got {len(captures)}")
        check_sizes({"B": B, "H": H, "M": M, "N": N}, s.captures, captures)
        for c, x in zip(s.captures, captures):
            if np.isscalar(x):
                continue
            ck = _kind(x)
            if ck != kind and not (kind != "numpy" and ck == "cai"):
                raise TypeError(f"capture {c.name} is a {ck} array, q/k/v are {kind}")
            if len(x.shape) == 0 and c.ndim == 1:
                continue  # a 0-d capture: the kernel reads it as a 1-element array
            if len(x.shape) != c.ndim:
                raise ValueError(f"capture {c.name} must be {c.ndim}-D, got shape {tuple(x.shape)}")
            if not _is_contiguous(x, ck):
                raise ValueError(f"capture {c.name} must be contiguous")
            if ck not in ("cai", "numpy"):  # (torch tensors of another dtype are converted)
                continue
            got = np.dtype(x.dtype if ck == "numpy" else x.__cuda_array_interface__["typestr"])
            if c.dtype == "bf16" and got.itemsize != 2:  # bf16 as 16-bit words: numpy cannot convert to it
                raise TypeError(f"capture {c.name} has dtype {got}, the graph declares bf16 (give its 16-bit "
                                "words, or a torch bfloat16 tensor)")
            if ck == "cai" and c.dtype != "bf16" and got != np.dtype(_np_capture_dtype(c.dtype)):
                # (numpy arrays are converted)
                raise TypeError(f"capture {c.name} has dtype {got}, the graph declares {c.dtype}")
        return kind

    # ---------------------------------------------------------------------------- launching
    def _raise_smem_limit(self, kernel, args, smem: int) -> None:
        from numba import cuda

        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            return
        sig_key = (cuda.current_context().device.id,) + tuple(
            (type(a), getattr(a, "dtype", None), getattr(a, "ndim", None)) for a in args)
        if sig_key in self._smem_set:
            return
        from numba.cuda.cudadrv.driver import binding, driver

        # One compiled overload per argument-type tuple (torch tensors and Numba device arrays may
        # type differently), each with its own function handle: set the limit on the one we launch.
        compiled = kernel._compile_for_args(*args)
        cufunc = compiled._codelibrary.get_cufunc()
        key = (id(compiled), cufunc.device.id)
        if key in self._smem_set:
            self._smem_set.add(sig_key)
            return
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, smem, cufunc.handle, cufunc.device.id)
        self._smem_set.add(key)
        self._smem_set.add(sig_key)  # the same argument kinds map to the same overload: skip next time

    def __call__(self, q: Any, k: Any, v: Any, *captures: Any):
        """Run the kernel; returns (o, lse) of the same kind as q (numpy in, numpy out)."""
        plan = self.plan(q, k, v, captures)
        if plan is not None:
            out = plan(q, k, v, captures)
            if out is not None:
                return out
        launch, finish = self.prepare(q, k, v, *captures, _wrap=False)
        launch()
        return finish()

    def relaunch(self, q: Any, k: Any, v: Any, *captures: Any):
        """(launch, finish) as prepare gives them, but `launch()` enqueues the kernel as a call does (the direct
        plan's cuLaunchKernel, about a microsecond of host time) into one O and LSE: the bare kernel a benchmark
        times. prepare's launch goes through Numba's dispatcher, whose host time (tens of microseconds) is longer
        than a small grid's kernel. Inputs the plan does not take fall back to prepare."""
        plan = self.plan(q, k, v, captures)
        out = None if plan is None else plan(q, k, v, captures)
        if out is None:
            return self.prepare(q, k, v, *captures)
        o, lse = out
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        return (lambda: plan.launch_into(ptrs, captures, o, lse)), (lambda: (o, lse))

    def plan(self, q: Any, k: Any, v: Any, captures: tuple) -> Optional[_ForwardPlan]:
        """The direct launches for these torch CUDA inputs' signature (made on first use), or None where
        they do not apply (numpy or other arrays, the simulator, views the Numba path must copy, capture
        dtypes other than the kernel's)."""
        if not (type(q).__module__.startswith("torch") and _direct_enabled()):
            return None
        key = (_sig(q), _sig(k), _sig(v)) + tuple(_sig(x) for x in captures)
        try:
            return self._plans[key]
        except KeyError:
            pass
        self._check(q, k, v, captures)
        if cluster_parts(self.spec):  # (a MIG slice, a device without clusters, or an automatic choice's grid of
            # more clusters than the GPCs hold at once: the merge kernel's form)
            need = 1 if self.cluster_asked else self.grid_clusters(*q.shape[:3], k.shape[2])
            if not self._clusters_fit(q, need):
                plan = self._plans[key] = self.without_cluster.plan(q, k, v, captures)
                return plan
        plan = None
        aligned = self.spec.path == "mma"
        tma = uses_kv_maps(self.spec)
        if all(_fast_ok(x, aligned, tma) for x in (q, k, v)) and _captures_fit(self.spec, captures):
            plan = _ForwardPlan(self, q, k, v, captures)
        self._plans[key] = plan
        return plan

    def block_table(self, q: Any, k: Any, v: Any, *captures: Any) -> np.ndarray:
        """The tile classes the block-mask kernel computes for these inputs, int8 [B, H, nq, nk] on the host:
        the same classes as the IR's `mask.block_table` (0 empty, 1 partial, 2 full; a ragged kv tile is
        never full). For tests, and for seeing which tiles a data-dependent mask visits."""
        if self._mask_kernel is None:
            raise ValueError(f"{self.spec.name}: no block table (its mask is not data-dependent)")
        launch, _ = self.prepare(q, k, v, *captures, _wrap=False)
        launch()
        table = launch.table  # type: ignore[attr-defined]
        host = table.copy_to_host() if hasattr(table, "copy_to_host") else table.cpu().numpy()
        B, H, M = (int(n) for n in q.shape[:3])
        return host.reshape(B, H, -(-M // self.spec.block_q), -(-int(k.shape[2]) // self.spec.block_k))

    def grid_clusters(self, B: int, H: int, M: int, N: int) -> int:
        """The clusters a call of these sizes launches (cluster_merge: one block an item, cluster_parts a cluster;
        the packed GQA kernel's sizes where it runs)."""
        return grid(self.spec, int(B), int(H), int(M), int(N))[0] // cluster_parts(self.spec)

    def device_clusters(self, dev: int) -> Optional[int]:
        """max_active_clusters of this kernel on device `dev`, asked once a device (None: the driver cannot say)."""
        if dev not in self._cluster_fit:
            func = self._direct_kernel("main").function(dev)
            self._cluster_fit[dev] = max_active_clusters(func, self.threads, self.smem, cluster_parts(self.spec))
            if self._cluster_fit[dev] == 0:
                print(f"[falower] {self.spec.name}: clusters of {cluster_parts(self.spec)} do not fit device {dev}; "
                      "its split-kv parts are merged by the merge kernel", file=sys.stderr)
        return self._cluster_fit[dev]

    def _clusters_fit(self, q: Any, need: int = 1) -> bool:
        """Whether q's device runs `need` clusters of this kernel at once (device_clusters; unknown counts as
        yes). Why: a cluster's blocks share a GPC, so a grid of clusters can exceed what
        the GPCs hold while its blocks fit the SMs, and the clusters left over wait a whole round (4 parts of 32 q
        tiles in clusters of 4, 128 blocks on the H200's 132 SMs: 1.4-1.5x the merge kernel's call; 8 parts of 16
        in clusters of 8, 1.4-1.7x); the merge kernel's form is taken then (`plan`; a caller's own cluster_merge
        True asks for one cluster only). A device that runs none (a MIG slice, no clusters) says so once."""
        dev = q.device.index
        if dev is None:
            import torch

            dev = torch.cuda.current_device()
        most = self.device_clusters(dev)
        return most is None or most >= need

    @functools.cached_property
    def without_cluster(self) -> "FA2ForwardKernel":
        """This kernel without emit_fa3_ws.cluster_merge (its parts merged by the merge kernel): what Numba's
        launches run (`prepare`: numpy inputs, the simulator, views the direct path copies), since Numba launches no
        clusters. Compiled on first use."""
        return FA2ForwardKernel(dataclasses.replace(self.spec, extra={**self.spec.extra, "cluster_merge": False}))

    def prepare(self, q: Any, k: Any, v: Any, *captures: Any, _wrap: bool = True):
        """Check and convert the inputs once; returns (launch, finish).

        `launch()` runs the block-mask kernel (table mode) and the forward kernel on the prepared
        buffers; `finish()` returns (o, lse). Calling `launch` repeatedly re-runs the kernels with
        the least host work, which is what the benchmark times.
        """
        if cluster_parts(self.spec):  # Numba launches no clusters (the kernel without checks the inputs)
            return self.without_cluster.prepare(q, k, v, *captures, _wrap=_wrap)
        from numba import cuda

        s = self.spec
        kind = self._check(q, k, v, captures)
        _refuse_capture(kind)
        B, H, M, D = (int(n) for n in q.shape)
        N = int(k.shape[2])
        nq = -(-M // s.block_q)
        nk = -(-N // s.block_k)
        P = s.kv_parts
        fused = uses_fused_merge(s)  # split-kv's merge in the kernel (emit_fa3_ws.fused_merge)
        merge_io: list = []
        fused_io: list = []
        if kind == "torch":
            import torch

            # Numba device arrays launch faster than torch tensors (whose array interface Numba re-reads
            # at every launch) but cost a conversion each: worth it only for repeated launches.
            wrap = cuda.as_cuda_array if _wrap else (lambda t: t)
            bits = {"f32": torch.float32, "f64": torch.float64}.get(s.dtype, torch.int16)
            tma = uses_kv_maps(s)  # Q, K and V by TMA maps: a broadcast view copied (_broadcast)
            views = [_strided_view(x.contiguous() if tma and _broadcast(x.stride(), x.shape) else x, bits,
                                   s.path == "mma") for x in (q, k, v)]
            flat = [wrap(f) for f, _ in views]
            strides = [n for _, st in views for n in st]
            o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty((B, H, M), dtype=_acc_torch(s.dtype), device=q.device)
            # split-kv: the kernel's parts into workspaces [P B, H, M, D] and [P B, H, M], merged into o and lse
            o_ws, lse_ws, *arrivals = (o, lse) if P == 1 else self.split_workspaces(  # (Numba: stream 0)
                q.device, 0, _split_shapes(s, B, H, M, D), q.dtype, lse.dtype)
            o_k = wrap(o_ws.view(torch.int32 if s.path == "mma" else bits).reshape(-1))
            lse_k = wrap(lse_ws.reshape(-1))
            if fused:  # the kernel's own merge: the call's O and LSE, the counts
                fused_io = [wrap(o.view(torch.int32).reshape(-1)), wrap(lse.reshape(-1)), wrap(arrivals[0])]
            elif P > 1:
                merge_io = [wrap(o_ws.view(torch.int16).reshape(-1)), lse_k, wrap(o.view(torch.int16).reshape(-1)),
                            wrap(lse.reshape(-1))]
            caps = [wrap(x.detach()) if hasattr(x, "detach") else x
                    for x in _one_element_captures(s, captures, "torch", q)]
            alloc = lambda: torch.empty(B * H * nq * nk, dtype=torch.int8, device=q.device)  # noqa: E731
        else:
            bits = {"f32": np.float32, "f64": np.float64}.get(s.dtype, np.int16)

            def dev(x):
                if kind == "numpy":
                    return cuda.to_device(np.ascontiguousarray(x))
                return cuda.as_cuda_array(x)

            if kind == "numpy":  # bit patterns, viewed on the host (ml_dtypes.bfloat16 included)
                tma = uses_kv_maps(s)  # Q, K and V by TMA maps: a broadcast view copied (_broadcast)
                views = [_strided_view_np(np.ascontiguousarray(x) if tma and _broadcast(x.strides, x.shape) else x,
                                          bits) for x in (q, k, v)]
                flat = [cuda.to_device(f) for f, _ in views]
                strides = [n for _, st in views for n in st]
            else:
                flat = [cuda.as_cuda_array(x).reshape(-1).view(bits) for x in (q, k, v)]
                strides = [n for x in (q, k, v) for n in _contiguous_strides(x.shape)]
            o_k = cuda.device_array(P * B * H * M * D // 2 if s.path == "mma" else P * B * H * M * D,
                                    dtype=np.uint32 if s.path == "mma" else bits)
            lse_k = cuda.device_array(P * B * H * M, dtype=_acc_np(s.dtype))
            if P > 1:  # split-kv: the parts in o_k and lse_k, merged into these
                o_m, lse_m = cuda.device_array(B * H * M * D, dtype=np.int16), cuda.device_array(B * H * M, np.float32)
                merge_io = [o_k.view(np.int16), lse_k, o_m, lse_m]
            if fused:
                fused_io = [o_m.view(np.int32), lse_m, cuda.to_device(np.zeros(_arrivals_len(s, B, H, M), np.int32))]
            caps = [x if np.isscalar(x) else dev(x) for x in _one_element_captures(s, captures, kind, q)]
            alloc = lambda: cuda.device_array(B * H * nq * nk, dtype=np.int8)  # noqa: E731
        # the dense block table (table mode): the one made for these data before, or one the launch fills
        entry = self.block_tables.entry(list(captures), (B, H, M, N), alloc) if self._mask_kernel else None
        table = None if entry is None else wrap(entry.table) if kind == "torch" else entry.table

        sizes = [B, H, M, N]
        extra = [table] if table is not None else []
        if uses_work_counter(s):  # Numba launches on the default stream
            work = self.work_counter(kind, q.device if kind == "torch" else None)
            extra.append(wrap(work) if kind == "torch" else work)
        if uses_o_map(s):  # O's tensor map (tensor_maps.TensorMaps)
            extra.append(wrap(self.maps.torch_o(o_ws, stream=0)) if kind == "torch" else  # Numba's default stream
                         self.maps.numba(o_k, o_map_geometry(P * B * H, M, D)))
        if uses_kv_maps(s):  # Q's, K's and V's (tma_loads): over the views the kernel reads
            for i, geometry, name in _qkv_geometries(s, q, k, v, strides):
                extra.append(wrap(self.maps.torch(views[i][0].data_ptr(), q.device, geometry, stream=0, what=name))
                             if kind == "torch" else self.maps.numba(flat[i], geometry, name))
        args = [*flat, o_k, lse_k, *sizes, *strides, *extra, *fused_io, *caps]
        if self.smem > 48 * 1024:
            self._raise_smem_limit(self._kernel, args, self.smem)
        forward = self._kernel[grid(s, B, H, M, N), self.threads, 0, self.smem]
        block_mask = self._mask_kernel[(nk, nq, B * H), 128] if self._mask_kernel is not None else None
        mask_args = [table, *sizes, *caps]
        if P > 1 and not fused:
            from .lse_merge import merge_grid, split_merge_kernel

            rows = B * H * M
            merge = split_merge_kernel(P, s.dtype, self.merge_vec)[merge_grid(rows, D, self.merge_vec)]

        def launch() -> None:
            if block_mask is not None:
                self.block_tables.fill(entry, lambda: block_mask(*mask_args))
            forward(*args)
            if P > 1 and not fused:
                merge(*merge_io, rows, D)

        launch.table = table  # type: ignore[attr-defined]  # the block classes, filled by launch() (table mode)

        def finish():
            if kind == "torch":
                return o, lse
            o_out, lse_out = (o_k, lse_k) if P == 1 else (o_m, lse_m)
            if kind == "numpy":
                host = o_out.copy_to_host()
                out_dtype = np.dtype(q.dtype) if s.dtype == "bf16" else _NP_DTYPES[s.dtype]
                return host.view(out_dtype).reshape(B, H, M, D), lse_out.copy_to_host().reshape(B, H, M)
            out_dtype = np.dtype(q.__cuda_array_interface__["typestr"])
            return o_out.view(bits).view(out_dtype).reshape(B, H, M, D), lse_out.reshape(B, H, M)

        return launch, finish


class CaptureError(RuntimeError):
    """A call that cannot be captured into a CUDA graph was made while torch's stream captured one."""


def _refuse_capture(kind: str) -> None:
    """Numba's launch path (`prepare`) while torch's stream captures a CUDA graph: refused by name. It synchronises
    on its inputs' stream and launches on the legacy default stream, which a capture forbids, and its tensor maps
    and derived data are kept by the state of capture time."""
    if kind != "torch":
        return
    import torch

    if torch.cuda.is_current_stream_capturing():
        raise CaptureError("falower: this call takes Numba's launch path, which cannot be captured into a CUDA graph "
                           "(FALOWER_DIRECT_LAUNCH=0, q / k / v rows not 16-byte aligned, or a capture the direct "
                           "launch does not take); call it outside the capture, or with contiguous, aligned inputs")


def _contiguous_strides(shape) -> tuple[int, int, int]:
    """Element strides (batch, head, row) of a contiguous [B, H, N, D] array."""
    _, H, N, D = (int(n) for n in shape)
    return (H * N * D, N * D, D)


def _strided_view(x: Any, bits: Any, aligned: bool) -> tuple[Any, tuple[int, int, int]]:
    """A torch [B, H, N, D] view whose last dim is contiguous as (1-D view spanning its elements in `bits`,
    element strides (batch, head, row)): the kernels index b*sb + h*sh + r*sm + d, so a transposed
    [B, N, H, D] projection runs without a copy. The tensor-core path copies 16-byte rows with cp.async: rows
    whose start is not 16-byte aligned (a stride or offset not a multiple of 8 halves) are copied contiguous."""
    import torch

    x = x.detach()
    if aligned and (any(st % 8 for st in x.stride()[:3]) or x.data_ptr() % 16):
        x = x.clone(memory_format=torch.contiguous_format)
    xv = x.view(bits)
    span = 1 + sum((n - 1) * st for n, st in zip(xv.shape, xv.stride()))
    flat = torch.as_strided(xv, (span,), (1,), xv.storage_offset())
    return flat, tuple(int(st) for st in xv.stride()[:3])


def _strided_view_np(x: np.ndarray, bits: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The numpy twin of _strided_view: the elements a [B, H, N, D] view spans, in bits, and its element
    strides (batch, head, row), so host arrays in a transposed layout take the same kernel path."""
    item = x.itemsize
    if any(st < 0 or st % item for st in x.strides):
        x = np.ascontiguousarray(x)
    span = 1 + sum((n - 1) * (st // item) for n, st in zip(x.shape, x.strides))
    flat = np.lib.stride_tricks.as_strided(x, (span,), (item,))
    return np.ascontiguousarray(flat).view(bits), tuple(int(st // item) for st in x.strides[:3])


def _dq_acc_len(spec, B: int, H: int, M: int, D: int) -> int:
    """Elements of the backward's f32 dQ accumulator: B H M D, or under dq_ws whole q tiles (emit_fa3_bwd.dq_ws)."""
    from .emit_fa3_bwd import dq_acc_rows

    return B * H * dq_acc_rows(spec, M) * D


def _dkdv_maps(spec) -> bool:
    """Whether the backward's main kernel takes dK's and dV's tensor maps (emit_fa3_bwd.dkdv_tma, dkdv_in_tile)."""
    from .emit_fa3_bwd import dkdv_maps

    return isinstance(spec, FA2BackwardSpec) and dkdv_maps(spec)


def _capture_types(spec) -> list:
    """Numba types of a spec's captured tensors (and scalar sizes), as the kernels take them."""
    from numba import types

    capty = {"f16": types.float16, "bf16": types.int16, "f32": types.float32, "f64": types.float64,
             "i32": types.int32, "i8": types.int8, "bool": types.boolean}  # (i8: an i8 table read on the GPU
    # raised KeyError here, the direct launches' types; the simulator does not build them)
    return [types.Array(capty[c.dtype], c.ndim, "C") if c.ndim > 0 else capty[c.dtype] for c in spec.captures]


def _sig(x: Any) -> Any:
    """What a plan depends on in one input: a tensor's shape, strides, dtype and device; a number's type."""
    if type(x).__module__.startswith("torch"):
        return (x.shape, x.stride(), x.dtype, x.device)
    return type(x)


def _captures_fit(spec, captures: tuple) -> bool:
    """Captures the direct launches take as they are: torch tensors of the kernel's dtypes (contiguous, on
    q's device) for array captures, Python numbers for scalar ones."""
    for c, x in zip(spec.captures, captures):
        if c.ndim == 0:
            if hasattr(x, "shape"):
                return False
            continue
        if not type(x).__module__.startswith("torch") or x.dtype != _torch_capture_dtype(c.dtype):
            return False
        if not x.is_cuda or not x.is_contiguous():
            return False
    return True


def _one_element_captures(spec, captures: tuple, kind: str, like: Any) -> list:
    """Captures for the Numba path, with a 0-d array or a Python number given for a 1-element capture
    (how the kernels take a 0-d capture) reshaped or copied to one, and a numpy or torch array of another dtype
    than the graph declares converted to it (the kernels read the declared element size: an f64 table read as f32
    gave wrong numbers, not an error)."""
    out = []
    for c, x in zip(spec.captures, captures):
        if c.ndim == 1 and len(getattr(x, "shape", ())) == 0:
            if kind == "torch":
                import torch

                x = (x.detach().reshape(1).to(_torch_capture_dtype(c.dtype)) if torch.is_tensor(x) else
                     torch.full((1,), x, dtype=_torch_capture_dtype(c.dtype), device=like.device))
            else:
                x = np.asarray(x, dtype=_np_capture_dtype(c.dtype)).reshape(1)
        elif isinstance(x, np.ndarray) and c.dtype != "bf16" and x.dtype != _np_capture_dtype(c.dtype):
            x = np.ascontiguousarray(x, dtype=_np_capture_dtype(c.dtype))
        elif type(x).__module__.startswith("torch") and x.dtype != _torch_capture_dtype(c.dtype):
            x = x.detach().to(_torch_capture_dtype(c.dtype)).contiguous()
        out.append(x)
    return out


def _np_capture_dtype(dtype: str) -> Any:
    return {"f16": np.float16, "bf16": np.int16, "f32": np.float32, "f64": np.float64, "i32": np.int32,
            "i8": np.int8, "bool": np.bool_}[dtype]


def _numel(x: Any) -> int:
    n = getattr(x, "size", None)
    if n is None or callable(n):
        return int(x.numel())
    return int(n)


def ptx_of(kernel, argtypes: tuple, cc: tuple[int, int] = (9, 0)) -> str:
    """PTX of a generated kernel. Works without a GPU: a device-function dispatcher asks the current
    device for its compute capability when it compiles, so with no driver we answer `cc` for it."""
    from numba import cuda
    import numba.cuda.dispatcher as dispatcher_module

    from .intrinsics import lean_compiles

    bounds = getattr(kernel.py_func, "__falower_launch_bounds__", None)  # as kernel_jit compiles it
    if cuda.is_available():
        with lean_compiles():
            ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=cc, launch_bounds=bounds)
        return ptx

    class _NoDevice:
        compute_capability = tuple(cc)

    original = dispatcher_module.get_current_device
    dispatcher_module.get_current_device = lambda: _NoDevice
    try:
        with lean_compiles():
            ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=cc, launch_bounds=bounds)
    finally:
        dispatcher_module.get_current_device = original
    return ptx


def compile_unbound(dispatcher: Any, argtypes: tuple) -> Any:
    """Numba's compiled kernel for `argtypes` (a numba.cuda _Kernel), made without what Dispatcher.compile adds
    for Numba's own launches: `bind()` links the kernel through Numba's linker and loads it into Numba's context,
    and the result is pickled into Numba's disk cache; the direct launches link the PTX themselves
    (`link_cubin`), load the cubin with the driver and keep it in falower's cubin cache, so those were a second
    link and a second cache: ~0.7 s of a 3.9 s cold compile on the H100 host (benchmarks/NOTES.md "Compile
    time", round 6). Always without link-time optimisation: numba-cuda's default (lto=True) made NVVM run twice
    (PTX, then LTO-IR) and nvJitLink optimise the whole kernel again, for a program NVVM already compiled whole
    (its device functions are in the kernel's NVVM module); FALOWER_LTO=1 keeps it (then link_cubin leaves the
    link to Numba), to compare the code either makes. Falls back to Dispatcher.compile where numba-cuda's layout
    differs."""
    try:
        from numba.cuda.dispatcher import _Kernel
    except ImportError:
        return dispatcher.compile(argtypes)
    opts = dict(getattr(dispatcher, "targetoptions", {}))
    if "lto" not in opts or getattr(dispatcher, "py_func", None) is None:
        return dispatcher.compile(argtypes)
    opts["lto"] = os.environ.get("FALOWER_LTO") == "1"  # 1: numba-cuda's LTO link, to compare the code it makes
    from .intrinsics import lean_compiles

    with lean_compiles():
        return _Kernel(dispatcher.py_func, tuple(argtypes), **opts)


def nvjitlink_cubin(ptxes: Sequence[str], arch: str, options: Sequence[str] = ()) -> tuple[bytes, str]:
    """PTX -> cubin with nvJitLink, called directly: (cubin, info log)."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(1 + len(options), [f"-arch={arch}", *options])
    try:
        for i, ptx in enumerate(ptxes):
            data = ptx.encode()
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), f"kernel{i}.ptx")
        nvjitlink.complete(handle)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin), bytes(log).decode(errors="replace")


def whole_program_ptx(ptxes: Sequence[str]) -> bool:
    """Whether a kernel's PTX must be compiled as a whole program (by the driver, when it loads the PTX) rather
    than linked: its one module uses setmaxnreg, which ptxas ignores in a relocatable compile (warning C7504), and
    every compile through a linker (nvJitLink, Numba's, the driver's cuLink) is relocatable. So a producer
    warpgroup at 40 registers and consumers at 232 (FA3's split) only exist this way. FALOWER_PTX_JIT=0 links
    such PTX anyway (setmaxnreg then ignored), to compare."""
    return (len(ptxes) == 1 and "setmaxnreg." in ptxes[0] and ".extern .func" not in ptxes[0]
            and os.environ.get("FALOWER_PTX_JIT") != "0")


def ptx_image(ptx: str, arch: str) -> bytes:
    """PTX as an image for cuModuleLoadData (null-terminated), its target set to `arch` (Numba writes sm_90 where
    it builds for sm_90a, which wgmma and setmaxnreg need): the driver compiles it, whole program, at load."""
    ptx = re.sub(r"^\.target sm_\d+a?\b", f".target {arch}", ptx, count=1, flags=re.M)
    return ptx.encode() + b"\0"


def link_cubin(lib: Any, cc: tuple) -> bytes:
    """The cubin of a compiled Numba kernel (`lib`, its CUDACodeLibrary) for `cc` (Numba's (major, minor,
    suffix)). Its PTX goes to nvJitLink directly: Numba's own link (cuda.core's Linker) cost 1.38 s of the
    warp-specialized forward's 7.9 s cold compile on the H100 host, nvJitLink 0.18 s on the same PTX with the
    same 222 registers (benchmarks/probe_link.py, benchmarks/NOTES.md "Compile time"). A library Numba would
    link more into (LTO, linked files, cudadevrt) keeps Numba's link. A kernel that needs a whole-program compile
    (`whole_program_ptx`: setmaxnreg) gets its PTX as the image instead, which the driver compiles when it loads
    it."""
    if getattr(lib, "_lto", False) or getattr(lib, "_linking_files", None) or getattr(lib, "needs_cudadevrt", False) \
            or os.environ.get("FALOWER_NUMBA_LINK") == "1":
        return cubin_cache.cubin_bytes(lib.get_cubin(cc=cc))
    options = [f"-maxrregcount={lib._max_registers}"] if getattr(lib, "_max_registers", None) else []
    arch = f"sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}"  # as Numba's _Linker names it (sm_90a)
    ptxes = lib.get_asm_strs(cc=cc)
    if whole_program_ptx(ptxes) and not options:
        return ptx_image(ptxes[0], arch)
    try:
        cubin, _ = nvjitlink_cubin(ptxes, arch, options)
    except ImportError:  # no cuda.bindings: Numba's link
        return cubin_cache.cubin_bytes(lib.get_cubin(cc=cc))
    return cubin


def resource_usage(ptx: str, arch: str = "sm_90") -> dict[str, int]:
    """Link PTX with nvJitLink (no GPU needed) and read registers / spills from its verbose log."""
    _, log = nvjitlink_cubin([ptx], arch, ["-verbose"])
    out = {"log": log}
    m = re.search(r"Used (\d+) registers", log)
    out["registers"] = int(m.group(1)) if m else -1
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    out["spill_stores"], out["spill_loads"] = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
    m = re.search(r"(\d+) bytes stack frame", log)
    out["stack_frame"] = int(m.group(1)) if m else -1
    return out


class FA2BackwardKernel:
    """The compiled FA2 backward for `spec`: Delta (+ zeroed dQ accumulator), the block table of a data
    mask, the main kernel (kv tiles outer) and dQ's conversion, launched in that order.

    Attributes: `spec`, `source` (the main kernel's module), `delta_source`, `dq_source`, `mask_source`.
    """

    def __init__(self, spec: FA2BackwardSpec) -> None:
        from .emit_fa2_bwd import emit_delta, emit_dq_convert, emit_dq_kernel, emit_fa2_backward, emit_parts_sum
        from .emit_fa3_bwd import resolve

        # the wgmma main kernel where asked and able; a spec it refuses runs on mma.sync (the reason kept)
        spec, self.wgmma_refused = resolve(spec)
        self.spec = spec
        self.threads = bwd_threads(spec)
        self.smem = bwd_smem_bytes(spec)
        self.dq_smem = dq_smem_bytes(spec) if spec.dq == "separate" else 0
        self._smem_set: set[tuple] = set()
        self._direct: dict[str, DirectKernel] = {}
        self._dispatchers: dict[str, Any] = {}
        self._plans: dict[tuple, Optional[_BackwardPlan]] = {}
        self.block_tables = BlockTables()  # the dense block table (table mode), made once per distinct data
        self.maps = TensorMaps(spec.dtype)  # dK's and dV's tensor maps (emit_fa3_bwd.dkdv_tma)
        with compile_progress(_label(spec, "backward")):
            self.source = emit_cached(emit_fa2_backward, spec, "backward")
            self.delta_source = emit_cached(emit_delta, spec, "delta")
            # dq=atomic: the f32 accumulator's conversion; dq=separate: the q-outer dQ kernel
            self.dq_source = emit_cached(emit_dq_convert if spec.dq == "atomic" else emit_dq_kernel, spec, "dq")
            self.parts_source = emit_cached(emit_parts_sum, spec, "parts") if spec.deterministic and spec.grads else None
            self.mask_source = (emit_cached(emit_block_mask, spec, "bwd_block_mask")  # type: ignore[arg-type]
                                if spec.block_mask == "table" else None)
            if _has_gpu():  # compile now (or find the cubins), for the signatures the direct launches use
                for which in self._kernel_names():
                    self._direct_kernel(which)

    # Numba's dispatchers, made on first use (see FA2ForwardKernel._kernel)
    def dispatcher(self, which: str) -> Any:
        """Numba's dispatcher of one of the kernels (see kernel_argtypes), None for one this spec has not."""
        found = self._dispatchers.get(which)
        if found is None and which not in self._dispatchers:
            name = self.spec.name
            dq = name + ("_dq" if self.spec.dq == "atomic" else "_dqk")
            source, stem, attr = {"main": (self.source, name, name),
                                  "delta": (self.delta_source, name + "_delta", name + "_delta"),
                                  "dq": (self.dq_source, dq, dq),
                                  "parts": (self.parts_source, name + "_parts", name + "_parts"),
                                  "mask": (self.mask_source, name + "_bwd_block_mask", name + "_block_mask")}[which]
            found = getattr(load_source(source, stem), attr) if source is not None else None
            self._dispatchers[which] = found
        return found

    _kernel = property(lambda self: self.dispatcher("main"))
    _delta = property(lambda self: self.dispatcher("delta"))
    _dq = property(lambda self: self.dispatcher("dq"))
    _parts = property(lambda self: self.dispatcher("parts"))
    _mask_kernel = property(lambda self: self.dispatcher("mask"))

    def _kernel_names(self) -> list[str]:
        names = ["delta", "main", "dq"]
        if self.mask_source is not None:
            names.append("mask")
        if self.parts_source is not None:
            names.append("parts")
        return names

    def _direct_kernel(self, which: str) -> DirectKernel:
        kern = self._direct.get(which)
        if kern is None:
            source = {"main": self.source, "delta": self.delta_source, "dq": self.dq_source,
                      "mask": self.mask_source, "parts": self.parts_source}[which]
            smem = {"main": self.smem, "dq": self.dq_smem}.get(which, 0)
            kern = DirectKernel(lambda: self.dispatcher(which), lambda: self.kernel_argtypes(which), smem,
                                _ident(f"backward.{which}", self.spec, source))
            self._direct[which] = kern
        return kern

    def kernel_argtypes(self, which: str) -> tuple:
        """Numba argument types of one of the backward's kernels: "main" (argtypes()), "delta", "dq" (the
        accumulator's conversion, or the q-outer dQ kernel with dq=separate), "mask", "parts"."""
        from numba import types

        s = self.spec
        if which == "main":
            return self.argtypes()
        elem = {"f32": types.float32, "f64": types.float64}.get(s.dtype, types.int16)
        acc = types.float64 if s.dtype == "f64" else types.float32
        arr = lambda t: types.Array(t, 1, "C")  # noqa: E731
        pair = arr(types.int32) if s.path == "mma" else arr(elem)
        i64 = types.int64
        caps = tuple(_capture_types(s))
        table = (arr(types.int8),) if s.block_mask == "table" else ()
        if which == "delta":
            return (arr(elem), arr(elem), arr(acc), arr(acc)) + (i64,) * 5
        if which == "dq" and s.dq == "separate":
            return (arr(elem),) * 3 + (arr(acc), arr(elem), arr(acc), pair) + (i64,) * 16 + table + caps
        if which == "dq":
            return (arr(acc), pair, i64, i64)
        if which == "mask":
            return (arr(types.int8),) + (i64,) * 4 + caps
        if which == "parts":
            return (arr(acc), arr(acc), i64, i64)
        raise ValueError(f"no backward kernel {which!r}")

    _raise_smem_limit = FA2ForwardKernel._raise_smem_limit

    def argtypes(self) -> tuple:
        """Numba argument types of the main kernel (flat contiguous arrays, int64 sizes)."""
        from numba import types

        s = self.spec
        elem = {"f32": types.float32, "f64": types.float64}.get(s.dtype, types.int16)
        acc = types.float64 if s.dtype == "f64" else types.float32
        arr = lambda t: types.Array(t, 1, "C")  # noqa: E731
        out = arr(types.int32) if s.path == "mma" else arr(elem)
        args = [arr(elem), arr(elem), arr(elem), arr(acc), arr(elem), arr(acc), arr(acc), out, out] + [types.int64] * 16
        if s.block_mask == "table":
            args.append(arr(types.int8))
        args += [arr(acc)] * len(s.grads)
        if _dkdv_maps(s):
            args += [arr(types.uint8)] * 2  # dK's and dV's tensor maps
        args += _capture_types(s)
        return tuple(args)

    def ptx(self, cc: tuple[int, int] = (9, 0)) -> str:
        """PTX of the main backward kernel for compute capability `cc` (no GPU needed)."""
        return ptx_of(self._kernel, self.argtypes(), cc)

    def __call__(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, *captures: Any, dlse: Any = None) -> tuple:
        """Gradients (dq, dk, dv, *captured tables' gradients), of the same kind as q; `dlse`, the LSE's cotangent,
        is subtracted from Delta once Delta's kernel made it (passes/lse_cotangent.py)."""
        plan = self.plan(q, k, v, o, lse, do, captures)
        if plan is not None:
            out = plan(q, k, v, o, lse, do, captures, dlse=dlse)
            if out is not None:
                return out
        launch, finish = self.prepare(q, k, v, o, lse, do, *captures, dlse=dlse)
        launch()
        return finish()

    def plan(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, captures: tuple) -> Optional[_BackwardPlan]:
        """The direct launches for these torch CUDA inputs' signature (made on first use), or None (see
        FA2ForwardKernel.plan)."""
        if not (type(q).__module__.startswith("torch") and _direct_enabled()):
            return None
        key = tuple(_sig(x) for x in (q, k, v, o, lse, do)) + tuple(_sig(x) for x in captures)
        try:
            return self._plans[key]
        except KeyError:
            pass
        plan = None
        self._check(q, k, v, o, lse, do, captures)
        aligned = self.spec.path == "mma"
        dense = all(_kind(x) == "torch" and x.is_cuda for x in (o, lse, do)) and o.is_contiguous() \
            and lse.is_contiguous() and lse.dtype == _acc_torch(self.spec.dtype) and o.dtype == q.dtype \
            and do.dtype == q.dtype
        if dense and all(_fast_ok(x, aligned) for x in (q, k, v, do)) and _captures_fit(self.spec, captures):
            plan = _BackwardPlan(self, q, k, v, o, lse, do, captures)
        self._plans[key] = plan
        return plan

    def _check(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, captures: tuple) -> str:
        """prepare's checks of the backward's inputs; returns their kind."""
        s = self.spec
        fwd_like = FA2ForwardKernel.__new__(FA2ForwardKernel)
        fwd_like.spec = s  # type: ignore[assignment]
        kind = FA2ForwardKernel._check(fwd_like, q, k, v, captures)  # type: ignore[arg-type]
        for name, x, like in (("o", o, q), ("do", do, q)):
            if tuple(int(n) for n in x.shape) != tuple(int(n) for n in like.shape):
                raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
            if _dtype_name(x, _kind(x)) != s.dtype:
                raise TypeError(f"{name} has dtype {_dtype_name(x, _kind(x))}, this kernel was built for {s.dtype}")
            if name == "o" and not _is_contiguous(x, _kind(x)):
                raise ValueError("o must be contiguous (the forward's output is); call .contiguous() first")
            if name == "do" and _kind(x) == "torch" and x.shape[3] > 1 and x.stride(3) != 1:
                raise ValueError(f"the last dimension of do must be contiguous (stride 1), got strides {tuple(x.stride())}")
            if name == "do" and _kind(x) == "cai" and not _is_contiguous(x, _kind(x)):
                raise ValueError("do must be contiguous (row-major); call .contiguous() first")
        B, H, M = (int(n) for n in q.shape[:3])
        if tuple(int(n) for n in lse.shape) != (B, H, M):
            raise ValueError(f"lse must have shape {(B, H, M)}, got {tuple(lse.shape)}")
        return kind

    def prepare(self, q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, *captures: Any, dlse: Any = None):
        """Check and convert the inputs once; returns (launch, finish) as FA2ForwardKernel.prepare does."""
        from numba import cuda

        s = self.spec
        kind = self._check(q, k, v, o, lse, do, captures)
        check_dlse(dlse, lse)
        _refuse_capture(kind)
        B, H, M, D = (int(n) for n in q.shape)
        Hk, N = int(k.shape[1]), int(k.shape[2])
        nq, nk = -(-M // s.block_q), -(-N // s.block_k)
        rows = B * H * M
        grad_caps = [captures[g.capture] for g in s.grads]
        if kind == "torch":
            import torch

            bits = {"f32": torch.float32, "f64": torch.float64}.get(s.dtype, torch.int16)
            pair = torch.int32 if s.path == "mma" else bits
            accd = _acc_torch(s.dtype)
            views = [_strided_view(x, bits, s.path == "mma") for x in (q, k, v, do)]
            flat = [f for f, _ in views] + [o.detach().view(bits).reshape(-1)]
            strides = [n for _, st in views for n in st]
            dev = q.device
            lse_k = lse.detach().reshape(-1)
            delta = torch.empty(rows, dtype=accd, device=dev)
            dq32 = torch.empty(_dq_acc_len(s, B, H, M, D), dtype=accd, device=dev)
            dq = torch.empty(q.shape, dtype=q.dtype, device=dev)
            dk = torch.empty(k.shape, dtype=k.dtype, device=dev)
            dv = torch.empty(v.shape, dtype=v.dtype, device=dev)
            dq_k, dk_k, dv_k = (x.view(pair).reshape(-1) for x in (dq, dk, dv))
            nblk = bwd_grid(s, B, H, M, N)[0] if s.deterministic else 1  # deterministic: one copy per block
            grads = [torch.zeros(nblk * int(np.prod(x.shape)), dtype=accd, device=dev) for x in grad_caps]
            sums = [torch.empty(int(np.prod(x.shape)), dtype=accd, device=dev) for x in grad_caps]
            caps = [x.detach() if hasattr(x, "detach") else x for x in _one_element_captures(s, captures, kind, q)]
            alloc = lambda: torch.empty(B * H * nq * nk, dtype=torch.int8, device=dev)  # noqa: E731
        else:
            bits = {"f32": np.float32, "f64": np.float64}.get(s.dtype, np.int16)
            pair = np.uint32 if s.path == "mma" else bits
            accd = _acc_np(s.dtype)

            def dev_array(x):
                if kind == "numpy":
                    return cuda.to_device(np.ascontiguousarray(x))
                return cuda.as_cuda_array(x)

            if kind == "numpy":
                views = [_strided_view_np(x, bits) for x in (q, k, v, do)]
                flat = [cuda.to_device(f) for f, _ in views]
                flat.append(cuda.to_device(np.ascontiguousarray(o).reshape(-1).view(bits)))
                strides = [n for _, st in views for n in st]
                lse_k = cuda.to_device(np.ascontiguousarray(lse, dtype=accd).reshape(-1))
            else:
                flat = [cuda.as_cuda_array(x).reshape(-1).view(bits) for x in (q, k, v, do, o)]
                strides = [n for x in (q, k, v, do) for n in _contiguous_strides(x.shape)]
                lse_k = cuda.as_cuda_array(lse).reshape(-1)
            delta = cuda.device_array(rows, dtype=accd)
            dq32 = cuda.device_array(_dq_acc_len(s, B, H, M, D), dtype=accd)
            per = 2 if s.path == "mma" and s.dtype != "f32" else 1
            dq_k = cuda.device_array(rows * D // per, dtype=pair)
            dk_k = cuda.device_array(B * Hk * N * D // per, dtype=pair)
            dv_k = cuda.device_array(B * Hk * N * D // per, dtype=pair)
            nblk = bwd_grid(s, B, H, M, N)[0] if s.deterministic else 1  # deterministic: one copy per block
            grads = [cuda.to_device(np.zeros(nblk * int(np.prod(x.shape)), dtype=accd)) for x in grad_caps]
            sums = [cuda.device_array(int(np.prod(x.shape)), dtype=accd) for x in grad_caps]
            caps = [x if np.isscalar(x) else dev_array(x) for x in _one_element_captures(s, captures, kind, q)]
            alloc = lambda: cuda.device_array(B * H * nq * nk, dtype=np.int8)  # noqa: E731
        # the dense block table (table mode): the one made for these data before, or one the launch fills
        entry = self.block_tables.entry(list(captures), (B, H, M, N), alloc) if self._mask_kernel else None
        table = None if entry is None else entry.table

        qf, kf, vf, dof, of = flat
        sizes = [B, H, M, N]
        extra = [table] if table is not None else []
        separate = s.dq == "separate"
        if separate:
            dq32 = delta  # not read: dQ comes from its own kernel
        maps = []
        if _dkdv_maps(s):  # dK's and dV's tensor maps, over the kv heads' rows (Numba's default stream)
            geometry = o_map_geometry(B * Hk, N, D)
            if kind == "torch":
                maps = [self.maps.torch(x.data_ptr(), dev, geometry, stream=0, what=w) for x, w in ((dk, "dK"), (dv, "dV"))]
            else:
                maps = [self.maps.numba(x, geometry, w) for x, w in ((dk_k, "dK"), (dv_k, "dV"))]
        args = [qf, kf, vf, lse_k, dof, delta, dq32, dk_k, dv_k, *sizes, *strides, *extra, *grads, *maps, *caps]
        if self.smem > 48 * 1024:
            self._raise_smem_limit(self._kernel, args, self.smem)
        main = self._kernel[bwd_grid(s, B, H, M, N), self.threads, 0, self.smem]
        delta_k = self._delta[delta_grid(B, H, M, delta_rows(s)), 128]
        ndq = rows * D
        if separate:
            dq_args = [qf, kf, vf, lse_k, dof, delta, dq_k, *sizes, *strides, *extra, *caps]
            if self.dq_smem > 48 * 1024:
                self._raise_smem_limit(self._dq, dq_args, self.dq_smem)
            conv = self._dq[dq_grid(s, B, H, M), dq_threads(s), 0, self.dq_smem]
        else:
            dq_args = [dq32, dq_k, ndq, M]
            conv = self._dq[dq_convert_launch(s, B, H, M, ndq)]
        block_mask = self._mask_kernel[(nk, nq, B * H), 128] if self._mask_kernel is not None else None
        # (configured at each launch: the simulator's dispatcher[config] sets the config on itself and returns
        # itself, so launches configured ahead for two tables of different sizes both took the last one's grid)
        parts = [(-(-_numel(out) // 128), g_buf, out) for g_buf, out in zip(grads, sums)] \
            if self._parts is not None else []

        zeros = [np.zeros(_numel(g_buf), dtype=_acc_np(s.dtype)) for g_buf in grads] if kind != "torch" else []

        def launch() -> None:
            for i, g_buf in enumerate(grads):  # the tables' gradients are sums: start each launch from zero
                if kind == "torch":
                    g_buf.zero_()
                else:
                    g_buf.copy_to_device(zeros[i])
            delta_k(dof, of, delta, dq32, H, M, *strides[9:12])
            if dlse is not None:  # the LSE's cotangent: Delta - dLSE (passes/lse_cotangent.py)
                if kind == "torch":  # on the stream Numba launches on (0, torch's default), between its launches
                    with torch.cuda.stream(torch.cuda.default_stream(delta.device)):
                        delta.sub_(dlse.detach().reshape(-1).to(delta.dtype))
                else:  # (the simulator's and numpy's path: once through the host)
                    moved = delta.copy_to_host() - np.asarray(_host_rows(dlse), dtype=delta.dtype).reshape(-1)
                    delta.copy_to_device(moved)
            if block_mask is not None:
                self.block_tables.fill(entry, lambda: block_mask(table, *sizes, *caps))
            main(*args)
            for blocks, g_buf, out in parts:
                self._parts[(blocks,), 128](g_buf, out, nblk, _numel(out))
            conv(*dq_args)

        def finish() -> tuple:
            final = sums if parts else grads
            if kind == "torch":
                outs = [dq, dk, dv]
                for g_buf, x in zip(final, grad_caps):
                    outs.append(g_buf.reshape(x.shape).to(x.dtype))
                return tuple(outs)
            if kind == "numpy":
                out_dtype = np.dtype(q.dtype)
                res = [dq_k.copy_to_host().view(out_dtype).reshape(B, H, M, D),
                       dk_k.copy_to_host().view(out_dtype).reshape(B, Hk, N, D),
                       dv_k.copy_to_host().view(out_dtype).reshape(B, Hk, N, D)]
                for g_buf, x in zip(final, grad_caps):
                    res.append(g_buf.copy_to_host().reshape(x.shape).astype(x.dtype))
                return tuple(res)
            out_dtype = np.dtype(q.__cuda_array_interface__["typestr"])
            res = [dq_k.view(bits).view(out_dtype).reshape(B, H, M, D),
                   dk_k.view(bits).view(out_dtype).reshape(B, Hk, N, D),
                   dv_k.view(bits).view(out_dtype).reshape(B, Hk, N, D)]
            return tuple(res + list(final))

        launch.table = table  # type: ignore[attr-defined]
        return launch, finish
