"""Writes that a captured launch needs done once, made while a CUDA graph captures but outside the graph.

A call captured into a CUDA graph gets state of its own that the graph keeps: the work counter of a kernel that
takes its items from one, split-kv's arrival counts, the tensor maps of tensors first seen while capturing. Made
with torch or put_map on the capturing stream, each such write became a node of the graph, run on every replay: a
zeroing kernel for each counter, a put kernel for each map, each a kernel boundary (about a microsecond a node on
an H200) in front of a decoding call whose kernel takes a few. Each needs writing once only (the kernels leave the
counters zeroed; a map never changes), so it is written here, at capture time, on a side stream outside the
capture, and waited for before the capture goes on; counters come as slices of a bank of zeros written once.

The side stream's writes are "potentially unsafe" calls under the global capture mode torch captures in; the
thread's mode is relaxed around them (cuThreadExchangeStreamCaptureMode, as torch's allocator does around its
cudaMalloc while capturing)."""

from __future__ import annotations

import ctypes
from typing import Any, Callable

_RELAXED = 2  # CUstreamCaptureMode: CU_STREAM_CAPTURE_MODE_RELAXED
_LIB: list = []  # [libcuda's functions, as a dict] or [None], looked up once
_SIDE: dict = {}  # torch device index -> the side stream's handle: made by the driver, not taken from torch's pool
# of streams (which hands its streams out in turn: a caller's capture stream could be the side stream)
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit order with the legacy default stream


class CaptureWriteError(RuntimeError):
    """A write outside the capture failed (a CUresult from the driver)."""


def _lib() -> Any:
    if not _LIB:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fns = {"mode": lib.cuThreadExchangeStreamCaptureMode, "memset": lib.cuMemsetD32Async,
                   "sync": lib.cuStreamSynchronize, "stream": lib.cuStreamCreate}
            fns["mode"].argtypes = [ctypes.POINTER(ctypes.c_int)]
            fns["memset"].argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
            fns["sync"].argtypes = [ctypes.c_void_p]
            fns["stream"].argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            for f in fns.values():
                f.restype = ctypes.c_int
            _LIB.append(fns)
        except (OSError, AttributeError):
            _LIB.append(None)
    return _LIB[0]


def _check(err: int, what: str) -> None:
    if err:
        raise CaptureWriteError(f"{what} outside a CUDA graph's capture: CUresult {err}")


def outside_capture(device: Any, enqueue: Callable[[int], None]) -> None:
    """Run `enqueue(stream)` (it enqueues work on the raw stream handle it is given) on a side stream of torch device
    `device`, outside any capture, and wait for it; the calling thread's capture mode is relaxed meanwhile."""
    import torch

    fns = _lib()
    if fns is None:
        raise CaptureWriteError("no libcuda to write outside a CUDA graph's capture with")
    index = device.index if device.index is not None else torch.cuda.current_device()
    mode = ctypes.c_int(_RELAXED)
    _check(fns["mode"](ctypes.byref(mode)), "relaxing the capture mode")
    try:
        with torch.cuda.device(index):  # the device's context current for the driver's calls
            side = _SIDE.get(index)
            if side is None:
                handle = ctypes.c_void_p()
                _check(fns["stream"](ctypes.byref(handle), _NON_BLOCKING), "making a side stream")
                side = _SIDE[index] = handle.value
            enqueue(side)
            _check(fns["sync"](side), "waiting for the writes")
    finally:
        _check(fns["mode"](ctypes.byref(mode)), "restoring the capture mode")


def _zeroed_now(n: int, device: Any) -> Any:
    """n int32 zeros from the capture's memory (torch.empty adds no node), zeroed outside the graph now."""
    import torch

    buf = torch.empty(n, dtype=torch.int32, device=device)
    fns = _lib()
    outside_capture(buf.device, lambda stream: _check(fns["memset"](buf.data_ptr(), 0, n, stream), "zeroing"))
    return buf


BANK_WORDS = 1 << 16  # int32 zeros a bank holds: one write outside the capture serves this many counters
SLICE_WORDS = 32  # a counter's slice of a bank starts on its own 128 bytes
_BANKS: dict = {}  # torch device index -> [the bank, words handed out]


def zeroed_int32(n: int, device: Any) -> Any:
    """A torch int32 tensor of `n` zeros for a launch being captured, zeroed outside the graph, never handed out
    again: a slice of a bank of BANK_WORDS zeros (made and zeroed once, then sliced: the wait for the write outside
    the capture is paid once a bank, not once a captured call; each slice's storage is the bank, kept alive by the
    slices), or where n is more than a quarter of a bank, its own."""
    import torch

    if n > BANK_WORDS // 4:
        return _zeroed_now(n, device)
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    bank = _BANKS.get(index)
    if bank is None or bank[1] + n > BANK_WORDS:
        bank = _BANKS[index] = [_zeroed_now(BANK_WORDS, torch.device("cuda", index)), 0]
    out = bank[0][bank[1]:bank[1] + n]
    bank[1] += -(-n // SLICE_WORDS) * SLICE_WORDS
    return out
