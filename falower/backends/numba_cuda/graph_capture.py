"""Writes that a captured launch needs done once, made while a CUDA graph captures but outside the graph.

A call captured into a CUDA graph gets state of its own that the graph keeps: the work counter of a kernel that
takes its items from one, split-kv's arrival counts, the tensor maps of tensors first seen while capturing. Made
with torch or put_map on the capturing stream, each such write became a node of the graph, run on every replay: a
zeroing kernel for each counter, a put kernel for each map, each a kernel boundary (about a microsecond a node on
an H200) in front of a decoding call whose kernel takes a few. Each needs writing once only (the kernels leave the
work counter zeroed and the arrival counts a multiple of the parts, which the merge reads mod P; a map never
changes), so it is written here, at capture time, on a side stream outside the capture, and waited for before the
capture goes on.

The memory is this module's own (cuMemAlloc), never the capture's pool: a block torch hands out while capturing may
be one an earlier node of the same graph (or of a graph sharing its pool) writes on every replay, which is safe for
what the graph itself produces but would overwrite zeros or a map written once. Counters are slices of a bank of
zeros (one allocation, one write and one wait a bank), maps slots of a bank of 128-byte slots; both live as long as
the process, as the graphs that read them may.

The side stream's writes are "potentially unsafe" calls under the global capture mode torch captures in; the
thread's mode is relaxed around them (cuThreadExchangeStreamCaptureMode, as torch's allocator does around its
cudaMalloc while capturing)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

_RELAXED = 2  # CUstreamCaptureMode: CU_STREAM_CAPTURE_MODE_RELAXED
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit order with the legacy default stream
_LIB: list = []  # [the entry points, as a dict] or [None], looked up once
_LOCK = threading.RLock()  # captures on two threads at once must not share a slice
_SIDE: dict = {}  # torch device index -> the side stream's handle: made by the driver, not taken from torch's pool
# of streams (which hands its streams out in turn: a caller's capture stream could be the side stream)
BANK_WORDS = 1 << 16  # int32 zeros a counter bank holds
SLICE_WORDS = 32  # a counter's slice of a bank starts on its own 128 bytes
MAP_SLOTS = 1024  # 128-byte tensor-map slots a map bank holds
MAP_WORDS = 32  # a slot's 32-bit words (a CUtensorMap's 128 bytes, 128-byte aligned)
_BANKS: dict = {}  # ("words" or "maps", torch device index) -> [the bank's address, words handed out]


class CaptureWriteError(RuntimeError):
    """A write outside the capture failed (a CUresult from the driver)."""


class DeviceWords:
    """`n` 32-bit words of device memory this module allocated, at `ptr`: what a launch reads as an array argument
    (its address, `data_ptr()`, as a torch tensor's)."""

    __slots__ = ("ptr", "n")

    def __init__(self, ptr: int, n: int) -> None:
        self.ptr, self.n = ptr, n

    def data_ptr(self) -> int:
        return self.ptr


def _lib() -> Any:
    """The driver entry points the writes take, by short name (cubin_cache.libcuda_function's)."""
    if not _LIB:
        from .cubin_cache import libcuda_function

        c, ptr = ctypes, ctypes.c_void_p
        fns = {"mode": libcuda_function("cuThreadExchangeStreamCaptureMode", [c.POINTER(c.c_int)]),
               "memset": libcuda_function("cuMemsetD32Async", [c.c_uint64, c.c_uint, c.c_size_t, ptr]),
               "sync": libcuda_function("cuStreamSynchronize", [ptr]),
               "stream": libcuda_function("cuStreamCreate", [c.POINTER(ptr), c.c_uint]),
               "alloc": libcuda_function("cuMemAlloc_v2", [c.POINTER(c.c_uint64), c.c_size_t])}
        _LIB.append(None if None in fns.values() else fns)
    if _LIB[0] is None:
        raise CaptureWriteError("no libcuda to write outside a CUDA graph's capture with")
    return _LIB[0]


def _check(err: int, what: str) -> None:
    if err:
        raise CaptureWriteError(f"{what} outside a CUDA graph's capture: CUresult {err}")


def device_index(device: Any) -> int:
    """The torch device index of `device` (a torch.device or its string; "cuda": the current device)."""
    import torch

    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _context(index: int) -> Any:
    """Device `index`'s primary context current for a block (cubin_cache's driver: what torch and the kernels use)."""
    from . import cubin_cache

    drv = cubin_cache.driver()
    if drv is None:
        raise CaptureWriteError("no libcuda to write outside a CUDA graph's capture with")
    return drv.current(index)


def _relaxed(index: int, work: Callable[[], Any]) -> Any:
    """`work()` with the calling thread's capture mode relaxed and device `index`'s primary context current."""
    fns = _lib()
    mode = ctypes.c_int(_RELAXED)
    _check(fns["mode"](ctypes.byref(mode)), "relaxing the capture mode")
    try:
        with _context(index):
            result = work()
    finally:  # (the mode restored whatever happened; its own failure reported only if nothing else was)
        err = fns["mode"](ctypes.byref(mode))
    _check(err, "restoring the capture mode")
    return result


def outside_capture(index: int, enqueue: Callable[[int], None]) -> None:
    """Run `enqueue(stream)` (it enqueues work on the raw stream handle it is given) on a side stream of torch device
    `index`, outside any capture, and wait for it."""
    fns = _lib()

    def run() -> None:
        with _LOCK:
            side = _SIDE.get(index)
            if side is None:
                handle = ctypes.c_void_p()
                _check(fns["stream"](ctypes.byref(handle), _NON_BLOCKING), "making a side stream")
                side = _SIDE[index] = handle.value
        enqueue(side)
        _check(fns["sync"](side), "waiting for the writes")

    _relaxed(index, run)


def _alloc(index: int, words: int) -> int:
    """The address of `words` 32-bit words of device `index`'s memory, this module's for good (cuMemAlloc)."""
    fns = _lib()
    ptr = ctypes.c_uint64()
    _relaxed(index, lambda: _check(fns["alloc"](ctypes.byref(ptr), 4 * words), "allocating"))
    return ptr.value


def _zero(index: int, ptr: int, words: int) -> None:
    fns = _lib()
    outside_capture(index, lambda stream: _check(fns["memset"](ptr, 0, words, stream), "zeroing"))


def _slice(kind: str, index: int, words: int, bank_words: int, step: int) -> DeviceWords:
    """The next `words` of device `index`'s bank of `kind` (a new bank, zeroed for "words", when it is full), the
    bank then moved on by `words` rounded up to `step`."""
    with _LOCK:
        bank = _BANKS.get((kind, index))
        if bank is None or bank[1] + words > bank_words:
            ptr = _alloc(index, bank_words)
            if kind == "words":
                _zero(index, ptr, bank_words)
            bank = _BANKS[(kind, index)] = [ptr, 0]
        out = DeviceWords(bank[0] + 4 * bank[1], words)
        bank[1] += -(-words // step) * step
        return out


def zeroed_int32(n: int, device: Any) -> DeviceWords:
    """`n` int32 zeros for a launch being captured, written outside the graph and never handed out again: a slice of
    a bank of BANK_WORDS zeros, or where n is more than a quarter of a bank, zeros of their own."""
    if n < 1:
        raise ValueError(f"zeroed_int32 needs at least one word, got {n}")
    index = device_index(device)
    if n > BANK_WORDS // 4:
        ptr = _alloc(index, n)
        _zero(index, ptr, n)
        return DeviceWords(ptr, n)
    return _slice("words", index, n, BANK_WORDS, SLICE_WORDS)


def map_slot(device: Any) -> DeviceWords:
    """128 bytes for a tensor map made while capturing (its caller writes it by outside_capture), never handed out
    again."""
    return _slice("maps", device_index(device), MAP_WORDS, MAP_SLOTS * MAP_WORDS, MAP_WORDS)
