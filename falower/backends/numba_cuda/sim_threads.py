"""The CUDA simulator's barriers, woken one thread at a time: a warp's (intrinsics' exchanges) and a block's
(`syncthreads`). Pure threading; intrinsics installs them when the simulator is on.

threading.Barrier's notify_all wakes all 32 lanes of a warp to fight for one condition, and numba-cuda's simulator
(0.30) releases a `syncthreads` from a manager thread that polls the block's 128-384 threads' flags for as long as
the block runs, holding the GIL a switch interval at a time while the threads it waits for need it. Here the last
thread to arrive opens the barrier itself, and the manager sleeps until the block is done (the simulator suites
run 2.2x faster: bwd_sim_cases.py 256 -> 116 s, a wgmma forward case 24 -> 11 s). The semantics are the
simulator's: a barrier waits for the block's live threads (a thread that has returned no longer counts), and a
thread's exception aborts the others at their next barrier and is raised by the launch.

`install_block_manager()` patches `BlockManager.run`, `BlockThread.run` and `BlockThread.syncthreads` of the
pinned numba-cuda (pyproject's extras); on another version, whose internals may differ, it leaves the simulator's
own manager (correct, about half as fast on the simulator suites) and says so once.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

PINNED = "0.30.4"


class HandOverLock:
    """A one-shot gate: closed when made, opened once by `open()`; every `pass_through()` then returns. Waiters
    wake one after another (each wakes the next by releasing the lock it just took), so opening the gate costs
    one wake-up per waiter, where threading.Barrier's notify_all wakes them all to fight for its condition."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def open(self) -> None:
        self._lock.release()

    def pass_through(self) -> None:
        self._lock.acquire()
        self._lock.release()


class HandOverBarrier:
    """A barrier whose waiters wake one after another (HandOverLock). For a block, `leave()` takes a party out (a
    thread that returned) and opens the barrier if everyone left is already waiting; `abort()` opens it for good,
    and every waiter raises."""

    def __init__(self, parties: int) -> None:
        self._mu = threading.Lock()
        self._live = parties
        self._arrived = 0
        self._gate = HandOverLock()
        self.aborted = False

    def _open(self) -> None:  # under _mu
        gate, self._gate, self._arrived = self._gate, HandOverLock(), 0
        gate.open()

    def wait(self) -> None:
        with self._mu:
            if self.aborted:
                raise RuntimeError("abort flag set on syncthreads call")
            gate = self._gate
            self._arrived += 1
            if self._arrived == self._live:
                self._open()
                return
        gate.pass_through()
        if self.aborted:
            raise RuntimeError("abort flag set on syncthreads clear")

    def leave(self) -> int:
        """Take a party out; the parties left."""
        with self._mu:
            self._live -= 1
            if self._arrived and self._arrived == self._live:
                self._open()
            return self._live

    def abort(self) -> None:
        with self._mu:
            self.aborted = True
            self._open()


def _run_block(self, grid_point, *args):
    """BlockManager.run: start the block's threads, sleep until they have all returned (or one raised), raise
    the first exception."""
    from numba.cuda.simulator.kernel import BlockThread

    n = int(np.prod(self._block_dim))
    barrier = HandOverBarrier(n)
    done = threading.Event()
    first: list = []  # the thread whose exception aborted the block (appended before it aborts the others)
    threads = []

    def target():
        try:
            self._f(*args)
            for check in getattr(threading.current_thread(), "_falower_exit_checks", ()):
                check(threading.current_thread())  # what a thread must not leave behind (intrinsics' bulk copies)
        except BaseException:
            first.append(threading.current_thread())
            barrier.abort()  # the others raise at their barriers: the launch reports this thread's exception
            raise
        finally:
            if barrier.leave() == 0:
                done.set()

    self._falower_barrier = barrier
    for block_point in np.ndindex(*self._block_dim):
        t = BlockThread(target, self, grid_point, block_point, self._debug)
        t._falower_done = done  # set by _thread_run on an exception: the launch raises it without waiting
        threads.append(t)
    for t in threads:
        t.start()
    done.wait()
    if first:
        first[0].join()  # raising: its exception is stored as it returns
        threads = [first[0]]
    for t in threads:
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])


def _syncthreads(self):
    self._manager._falower_barrier.wait()


def _thread_run(self):
    """BlockThread.run: the exception stored as numba's stores it, and the launch woken at once (the other threads
    may be stuck in a warp's exchange and never return: numba's manager raised without joining them too)."""
    try:
        threading.Thread.run(self)
    except Exception as e:
        tid = "tid=%s" % list(self.threadIdx)
        ctaid = "ctaid=%s" % list(self.blockIdx)
        msg = "%s %s" % (tid, ctaid) if str(e) == "" else "%s %s: %s" % (tid, ctaid, e)
        self.exception = (type(e)(msg), sys.exc_info()[2])
        self._falower_done.set()


def install_block_manager() -> bool:
    """Patch the simulator's block manager (numba-cuda PINNED only); True if it did."""
    try:
        from importlib.metadata import version

        from numba.cuda.simulator import kernel as simk
    except Exception:  # noqa: BLE001 - no simulator: nothing to patch
        return False
    if version("numba-cuda") != PINNED:
        print(f"falower: numba-cuda {version('numba-cuda')} is not {PINNED}: the simulator keeps its own block "
              "manager (slower)", file=sys.stderr)
        return False
    simk.BlockManager.run = _run_block
    simk.BlockThread.syncthreads = _syncthreads
    simk.BlockThread.run = _thread_run
    if not getattr(simk.FakeCUDAKernel.__call__, "_falower", False):
        simk.FakeCUDAKernel.__call__ = _kernel_call(simk.FakeCUDAKernel.__call__)
    return True


_LAUNCHED: dict[int, int] = {}  # id(module globals) of the kernels being launched -> launches under way


def _kernel_call(original):
    """FakeCUDAKernel.__call__ that calls a device function of the launched kernel's own module directly. The
    simulator enters `swapped_cuda_module` on every device call, which takes two locks twice (a global one and
    the module's): a block's 128-384 threads calling device functions queue on those locks (py-spy found them at
    the top of a wgmma backward case; unprofiled, skipping them alone took that case from 11.2 to 10.8 s). The launch
    holds the swap of its kernel's module for its whole run, so a device function whose globals are that
    module's needs none of its own, nor does one whose module holds no numba.cuda to swap (falower's wgmma
    helpers); others take the simulator's path."""
    from numba import cuda
    from numba.cuda.simulator import kernel as simk

    def call(self, *args):
        if self._device or simk._kernel_context:
            globs = self.fn.__globals__
            bare = self.__dict__.get("_falower_bare")
            if bare is None:  # whether its module holds no numba.cuda (asked once a device function)
                bare = self._falower_bare = not any(v is cuda for v in list(globs.values()))
            if bare or _LAUNCHED.get(id(globs)):
                return self.fn(*args)
            return original(self, *args)
        key = id(self.fn.__globals__)
        _LAUNCHED[key] = _LAUNCHED.get(key, 0) + 1  # launches are made from one host thread
        try:
            return original(self, *args)
        finally:
            _LAUNCHED[key] -= 1
            if not _LAUNCHED[key]:
                del _LAUNCHED[key]

    call._falower = True
    return call
