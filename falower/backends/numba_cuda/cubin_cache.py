"""falower's own cache of compiled kernels, loaded with the CUDA driver without importing Numba.

A warm process spent most of its first call importing `numba.cuda` (~0.5 s on the H100 host) and letting
Numba load its disk cache (~0.4 s), only to hand the direct launcher a CUfunction. What the launcher needs
is small: the cubin, the kernel's entry symbol, the layout of its parameters in Numba's kernel ABI and its
dynamic shared memory. After Numba compiles a kernel, those are stored here (`store`); a new process finds
them (`load`) and loads the cubin itself (`Driver.load_function`: cuModuleLoadData / cuModuleGetFunction
through ctypes, in the device's primary context, torch's and Numba's).

Location: `<cache dir>/cubin/<key>.bin` (the cache dir is `FALOWER_CACHE_DIR`, default
`~/.cache/falower/kernels`). `FALOWER_CUBIN_CACHE=0` turns the cache off (every process compiles or loads
through Numba, as before).

Invalidation: the key (`cache_key`) hashes what identifies the kernel (its role, its spec, its emitted
source and a hash of the backend's own files, argument types included), the device's compute capability
and the toolchain (`toolchain`: the versions of numba-cuda, numba and llvmlite read from their package
files without importing them, and the NUMBA_* / CUDA_HOME environment). Anything else that changes lands
on a new key; stale entries are never read, only left behind (delete the directory to clear it).

Integrity: a file is written to a temporary name and renamed into place (concurrent writers race to the
same content; a reader never sees half a file). A file that does not parse, names another key, or whose
cubin does not match its checksum is treated as absent (the caller compiles and overwrites it); a cubin
the driver refuses is dropped by the caller the same way (`runtime.DirectKernel`).

Everything here but `Driver` is plain Python and tested on a CPU; tests swap the driver (`set_driver`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

__all__ = ["Driver", "KernelImage", "cache_key", "driver", "enabled", "load", "set_driver", "store", "toolchain"]

MAGIC = b"FALOWER-CUBIN-1\n"
_HEADER = struct.Struct("<I")  # length of the JSON header that follows MAGIC


@dataclass(frozen=True)
class KernelImage:
    """What a direct launch needs of one compiled kernel: the cubin, its entry symbol, the parameter layout
    (`runtime.ArgLayout.describe()`: one (kind, ndim, itemsize) per argument) and its dynamic shared memory.
    `cubin` is what cuModuleLoadData takes: a cubin, or null-terminated PTX that the driver compiles as a whole
    program when it loads it (`runtime.whole_program_ptx`: kernels with setmaxnreg)."""

    name: str
    cubin: bytes
    layout: tuple[tuple[str, int, int], ...]
    smem: int


def cubin_bytes(obj: Any) -> bytes:
    """The bytes of a linked cubin as numba-cuda hands it over: bytes, or (when it links through cuda.core, as
    on the H100 machine) an ObjectCode whose `code` is the bytes or the path of a file holding them."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj)
    code = getattr(obj, "code", None)
    if isinstance(code, (bytes, bytearray, memoryview)):
        return bytes(code)
    if isinstance(code, str) and os.path.isfile(code):
        return Path(code).read_bytes()
    raise TypeError(f"cannot read a cubin out of {type(obj).__name__}")


def enabled() -> bool:
    return os.environ.get("FALOWER_CUBIN_CACHE", "1") != "0"


def directory() -> Path:
    from .runtime import cache_dir

    return cache_dir() / "cubin"


# --------------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------------
_TOOLCHAIN: list[str] = []
_VERSION_FILES = (("numba_cuda", "VERSION"), ("numba", "_version.py"), ("llvmlite", "_version.py"))


def toolchain() -> str:
    """A fingerprint of what compiles the kernels, computed without importing it: where numba-cuda, numba
    and llvmlite are installed and their version files (which name the version and, for numba and llvmlite,
    the commit), and the environment variables that steer Numba's code generation. Read once a process."""
    if not _TOOLCHAIN:
        h = hashlib.sha256()
        for package, filename in _VERSION_FILES:
            spec = importlib.util.find_spec(package)  # finds the package, does not run it
            origin = spec.origin if spec is not None else None
            h.update(f"{package}:{origin}\n".encode())
            if origin:
                try:
                    h.update((Path(origin).parent / filename).read_bytes())
                except OSError:
                    h.update(b"(no version file)")
        for name in sorted(os.environ):
            if name.startswith("NUMBA_") or name == "CUDA_HOME":
                h.update(f"{name}={os.environ[name]}\n".encode())
        _TOOLCHAIN.append(h.hexdigest()[:16])
    return _TOOLCHAIN[0]


def cache_key(ident: str, cc: tuple[int, int]) -> str:
    """The file name of a kernel's image: `ident` (what identifies the kernel and the code that built it,
    see runtime.DirectKernel), the compute capability it is compiled for, the toolchain, and whether numba-cuda's
    LTO link made it (FALOWER_LTO=1, runtime.compile_unbound: other code from the same source), and whether a
    setmaxnreg kernel is to be linked rather than compiled whole by the driver (FALOWER_PTX_JIT=0: another image)."""
    lto = "\0lto" if os.environ.get("FALOWER_LTO") == "1" else ""
    lto += "\0linked" if os.environ.get("FALOWER_PTX_JIT") == "0" else ""
    text = f"{ident}\0sm_{cc[0]}{cc[1]}{'a' if tuple(cc) >= (9, 0) else ''}\0{toolchain()}{lto}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------
def dumps(key: str, image: KernelImage) -> bytes:
    header = json.dumps({"key": key, "name": image.name, "layout": [list(a) for a in image.layout],
                         "smem": image.smem, "size": len(image.cubin),
                         "sha256": hashlib.sha256(image.cubin).hexdigest()}).encode()
    return MAGIC + _HEADER.pack(len(header)) + header + image.cubin


def loads(key: str, data: bytes) -> Optional[KernelImage]:
    """The image in `data`, or None when it is not a complete, intact image stored under `key`."""
    try:
        if not data.startswith(MAGIC):
            return None
        at = len(MAGIC)
        (n,) = _HEADER.unpack_from(data, at)
        at += _HEADER.size
        header = json.loads(data[at:at + n])
        cubin = data[at + n:]
        if header["key"] != key or header["size"] != len(cubin):
            return None
        if hashlib.sha256(cubin).hexdigest() != header["sha256"]:
            return None
        layout = tuple((str(k), int(nd), int(item)) for k, nd, item in header["layout"])
        return KernelImage(str(header["name"]), bytes(cubin), layout, int(header["smem"]))
    except (ValueError, KeyError, TypeError, struct.error):
        return None


def load(key: str) -> Optional[KernelImage]:
    """The image stored under `key`, or None (absent, unreadable or corrupt: the caller compiles it)."""
    if not enabled():
        return None
    try:
        data = (directory() / f"{key}.bin").read_bytes()
    except OSError:
        return None
    return loads(key, data)


def store(key: str, image: KernelImage) -> None:
    """Write the image atomically (temporary file, then rename). A cache that cannot be written is not an
    error: the kernel still runs, the next process compiles again."""
    if not enabled():
        return
    try:
        d = directory()
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(dumps(key, image))
            os.replace(tmp, d / f"{key}.bin")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def discard(key: str) -> None:
    """Remove an entry the driver refused (a cubin it cannot load), so the next process does not try it."""
    try:
        (directory() / f"{key}.bin").unlink()
    except OSError:
        pass


# --------------------------------------------------------------------------------------------------
# The driver: libcuda through ctypes
# --------------------------------------------------------------------------------------------------
_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}
_SM_COUNT = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_SMEM_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
# a kernel that does nothing, for asking the driver about launches before any real kernel exists (Driver.probe)
_PROBE_PTX = b""".version 7.8
.target sm_90
.address_size 64
.visible .entry falower_probe()
{
    ret;
}
\0"""


class DriverError(RuntimeError):
    pass


_LIBCUDA_FUNCS: dict = {}  # entry point name -> its ctypes function or None, looked up once


def libcuda_function(name: str, argtypes: list) -> Any:
    """libcuda's entry point `name` through ctypes, its argument types set and its result an int (a CUresult),
    looked up once; None where there is no libcuda or no such entry point. (The launches' ctypes calls take about
    a microsecond; the cuda.bindings wrappers measured 5.5 us on an H100 host.)"""
    if name not in _LIBCUDA_FUNCS:
        try:
            fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
            fn.argtypes = list(argtypes)
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _LIBCUDA_FUNCS[name] = fn
    return _LIBCUDA_FUNCS[name]


class Driver:
    """The few driver calls a cached kernel needs, through ctypes on libcuda (no Numba, no cuda.bindings).
    Handles are plain ints, as the ctypes cuLaunchKernel takes them."""

    def __init__(self, lib: Optional[ctypes.CDLL] = None) -> None:
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        self._ctx: dict[int, int] = {}
        self._cc: dict[int, tuple[int, int]] = {}
        self._sms: dict[int, int] = {}
        self._probes: dict[int, tuple[int, int]] = {}  # device -> (Driver.probe's kernel, its shared memory)
        self._ok: Optional[bool] = None

    def _call(self, what: str, *args) -> None:
        err = getattr(self.lib, what)(*args)
        if err:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(err, ctypes.byref(name))
            raise DriverError(f"{what} failed: {(name.value or b'?').decode()} ({err})")

    def available(self) -> bool:
        """cuInit succeeds and there is at least one device."""
        if self._ok is None:
            try:
                self._call("cuInit", 0)
                n = ctypes.c_int()
                self._call("cuDeviceGetCount", ctypes.byref(n))
                self._ok = n.value > 0
            except (DriverError, AttributeError):
                self._ok = False
        return self._ok

    def current_device(self) -> int:
        """The device of the thread's current context (torch sets one once it has used a device), else 0."""
        dev = ctypes.c_int()
        return dev.value if self.lib.cuCtxGetDevice(ctypes.byref(dev)) == 0 else 0

    def _device(self, ordinal: int) -> ctypes.c_int:
        self._call("cuInit", 0)
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        return dev

    def compute_capability(self, ordinal: int) -> tuple[int, int]:
        cc = self._cc.get(ordinal)
        if cc is None:
            dev = self._device(ordinal)
            major, minor = ctypes.c_int(), ctypes.c_int()
            self._call("cuDeviceGetAttribute", ctypes.byref(major), ctypes.c_int(_CC_MAJOR), dev)
            self._call("cuDeviceGetAttribute", ctypes.byref(minor), ctypes.c_int(_CC_MINOR), dev)
            cc = self._cc[ordinal] = (major.value, minor.value)
        return cc

    def sm_count(self, ordinal: int) -> int:
        """The device's streaming multiprocessors (the blocks of a persistent launch)."""
        n = self._sms.get(ordinal)
        if n is None:
            value = ctypes.c_int()
            self._call("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(_SM_COUNT), self._device(ordinal))
            n = self._sms[ordinal] = value.value
        return n

    def probe(self, ordinal: int) -> tuple[int, int]:
        """(a kernel that does nothing, the dynamic shared memory that gives it an SM alone): what occupancy
        queries take before any real kernel is built, for the persistent kernels' one block an SM
        (runtime.device_clusters_held). Loaded once a device."""
        if ordinal not in self._probes:
            value = ctypes.c_int()
            self._call("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(_SMEM_OPTIN), self._device(ordinal))
            self._probes[ordinal] = (self.load_function(ordinal, _PROBE_PTX, "falower_probe", value.value),
                                     value.value)
        return self._probes[ordinal]

    def _primary_context(self, ordinal: int) -> int:
        ctx = self._ctx.get(ordinal)
        if ctx is None:  # retained for the life of the process, as torch and Numba retain it
            handle = ctypes.c_void_p()
            self._call("cuDevicePrimaryCtxRetain", ctypes.byref(handle), self._device(ordinal))
            ctx = self._ctx[ordinal] = int(handle.value or 0)
        return ctx

    def _load_ptx(self, module: ctypes.c_void_p, image: Any, name: str) -> None:
        """cuModuleLoadDataEx on a PTX image with the JIT's error log (CU_JIT_ERROR_LOG_BUFFER and its size), so a
        refusal (a PTX version newer than the driver, say) says why in its one line."""
        size = 1 << 14
        log = ctypes.create_string_buffer(size)
        opts = (ctypes.c_int * 2)(5, 6)  # CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES
        vals = (ctypes.c_void_p * 2)(ctypes.cast(log, ctypes.c_void_p), ctypes.c_void_p(size))
        rc = self.lib.cuModuleLoadDataEx(ctypes.byref(module), image, 2, opts, vals)
        if rc != 0:
            why = " ".join(log.value.decode(errors="replace").split())[:300] or "no log"
            raise DriverError(f"the driver could not compile {name}'s PTX (CUresult {rc}): {why}")

    @contextlib.contextmanager
    def current(self, ordinal: int) -> Iterator[None]:
        """Device `ordinal`'s primary context current on this thread for the block's driver calls."""
        self._call("cuCtxPushCurrent_v2", ctypes.c_void_p(self._primary_context(ordinal)))
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def load_function(self, ordinal: int, cubin: bytes, name: str, smem: int) -> int:
        """Load `cubin` into device `ordinal`'s primary context and return the CUfunction `name`, its dynamic
        shared memory limit raised to `smem` where that is over the default 48 KiB."""
        with self.current(ordinal):
            module, func = ctypes.c_void_p(), ctypes.c_void_p()
            image = ctypes.create_string_buffer(cubin, len(cubin))
            if cubin[:4] == b"\x7fELF":
                self._call("cuModuleLoadData", ctypes.byref(module), image)
            else:  # PTX the driver compiles (runtime.whole_program_ptx): its error log names what went wrong
                self._load_ptx(module, image, name)
            self._call("cuModuleGetFunction", ctypes.byref(func), module, name.encode())
            if smem > 48 * 1024:
                self._call("cuFuncSetAttribute", func, ctypes.c_int(_MAX_DYNAMIC_SHARED), ctypes.c_int(smem))
        return int(func.value or 0)


_DRIVER: list = []  # [Driver or None], made on first use


def driver() -> Optional[Driver]:
    """The process's Driver, or None where there is no libcuda (a machine without a GPU driver)."""
    if not _DRIVER:
        try:
            _DRIVER.append(Driver())
        except OSError:
            _DRIVER.append(None)
    return _DRIVER[0]


def set_driver(drv: Optional[object]) -> None:
    """Use `drv` (an object with Driver's methods) from now on: tests run the warm path on a CPU with it."""
    _DRIVER[:] = [drv]
