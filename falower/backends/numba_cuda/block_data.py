"""Block data: what a data-dependent mask's kernels read that is made from the captured data, not given.

A document mask `doc[b, q] == doc[b, kv]` is classified per tile from `mask.ranges` tables (the least and
greatest document id of each granule of rows, O(N) to make), and the forward visits its kv tiles from a
block list (per q tile: how many kv tiles to visit and which, partial ones flagged), made by the kernel's
own `tile_class_fn` over those ranges: O(B * H * nq * nk) scalar work, never a pass over the (q, kv) pairs.
The backward (kv tiles outer) visits its q tiles from the transposed list (per kv tile: which (head, q tile)
pairs of its kv head's group, partial ones flagged), and its q-outer dQ kernel (deterministic mode) from a
list like the forward's, both made by one list kernel from the backward's own tile_class_fn /
tile_class_q_fn, called with exactly the arguments the kernels' scan would use: the list holds exactly the
tiles the scan would visit, with the scan's classes. All arrive at the kernels as captures whose
`Capture.derived` says how to make them (spec.py).

Masks the range analysis cannot bound (a table read at an index computed from data, a table read along both
q and kv) keep the dense `mask.block_table`: a kernel evaluates the mask at every (q, kv) pair. `BlockTables`
remembers that table with its data, so it is evaluated once per distinct data, not at every call.

`BlockData.derive` and `BlockTables.entry` remember what they make with the data it came from (`data_key`):
a torch tensor is recognised by its identity (a weak reference: a new tensor at a recycled address is not
mistaken for it) and its version counter (an in-place write makes it new data), a Python or numpy number by
its value, a numpy array by its content (dtype, shape and a 128-bit BLAKE2 digest of its bytes: O(size of
the captured tables), far below the O(B * H * M * N) dense evaluation and no more than the host-to-device
copy numpy inputs pay at every call anyway; numpy has no version counter, and an identity would not see an
in-place write). So every layer and every step that passes the same document ids (one
`falower.create_block_mask`, or the same tensor to a compiled call) makes the block data once. Other CUDA
arrays (`__cuda_array_interface__` objects: no version counter, content on the device) are not remembered:
made at every call. A write through a raw pointer (a Numba kernel writing into a torch tensor) does not bump
torch's version counter: call `tensor.add_(0)` or pass a new tensor after one.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from typing import Any, Callable, Optional

import numpy as np

from ...ir.intervals import minmax_table
from .spec import FA2ForwardSpec

_LIMIT = 16  # block data kept per cache (distinct document-id tensors in flight)
THREADS = 128


def caller_count(spec: Any) -> int:
    """How many of the spec's captures the caller passes (its tensors and the sizes): the rest are derived."""
    return next((i for i, c in enumerate(spec.captures) if c.derived), len(spec.captures))


def has_derived(spec: Any) -> bool:
    return caller_count(spec) < len(spec.captures)


def _kind(x: Any) -> str:
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return "numpy"
    return "cai"


# ------------------------------------------------------------------------------------ remembering
def _capturing(like: Any) -> bool:
    """Whether `like` is a torch tensor and torch's current stream is capturing a CUDA graph."""
    if _kind(like) != "torch":
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


def data_key(caps: list, sizes: tuple) -> Optional[tuple]:
    """What data derived from `caps` at `sizes` depends on (module docstring): per capture a torch tensor's
    identity, version, shape, strides, dtype and device; a number's type and value; a numpy array's dtype,
    shape and content digest. None when an input cannot be recognised again (other CUDA arrays)."""
    key: list = [sizes]
    for x in caps:
        kind = _kind(x)
        if kind == "torch":
            key.append((id(x), x._version, tuple(x.shape), x.stride(), x.dtype, x.device))
        elif np.isscalar(x):
            key.append((type(x), x))
        elif kind == "numpy":
            a = np.ascontiguousarray(x)
            digest = hashlib.blake2b(a.reshape(-1).view(np.uint8), digest_size=16).digest()
            key.append(("numpy", a.dtype.str, np.shape(x), digest))
        else:
            return None
    return tuple(key)


class _Memo:
    """At most `_LIMIT` values made from captured data, by `data_key`; a torch capture must still be the very
    tensor the value was made from (its weak reference), so a recycled id() is never mistaken for it."""

    def __init__(self) -> None:
        self._cache: dict[tuple, tuple[list, Any]] = {}

    def get(self, key: Optional[tuple], caps: list) -> Any:
        if key is None:
            return None
        hit = self._cache.get(key)
        if hit is not None and all(r() is x for r, x in zip(hit[0], caps) if r is not None):
            return hit[1]
        return None

    def put(self, key: Optional[tuple], caps: list, value: Any) -> None:
        if key is None:
            return
        if len(self._cache) >= _LIMIT:
            self._cache.clear()
        refs = [weakref.ref(x) if _kind(x) == "torch" else None for x in caps]
        self._cache[key] = (refs, value)


class BlockTable:
    """One dense block table (int8 [B * H * nq * nk], flat) and whether its mask kernel has been launched:
    a launch that finds it unfilled runs the mask kernel first (on the same stream, so the table is ready
    before any kernel enqueued after it reads it) and marks it filled."""

    __slots__ = ("table", "filled")

    def __init__(self, table: Any) -> None:
        self.table = table
        self.filled = False


class BlockTables:
    """The dense block tables of one kernel whose mask the range analysis cannot bound (block_mask ==
    "table"), remembered with the data they came from (`data_key`): the mask is evaluated densely once per
    distinct data. `evaluations` counts the mask kernel's launches (for tests and for looking)."""

    def __init__(self) -> None:
        self._memo = _Memo()
        self.evaluations = 0
        self._captured: list[Any] = []  # the tables of launches captured into CUDA graphs, kept alive with them

    def entry(self, caps: list, sizes: tuple, alloc: Callable[[], Any], capturing: bool = False) -> BlockTable:
        """The table for these captures (all of the kernel's, the sizes included) and (B, H, M, N): the one
        remembered, or a new one from `alloc()`, not yet filled. While a CUDA graph captures (`capturing`), always
        a new one, never remembered: its fill is a launch in the graph, run on every replay from the captures'
        data then (a remembered table holds the data of some earlier call), as BlockData.derive's; kept here for
        good, as the graph reads it."""
        if capturing:
            table = alloc()
            self._captured.append(table)
            return BlockTable(table)
        caps = list(caps)
        key = data_key(caps, tuple(sizes))
        found = self._memo.get(key, caps)
        if found is None:
            found = BlockTable(alloc())
            self._memo.put(key, caps, found)
        return found

    def fill(self, entry: BlockTable, launch: Callable[[], None]) -> None:
        """Run `launch` (the mask kernel into entry.table) unless the table is filled already."""
        if not entry.filled:
            launch()
            entry.filled = True
            self.evaluations += 1


def range_table(x: Any, axis: int, granule: int, dtype: str) -> Any:
    """`mask.ranges` of one captured table, as the kernels read it: [..., ceil(n / granule), ..., 2] with the
    least then the greatest entry of each granule along `axis` (intervals.minmax_table), in `dtype`."""
    kind = _kind(x)
    if kind == "torch":
        import torch

        t = x.detach().movedim(axis, -1)
        if dtype == "i32" and _small_int(t) and t.is_cuda:
            out = _launch_table_kernel("range_table_kernel", t.to(torch.int32).contiguous(), granule)
            if out is not None:
                return out.movedim(-2, axis).contiguous()
        t = t.to(torch.int32) if t.dtype == torch.bool else t
        n = t.shape[-1]
        ng = -(-n // granule)
        if ng * granule != n:  # the last granule is short: pad with its own last entry (changes no min or max)
            t = torch.cat([t, t[..., -1:].expand(*t.shape[:-1], ng * granule - n)], dim=-1)
        lo, hi = torch.aminmax(t.reshape(*t.shape[:-1], ng, granule), dim=-1)
        want = {"i32": torch.int32, "f32": torch.float32, "f64": torch.float64, "f16": torch.float16}[dtype]
        return torch.stack([lo, hi], dim=-1).movedim(-2, axis).to(want).contiguous()
    from numba import cuda

    host = np.asarray(x) if kind == "numpy" else cuda.as_cuda_array(x).copy_to_host()
    out = np.ascontiguousarray(minmax_table(host, axis, granule).astype(
        {"i32": np.int32, "f32": np.float32, "f64": np.float64, "f16": np.float16}[dtype]))
    return out if kind == "numpy" else cuda.to_device(out)


RUN_END = 1 << 30  # a run that reaches the end of its slice: every kv past the table (clamped to it) is in it


def run_table(x: Any, axis: int) -> Any:
    """The run bounds of an integer table along `axis`, [*x.shape, 2] int32: for each entry, the first index of
    the run of equal entries it is in and one past its last (RUN_END where the run ends the slice), when every
    value of its slice (the other indices fixed) lies in one run; (-1, -1) for every entry of a slice where some
    value comes back after another (then the kernels evaluate the mask themselves). With it a document mask
    doc[b, q] == doc[b, kv] keeps, per row, exactly kv in [lo, hi) (row_bounds.py). O(n log n) a slice."""
    kind = _kind(x)
    if kind == "torch":
        import torch

        t = x.detach().movedim(axis, -1)
        if _small_int(t) and t.is_cuda:
            out = _launch_table_kernel("run_table_kernel", t.to(torch.int32).contiguous())
            if out is not None:
                return out.movedim(-2, axis).contiguous()
        t = t.to(torch.int64)
        n = t.shape[-1]
        idx = torch.arange(n, device=t.device).expand_as(t)
        change = t[..., 1:] != t[..., :-1]
        first = torch.cat([torch.ones_like(t[..., :1], dtype=torch.bool), change], dim=-1)
        last = torch.cat([change, torch.ones_like(t[..., :1], dtype=torch.bool)], dim=-1)
        lo = torch.where(first, idx, torch.zeros_like(idx)).cummax(dim=-1).values
        hi = torch.where(last, idx, torch.full_like(idx, n - 1)).flip(-1).cummin(dim=-1).values.flip(-1) + 1
        hi = torch.where(hi == n, torch.full_like(hi, RUN_END), hi)
        srt = torch.sort(t, dim=-1).values
        exact = (first.sum(-1) == 1 + (srt[..., 1:] != srt[..., :-1]).sum(-1))[..., None]
        out = torch.stack([torch.where(exact, lo, -1), torch.where(exact, hi, -1)], dim=-1)
        return out.movedim(-2, axis).to(torch.int32).contiguous()
    from numba import cuda

    host = np.asarray(x) if kind == "numpy" else cuda.as_cuda_array(x).copy_to_host()
    out = np.ascontiguousarray(run_table_host(host, axis))
    return out if kind == "numpy" else cuda.to_device(out)


RUN_THREADS = 128  # the run table kernel's block: a slice a block, a contiguous chunk of it a thread
RUN_VALUES = 2048  # runs a slice's values are listed for in shared memory (more: in a scratch array in global memory)

RUN_TABLE_SOURCE = f'''\
# The run table kernel of falower.backends.numba_cuda.block_data -- do not edit.
import numpy as np
from numba import cuda

from falower.backends.numba_cuda.intrinsics import kernel_jit

RUN_END = {RUN_END}
T = {RUN_THREADS}
RCAP = {RUN_VALUES}


@kernel_jit
def run_table_kernel(x, out, vg, n):
    \"\"\"Block s: slice x[s * n:(s + 1) * n] (int32) -> out[(s * n + i) * 2 + 0 / 1] = the first index of entry i's
    run and one past its last (RUN_END where the run ends the slice), or -1 / -1 across the slice where some value
    comes back after another. Thread t walks entries [t c, t c + c) (c = ceil(n / T)); what crosses the chunks
    (the last run start before a chunk, the first run end after it, where a chunk's runs go in the list of the
    slice's run values) thread 0 carries in T steps. A value comes back iff two runs have it: the runs' values,
    listed in shared memory (in vg, the slice's part of a scratch array as long as x, past RCAP runs), are compared
    in pairs by the whole block, each thread stopping once any has found one.\"\"\"
    t = cuda.threadIdx.x
    base = cuda.blockIdx.x * n
    cl = cuda.shared.array(T, np.int32)  # per chunk: its last run start (-1: none), then the carry into it
    ch = cuda.shared.array(T, np.int32)  # per chunk: its first run end (n + 1: none), then the carry into it
    cn = cuda.shared.array(T, np.int32)  # per chunk: its runs, then the place of its first in vals
    vals = cuda.shared.array(RCAP, np.int32)  # the slice's runs' values, in order
    seen = cuda.shared.array(4, np.int32)  # a run up, a run down, a value come back, the runs
    if t < 4:
        seen[t] = 0
    cuda.syncthreads()
    c = (n + T - 1) // T
    a = min(t * c, n)
    e = min(a + c, n)
    last = -1
    first = n + 1
    runs = 0
    for i in range(a, e):
        v = x[base + i]
        if i == 0 or x[base + i - 1] != v:
            last = i
            runs += 1
            if i > 0:
                if v > x[base + i - 1]:
                    seen[0] = 1
                else:
                    seen[1] = 1
        if first > n and (i == n - 1 or x[base + i + 1] != v):
            first = i + 1
    cl[t] = last
    ch[t] = first
    cn[t] = runs
    cuda.syncthreads()
    if t == 0:  # exclusive scans: the last start before chunk k, the first end after it, the runs before it
        run = -1
        total = 0
        for k in range(T):
            here = cl[k]
            cl[k] = run
            if here > run:
                run = here
            here = cn[k]
            cn[k] = total
            total += here
        seen[3] = total
        run = n + 1
        for k in range(T - 1, -1, -1):
            here = ch[k]
            ch[k] = run
            if here < run:
                run = here
    cuda.syncthreads()
    nr = seen[3]
    if seen[0] != 0 and seen[1] != 0:  # runs neither all up nor all down: does a value come back?
        big = nr > RCAP
        r = cn[t]
        for i in range(a, e):
            if i == 0 or x[base + i - 1] != x[base + i]:
                if big:
                    vg[base + r] = x[base + i]
                else:
                    vals[r] = x[base + i]
                r += 1
        cuda.syncthreads()
        for p in range(t, nr, T):
            v = vg[base + p] if big else vals[p]
            for q in range(p):
                if (vg[base + q] if big else vals[q]) == v:
                    seen[2] = 1
                    break
            if seen[2] != 0:  # (another thread's find ends this one's search too: only a 1 is ever written)
                break
        cuda.syncthreads()
    lo = cl[t]
    for i in range(a, e):
        if i == 0 or x[base + i - 1] != x[base + i]:
            lo = i
        out[(base + i) * 2] = lo
    hi = ch[t]
    for i in range(e - 1, a - 1, -1):
        if i == n - 1 or x[base + i + 1] != x[base + i]:
            hi = i + 1
        out[(base + i) * 2 + 1] = RUN_END if hi == n else hi
    if seen[2] != 0:
        for i in range(a, e):
            out[(base + i) * 2] = -1
            out[(base + i) * 2 + 1] = -1


@kernel_jit
def range_table_kernel(x, out, n, g, cells):
    """Thread r < cells: granule r % ng of slice r // ng of x (int32, slices n long, granules g long, the last
    short) -> out[r * 2 + 0 / 1] = its least and greatest entry."""
    r = cuda.blockIdx.x * T + cuda.threadIdx.x
    if r < cells:
        ng = (n + g - 1) // g
        s = r // ng
        a = s * n + (r - s * ng) * g
        e = min(a + g, s * n + n)
        lo = x[a]
        hi = lo
        for i in range(a + 1, e):
            v = x[i]
            lo = min(lo, v)
            hi = max(hi, v)
        out[r * 2] = lo
        out[r * 2 + 1] = hi
'''


_TABLE_KERNELS: dict = {}  # (kernel name, device index) -> runtime.DirectKernel of RUN_TABLE_SOURCE's


def _small_int(t: Any) -> bool:
    """A torch tensor of an integer type int32 holds exactly (the table kernels' input)."""
    import torch

    return t.dtype in (torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def _launch_table_kernel(name: str, t: Any, granule: int = 0) -> Any:
    """RUN_TABLE_SOURCE's kernel `name` over a contiguous int32 CUDA tensor along its last axis, launched as the
    attention kernels are (runtime.DirectKernel, on torch's current stream): the run table [*t.shape, 2]
    (run_table_kernel, a slice a block) or the range table [..., ceil(n / granule), 2] (range_table_kernel, a
    granule a thread), int32; None where direct launches are off. Why: torch's ops for the same tables (a sort,
    cumulative max and min, aminmax, ~30 ops) took 462 us of the host's time and 138 us of the GPU's for the run
    table of the document's ids at B = 4, N = 4k, and aminmax up to ~380 us of the host's a call (H200,
    probe_block_data.py), paid by every step whose ids are new."""
    import torch

    from .runtime import ArgBuffer, DirectKernel, _direct_enabled, _ident, _launcher, _raw_stream_getter, load_source

    if not _direct_enabled():
        return None
    n = int(t.shape[-1]) if t.dim() else 1
    slices = t.numel() // n if n else 0
    ng = -(-n // granule) if granule else 0
    shape = (*t.shape[:-1], ng) if granule else tuple(t.shape)
    out = torch.empty((*shape, 2), dtype=torch.int32, device=t.device)
    if not out.numel():
        return out
    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    kern = _TABLE_KERNELS.get((name, dev))
    if kern is None:
        def argtypes() -> tuple:
            from numba import types

            arr = types.Array(types.int32, 1, "C")
            return (arr, arr, types.int64, types.int64, types.int64) if granule else (arr, arr, arr, types.int64)

        kern = _TABLE_KERNELS[(name, dev)] = DirectKernel(
            lambda: getattr(load_source(RUN_TABLE_SOURCE, "run_table"), name), argtypes, 0,
            _ident(name, None, RUN_TABLE_SOURCE), device=dev)
    buf = ArgBuffer(kern.layout)
    buf.array(0, (t.numel(),), t.data_ptr())
    buf.array(1, (out.numel(),), out.data_ptr())
    if granule:
        cells = slices * ng
        buf.scalar(2, n)
        buf.scalar(3, granule)
        buf.scalar(4, cells)
        grid = (-(-cells // RUN_THREADS),)
    else:  # the run values' scratch (read only past RUN_VALUES runs a slice), kept alive to the launch below
        scratch = torch.empty(t.numel(), dtype=torch.int32, device=t.device)
        buf.array(2, (t.numel(),), scratch.data_ptr())
        buf.scalar(3, n)
        grid = (slices,)
    _launcher(kern.function(dev), grid, RUN_THREADS, 0, buf)(_raw_stream_getter()(dev))
    return out


def run_table_host(x: np.ndarray, axis: int) -> np.ndarray:
    """`run_table` in numpy (the reference its torch form is tested against)."""
    t = np.moveaxis(np.asarray(x).astype(np.int64), axis, -1)
    n = t.shape[-1]
    idx = np.broadcast_to(np.arange(n), t.shape)
    change = t[..., 1:] != t[..., :-1]
    first = np.concatenate([np.ones_like(t[..., :1], dtype=bool), change], axis=-1)
    last = np.concatenate([change, np.ones_like(t[..., :1], dtype=bool)], axis=-1)
    lo = np.maximum.accumulate(np.where(first, idx, 0), axis=-1)
    hi = np.flip(np.minimum.accumulate(np.flip(np.where(last, idx, n - 1), -1), axis=-1), -1) + 1
    hi = np.where(hi == n, RUN_END, hi)
    srt = np.sort(t, axis=-1)
    exact = (first.sum(-1) == 1 + (srt[..., 1:] != srt[..., :-1]).sum(-1))[..., None]
    out = np.stack([np.where(exact, lo, -1), np.where(exact, hi, -1)], axis=-1)
    return np.moveaxis(out, -2, axis).astype(np.int32)


def emit_block_list(spec: FA2ForwardSpec) -> str:
    """Source of the kernel `<name>_block_list(B, H, M, N, *captures)`: one thread per (b, h, q tile) row
    r = (b * H + h) * nq + qt writes kv_count[r] and the row's kv tiles to visit (block_mask == "list"),
    from `tile_class_fn` as the kernel's static scan would call it (rows q < M; columns up to N - 1, the
    kernel masking a ragged last tile itself). Launch with ceil(B * H * nq / 128) blocks of 128 threads."""
    from .emit_fa2 import _cap_args, _Code, _list_names, _module

    BQ, BK = spec.block_q, spec.block_k
    kc, kt = _list_names(spec)
    c = _Code()
    c("@kernel_jit")
    c(f"def {spec.name}_block_list(B, H, M, N{_cap_args(spec)}):")
    with c.indent():
        c('"""Per (b, h, q tile): how many kv tiles are not empty, and which (j * 2 + 1 if partial)."""')
        c(f"r = cuda.blockIdx.x * {THREADS} + cuda.threadIdx.x")
        c(f"nq = (M + {BQ - 1}) // {BQ}")
        c(f"nk = (N + {BK - 1}) // {BK}")
        c("if r < B * H * nq:")
        with c.indent():
            c("qt = r % nq")
            c("bh = r // nq")
            c("b = bh // H")
            c("h = bh - b * H")
            c(f"q_lo = qt * {BQ}")
            c(f"q_hi = min(q_lo + {BQ}, M) - 1")
            c("cnt = 0")
            c("for j in range(nk):")
            with c.indent():
                c(f"cls = tile_class_fn(b, h, q_lo, q_hi, j * {BK}, min(j * {BK} + {BK}, N) - 1{_cap_args(spec)})")
                c("if cls != 0:")
                with c.indent():
                    c(f"{kt}[r * nk + cnt] = j * 2 + (1 if cls == 1 else 0)")
                    c("cnt += 1")
            c(f"{kc}[r] = cnt")
    return _module(spec, c.text())


LIST_TAGS = ("kv_count", "kv_tiles", "q_count", "q_tiles")


def list_layout(spec: Any, sizes: tuple[int, int, int, int]) -> list[tuple[str, int]]:
    """(derived tag, length) of each block-list capture of `spec`, in the spec's order. The forward's and the
    backward's q-outer dQ kernel's: kv_count [B * H * nq], kv_tiles [B * H * nq * nk]; the backward's
    kv-outer kernel's: q_count [B * HK * nk], q_tiles [B * HK * nk * G * nq] (row r = (b * HK + hk) * nk + kj
    lists entries it * 2 + partial, it = i * nq + qt for query head hk * G + i of the kv head's group)."""
    B, H, M, N = sizes
    nq, nk = -(-M // spec.block_q), -(-N // spec.block_k)
    G = spec.group_size
    length = {"kv_count": B * H * nq, "kv_tiles": B * H * nq * nk, "q_count": B * (H // G) * nk,
              "q_tiles": B * (H // G) * nk * G * nq}
    out = [(c.derived[0], length[c.derived[0]]) for c in spec.captures if c.derived[:1] and c.derived[0] in LIST_TAGS]
    if any(n >= LIST_LIMIT for _, n in out):  # the kernels walk a list by 32-bit positions (emit_fa2._emit_list_ahead)
        raise ValueError(f"block list of B={B}, H={H}, M={M}, N={N} at {spec.block_q} x {spec.block_k} tiles has "
                         f"{max(n for _, n in out)} entries, over the kernels' 32-bit positions ({LIST_LIMIT - 1}): "
                         "split the batch")
    return out


LIST_LIMIT = 1 << 31  # a block list's entries, addressed by int32 in the kernels


def list_rows(spec: Any, sizes: tuple[int, int, int, int]) -> int:
    """Threads of the list kernel: one per list row (the backward's kv-outer rows, then its q-outer rows)."""
    B, H, M, N = sizes
    nq, nk = -(-M // spec.block_q), -(-N // spec.block_k)
    tags = {t for t, _ in list_layout(spec, sizes)}
    return (B * (H // spec.group_size) * nk if "q_count" in tags else 0) + (B * H * nq if "kv_count" in tags else 0)


def bwd_list_source(spec: Any) -> str:
    """The backward list kernel's work for one row, as a plain `def bwd_list_row(r, B, H, M, N, *captures)`
    (the list captures are its outputs): the kernel runs it on the device, `host_block_lists` in Python, the
    same text. Rows r < B * HK * nk: kv tile kj of (b, kv head hk), its (head, q tile) pairs `it` in the
    kv-outer kernel's order, classed by tile_class_fn exactly as that kernel's scan classes them
    (emit_fa2_bwd._class_expr); then (dQ q-outer kernel) rows (b * H + h) * nq + qt, kv tiles classed by
    tile_class_q_fn as emit_fa2_bwd._dq_class_expr does."""
    from .emit_fa2_bwd import _cap_args, _cap_names

    BQ, BK, G = spec.block_q, spec.block_k, spec.group_size
    arg = {c.derived[0]: n for c, n in zip(spec.captures, _cap_names(spec)) if c.derived[:1] and c.derived[0] in LIST_TAGS}
    caps = _cap_args(spec)
    out = [f"def bwd_list_row(r, B, H, M, N{caps}):",
           f"    nq = (M + {BQ - 1}) // {BQ}",
           f"    nk = (N + {BK - 1}) // {BK}",
           f"    HK = H // {G}",
           f"    total = nq * {G}",
           "    rows_kv = B * HK * nk" if "q_count" in arg else "    rows_kv = 0"]
    if "q_count" in arg:
        out += ["    if r < rows_kv:",
                "        kj = r % nk",
                "        bh = r // nk",
                "        b = bh // HK",
                "        hk = bh - b * HK",
                f"        kv0 = kj * {BK}",
                "        cnt = 0",
                "        for it in range(total):",
                f"            h = hk * {G} + it // nq",
                "            qt = it % nq",
                f"            cls = tile_class_fn(b, h, qt * {BQ}, qt * {BQ} + {BQ - 1}, kv0, kv0 + {BK - 1}{caps})",
                "            if cls != 0:",
                f"                {arg['q_tiles']}[r * total + cnt] = it * 2 + (1 if cls == 1 else 0)",
                "                cnt += 1",
                f"        {arg['q_count']}[r] = cnt"]
    if "kv_count" in arg:
        out += ["    r2 = r - rows_kv",
                "    if r2 >= 0 and r2 < B * H * nq:",
                "        qt = r2 % nq",
                "        bh = r2 // nq",
                "        b = bh // H",
                "        h = bh - b * H",
                f"        q0 = qt * {BQ}",
                "        cnt = 0",
                "        for j in range(nk):",
                f"            cls = tile_class_q_fn(b, h, q0, q0 + {BQ - 1}, j * {BK}, j * {BK} + {BK - 1}{caps})",
                "            if cls != 0:",
                f"                {arg['kv_tiles']}[r2 * nk + cnt] = j * 2 + (1 if cls == 1 else 0)",
                "                cnt += 1",
                f"        {arg['kv_count']}[r2] = cnt"]
    return "\n".join(out) + "\n"


def emit_bwd_block_list(spec: Any) -> str:
    """Source of the kernel `<name>_block_list(B, H, M, N, *captures)` of a backward spec with block_mask ==
    "list": one thread per list row (`bwd_list_row`). Launch with ceil(list_rows / 128) blocks of 128."""
    from .emit_fa2 import _Code
    from .emit_fa2_bwd import _cap_args, _module

    c = _Code()
    c("@device_function")
    for line in bwd_list_source(spec).splitlines():
        c(line)
    c()
    c("@kernel_jit")
    c(f"def {spec.name}_block_list(B, H, M, N{_cap_args(spec)}):")
    with c.indent():
        c('"""Per kv tile: the (head, q tile) pairs to visit; per q tile (dQ kernel): the kv tiles."""')
        c(f"bwd_list_row(cuda.blockIdx.x * {THREADS} + cuda.threadIdx.x, B, H, M, N{_cap_args(spec)})")
    return _module(spec, c.text())


def host_block_lists(spec: Any, caps: list, sizes: tuple[int, int, int, int]) -> list[np.ndarray]:
    """The backward's block lists made on the host by the list kernel's own row code, run as Python over
    numpy arrays (`caps`: the caller's captures, the sizes and the range tables): for tests without a GPU."""
    ns: dict = {"math": math, "np": np}
    exec(compile(spec.device_source + "\n" + bwd_list_source(spec), "<bwd_list>", "exec"), ns)  # noqa: S102
    outs = [np.full(n, -1, dtype=np.int32) for _, n in list_layout(spec, sizes)]
    row = ns["bwd_list_row"]
    for r in range(list_rows(spec, sizes)):
        row(r, *sizes, *caps, *outs)
    return outs


class BlockData:
    """The derived captures of one kernel's spec, made per call and remembered with their data."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.first = caller_count(spec)
        self._list_kernel: Any = None
        self._list_direct: Any = None  # the list kernel for direct launches (runtime.DirectKernel), made on first use
        self._memo = _Memo()

    @property
    def _cache(self) -> dict:  # what is remembered, by key (tests look)
        return self._memo._cache

    def derive(self, caps: list, sizes: tuple[int, int, int, int], like: Any) -> list:
        """The derived captures for these caller captures (tensors and sizes) and (B, H, M, N). While torch's
        stream captures a CUDA graph they are made in the graph (its kernels and memory) and not remembered: a
        graph replays on whatever its captured tensors hold then (updated in place), and what was remembered was
        made from their data at some earlier call."""
        caps = list(caps[:self.first])
        if _capturing(like):
            return self._make(caps, sizes, like)
        key = data_key(caps, sizes)
        out = self._memo.get(key, caps)
        if out is None:
            out = self._make(caps, sizes, like)
            self._memo.put(key, caps, out)
        return out

    # ------------------------------------------------------------------------------------ making
    def _make(self, caps: list, sizes: tuple[int, int, int, int], like: Any) -> list:
        spec = self.spec
        out: list = []
        for c in spec.captures[self.first:]:
            if c.derived[0] == "ranges":
                _, i, axis, g = c.derived
                out.append(range_table(caps[i], axis, g, c.dtype))
            elif c.derived[0] == "runs":
                _, i, axis = c.derived
                out.append(run_table(caps[i], axis))
        if list_layout(spec, sizes):
            out += self._block_list(caps + out, sizes, like)
        return out

    def _block_list(self, caps: list, sizes: tuple[int, int, int, int], like: Any) -> list:
        spec = self.spec
        B, H, M, N = sizes
        layout = list_layout(spec, sizes)
        rows = list_rows(spec, sizes)
        kind = _kind(like)
        if kind == "torch":
            import torch

            lists = [torch.empty(n, dtype=torch.int32, device=like.device) for _, n in layout]
            if not rows or self._launch_direct(caps, lists, sizes, rows, like):
                return lists
        from numba import cuda  # Numba's dispatcher: numpy, other CUDA arrays, the simulator

        from .runtime import _one_element_captures, load_source

        if self._list_kernel is None:
            mod = load_source(self._list_source(), spec.name + "_block_list")
            self._list_kernel = getattr(mod, spec.name + "_block_list")
        n_caller = len(caps)
        if kind == "torch":
            stream = torch.cuda.current_stream(like.device).cuda_stream
            launch_stream = cuda.external_stream(stream) if stream else 0
            # no synchronisation: the launch goes on torch's current stream, behind whatever made the tensors
            args = [cuda.as_cuda_array(x, sync=False) if _kind(x) == "torch" else x
                    for x in _one_element_captures(spec, tuple(caps), "torch", like)]
        else:
            lists = [cuda.device_array(n, dtype=np.int32) for _, n in layout]
            launch_stream = 0
            args = [cuda.to_device(x) if isinstance(x, np.ndarray) else x
                    for x in _one_element_captures(spec, tuple(caps), kind, like)]
        wrap = (lambda t: cuda.as_cuda_array(t, sync=False)) if kind == "torch" else (lambda t: t)
        args = args[:n_caller] + [wrap(x) for x in lists]
        if rows:
            self._list_kernel[-(-rows // THREADS), THREADS, launch_stream](B, H, M, N, *args)
        if kind == "numpy":
            return [x.copy_to_host() for x in lists]
        return lists

    def _list_source(self) -> str:
        from .spec import FA2BackwardSpec

        return (emit_bwd_block_list if isinstance(self.spec, FA2BackwardSpec) else emit_block_list)(self.spec)

    def _launch_direct(self, caps: list, lists: list, sizes: tuple[int, int, int, int], rows: int, like: Any) -> bool:
        """Launch the list kernel as the attention kernels are (runtime.DirectKernel: the driver's cuLaunchKernel
        from an argument buffer on torch's current stream) and return True; False where those launches are off or
        a capture is not a contiguous tensor of the kernel's dtype on `like`'s device (Numba's dispatcher then
        launches it). Why: the dispatcher took 258-306 us of the host's time a launch (H200, probe_block_data.py),
        a new batch's document ids paying it for the forward's list and the backward's."""
        import torch

        from .runtime import (ArgBuffer, DirectKernel, _cap_shape, _capture_types, _captures_fit, _direct_enabled,
                              _ident, _launcher, _raw_stream_getter, load_source)

        spec = self.spec
        if not _direct_enabled() or not _captures_fit(spec, (*caps, *lists)):
            return False
        if any(x.device != like.device for x in (*caps, *lists) if hasattr(x, "device")):
            return False
        dev = like.device.index if like.device.index is not None else torch.cuda.current_device()
        if self._list_direct is None:
            source, name = self._list_source(), spec.name + "_block_list"

            def argtypes() -> tuple:
                from numba import types

                return (types.int64,) * 4 + tuple(_capture_types(spec))

            self._list_direct = DirectKernel(lambda: getattr(load_source(source, name), name), argtypes, 0,
                                             _ident("block_list", spec, source), device=dev)
        kern = self._list_direct
        buf = ArgBuffer(kern.layout)
        for i, n in enumerate(sizes):
            buf.scalar(i, int(n))
        for i, x in enumerate((*caps, *lists), start=4):
            if kern.layout.ndim[i] >= 0:
                buf.array(i, _cap_shape(x), x.data_ptr())
            else:
                buf.scalar(i, x)
        _launcher(kern.function(dev), (-(-rows // THREADS),), THREADS, 0, buf)(
            _raw_stream_getter()(dev))
        return True

    def lists(self, caps: list, sizes: tuple[int, int, int, int], like: Any) -> dict[str, np.ndarray]:
        """The block lists by derived tag (flat, list_layout's lengths), on the host: for tests and looking."""
        out = self.derive(caps, sizes, like)
        layout = list_layout(self.spec, sizes)
        host = [x.cpu().numpy() if _kind(x) == "torch" else np.asarray(x) if _kind(x) == "numpy"
                else x.copy_to_host() for x in out[len(out) - len(layout):]]
        return {tag: h for (tag, _), h in zip(layout, host)}

    def block_list(self, caps: list, sizes: tuple[int, int, int, int], like: Any) -> tuple[np.ndarray, np.ndarray]:
        """(kv_count [B, H, nq], kv_tiles [B, H, nq, nk]) on the host, for tests and for looking."""
        got = self.lists(caps, sizes, like)
        B, H, M, N = sizes
        nq, nk = -(-M // self.spec.block_q), -(-N // self.spec.block_k)
        return got["kv_count"].reshape(B, H, nq), got["kv_tiles"].reshape(B, H, nq, nk)
