"""falower's cubin cache (cubin_cache.py, runtime.DirectKernel) on a CPU: the file format and its checks,
the key, atomic writes under concurrent writers, the fallbacks (corrupt file, a cubin the driver refuses),
and the property the cache exists for: a warm new process builds and launches its kernels without
importing Numba. The driver is a fake here; tests/gpu/test_cubin_cache_gpu.py runs the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytest.importorskip("numba")

from falower.backends.numba_cuda import cubin_cache, runtime  # noqa: E402
from falower.backends.numba_cuda.cubin_cache import KernelImage  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = (("array", 1, 2), ("int", -1, 8), ("f32", -1, 4), ("bool", -1, 1))


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FALOWER_CUBIN_CACHE", raising=False)


def _image(cubin: bytes = b"\x7fELF fake cubin", name: str = "_ZN8kernel") -> KernelImage:
    return KernelImage(name, cubin, LAYOUT, 64 * 1024)


# ---------------------------------------------------------------------------------------------- files
def test_an_image_round_trips():
    img = _image()
    cubin_cache.store("k1", img)
    assert cubin_cache.load("k1") == img
    assert cubin_cache.load("k2") is None  # absent


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage", "empty", "other key"])
def test_a_damaged_file_reads_as_absent(damage):
    img = _image()
    data = cubin_cache.dumps("k1", img)
    data = {"truncated": data[:-3], "flipped": data[:-1] + bytes([data[-1] ^ 1]), "garbage": b"\x00" * 40,
            "empty": b"", "other key": cubin_cache.dumps("k0", img)}[damage]
    assert cubin_cache.loads("k1", data) is None
    path = cubin_cache.directory() / "k1.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    assert cubin_cache.load("k1") is None


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("FALOWER_CUBIN_CACHE", "0")
    cubin_cache.store("k1", _image())
    assert not cubin_cache.directory().exists() and cubin_cache.load("k1") is None


def test_concurrent_writers_never_expose_half_a_file():
    """Writers rename whole files into place: a reader sees the old image, the new one, or nothing."""
    images = [_image(bytes([i]) * 200_000) for i in range(4)]
    seen, stop = [], threading.Event()

    def write(img):
        for _ in range(30):
            cubin_cache.store("k", img)

    def read():
        while not stop.is_set():
            got = cubin_cache.load("k")
            if got is not None:
                seen.append(got in images)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(img,)) for img in images]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert seen and all(seen)
    assert cubin_cache.load("k") in images
    assert not list(cubin_cache.directory().glob("*.tmp"))  # no temporary left behind


# ---------------------------------------------------------------------------------------------- keys
def test_the_key_depends_on_kernel_device_and_toolchain(monkeypatch):
    base = cubin_cache.cache_key("forward|spec", (9, 0))
    assert base == cubin_cache.cache_key("forward|spec", (9, 0))
    assert base != cubin_cache.cache_key("forward|spec2", (9, 0))
    assert base != cubin_cache.cache_key("forward|spec", (8, 0))
    monkeypatch.setattr(cubin_cache, "_TOOLCHAIN", [])
    monkeypatch.setenv("NUMBA_OPT", "1")  # Numba's code generation settings are part of the toolchain
    assert base != cubin_cache.cache_key("forward|spec", (9, 0))


def test_a_kernels_ident_names_its_source_and_spec():
    s = "def k(): pass\n"
    assert runtime._ident("forward", "spec", s) != runtime._ident("forward", "spec", s + "#")
    assert runtime._ident("forward", "spec", s) != runtime._ident("forward", "spec2", s)
    assert runtime._ident("forward", "spec", s) != runtime._ident("block_mask", "spec", s)


def test_the_toolchain_fingerprint_does_not_import_numba():
    code = ("import sys; from falower.backends.numba_cuda import cubin_cache; cubin_cache.toolchain(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- layout
def test_a_layout_survives_its_description():
    from numba import types

    argtypes = (types.Array(types.int16, 1, "C"), types.int64, types.Array(types.float32, 3, "C"), types.float16,
                types.boolean, types.int32)
    layout = runtime.ArgLayout(argtypes)
    again = runtime.ArgLayout.from_description(json.loads(json.dumps(layout.describe())))
    assert (again.first, again.ndim, again.itemsize, again.kinds, again.nslots) == \
        (layout.first, layout.ndim, layout.itemsize, layout.kinds, layout.nslots)
    with pytest.raises(ValueError):
        runtime.ArgLayout.from_description((("array", -1, 4),))


# ---------------------------------------------------------------------------------------------- DirectKernel
class FakeDriver:
    """cubin_cache.Driver's methods, recording loads; refuses cubins listed in `bad`."""

    def __init__(self, bad=()):
        self.loads, self.bad = [], set(bad)

    def available(self):
        return True

    def current_device(self):
        return 0

    def compute_capability(self, ordinal):
        return (9, 0)

    def load_function(self, ordinal, cubin, name, smem):
        if cubin in self.bad:
            raise cubin_cache.DriverError("cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE (200)")
        self.loads.append((ordinal, cubin, name, smem))
        return 1000 + len(self.loads)


def _make(monkeypatch, drv, compiles, cubin=b"good cubin"):
    monkeypatch.setattr(cubin_cache, "_DRIVER", [drv])
    monkeypatch.setattr(runtime.DirectKernel, "compile",
                        lambda self, cc: (compiles.append(cc), KernelImage("entry", cubin, LAYOUT, self.smem))[1])
    return runtime.DirectKernel(lambda: None, lambda: (), 1024, "ident")


def test_a_second_kernel_object_finds_the_first_ones_cubin(monkeypatch):
    drv, compiles = FakeDriver(), []
    first = _make(monkeypatch, drv, compiles)
    assert compiles == [(9, 0)] and first.function(0) == 1001
    second = _make(monkeypatch, drv, compiles)
    assert compiles == [(9, 0)]  # no second compile
    assert second.layout.describe() == LAYOUT and second.function(0) == 1002
    assert drv.loads[-1] == (0, b"good cubin", "entry", 1024)


def test_a_corrupt_file_is_compiled_again(monkeypatch):
    drv, compiles = FakeDriver(), []
    _make(monkeypatch, drv, compiles)
    (path,) = cubin_cache.directory().glob("*.bin")
    path.write_bytes(path.read_bytes()[:-1])
    _make(monkeypatch, drv, compiles)
    assert len(compiles) == 2 and cubin_cache.loads(path.stem, path.read_bytes()) is not None  # rewritten


def test_a_cubin_the_driver_refuses_is_dropped_and_compiled_again(monkeypatch, capsys):
    compiles = []
    _make(monkeypatch, FakeDriver(), compiles, cubin=b"stale cubin")
    drv = FakeDriver(bad={b"stale cubin"})
    kern = _make(monkeypatch, drv, compiles, cubin=b"fresh cubin")
    assert len(compiles) == 1  # found in the cache
    assert kern.function(0) == 1001 and drv.loads[0][1] == b"fresh cubin"
    assert "did not load" in capsys.readouterr().err
    (path,) = cubin_cache.directory().glob("*.bin")
    assert cubin_cache.loads(path.stem, path.read_bytes()).cubin == b"fresh cubin"


def test_a_refused_fresh_compile_is_an_error(monkeypatch):
    kern = _make(monkeypatch, FakeDriver(bad={b"bad"}), [], cubin=b"bad")
    with pytest.raises(cubin_cache.DriverError):
        kern.function(0)


# ---------------------------------------------------------------------------------------------- new process
CHILD = textwrap.dedent('''
    import json, sys
    from falower.backends.numba_cuda import cubin_cache, runtime

    class FakeDriver:
        loads = []
        def available(self): return True
        def current_device(self): return 0
        def compute_capability(self, ordinal): return (9, 0)
        def load_function(self, ordinal, cubin, name, smem):
            self.loads.append(name)
            return 1000 + len(self.loads)

    drv = FakeDriver()
    cubin_cache.set_driver(drv)
    if sys.argv[1] == "cold":  # Numba types the kernels; linking a cubin needs a GPU: the cubin is faked
        def compile_(self, cc):
            argtypes = self._argtypes()
            self._dispatcher()  # the emitted module imports (Numba's dispatcher exists)
            return cubin_cache.KernelImage("entry_" + self.ident.split("|")[0], b"cubin", runtime.describe_argtypes(argtypes), self.smem)
    else:
        def compile_(self, cc):
            raise AssertionError("a warm process compiled " + self.ident.split("|")[0])
    runtime.DirectKernel.compile = compile_

    import torch
    torch.cuda.current_device = lambda: 0
    launched = []
    runtime._raw_stream_getter = lambda: (lambda device: 0)
    runtime._launcher = lambda func, grid, block, smem, buf: (
        lambda stream: launched.append((func, tuple(grid), block, smem, buf.layout.nslots)))

    import falower as fl
    doc = fl.capture("doc", "i32", "B,N")
    graphs = {"causal": fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal"),
              "document": fl.attention(mask_mod=lambda b, h, q, kv: doc[b, q] == doc[b, kv], name="document")}
    q, k, v = (torch.zeros(1, 2, 100, 64, dtype=torch.float16) for _ in range(3))
    docs = torch.zeros(1, 100, dtype=torch.int32)
    out = {}
    for name, g in graphs.items():
        c = fl.compile(g)
        caps = (docs,) if name == "document" else ()
        fwd = c.specialize("f16", D=64)
        o, lse = runtime._ForwardPlan(fwd, q, k, v, caps)(q, k, v, caps)  # CPU tensors, launches recorded
        assert o.shape == q.shape and lse.shape == q.shape[:3]
        bwd = c._backward_kernel_and_dims_for("f16", 64)
        bcaps = caps + tuple(c._dims((q, k, v) + caps)[d] for d in bwd.spec.dims)
        grads = runtime._BackwardPlan(bwd, q, k, v, o, lse, o, bcaps)(q, k, v, o, lse, o, bcaps)
        assert grads[0].shape == q.shape
    print(json.dumps({"numba": sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite")),
                      "loads": sorted(drv.loads), "launched": len(launched)}))
''')


def test_a_warm_new_process_never_imports_numba(tmp_path):
    """Two new processes on one cache dir: the first compiles (Numba types the kernels, the cubin is faked)
    and stores; the second builds the same forward and backward kernels, plans and launches them (CPU
    tensors, launches recorded) with nothing compiled and Numba never imported."""
    pytest.importorskip("torch")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, FALOWER_CACHE_DIR=str(tmp_path / "cache"), FALOWER_QUIET="1")
    runs = {}
    for mode in ("cold", "warm"):
        proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["cold"]["numba"]  # the first process compiled with Numba
    assert runs["warm"]["numba"] == []
    assert runs["warm"]["loads"] == runs["cold"]["loads"]  # every kernel, from the cache
    assert {"entry_forward", "entry_backward.main", "entry_backward.delta", "entry_backward.dq"} <= \
        set(runs["warm"]["loads"])
    assert runs["warm"]["launched"] == runs["cold"]["launched"] > 0


# ---------------------------------------------------------------------------------------------- Driver
class FakeLibcuda:
    """libcuda's entry points as Python callables: out-parameters written through byref's `_obj`; records
    every call; `fail` names an entry point that returns CUDA_ERROR_INVALID_IMAGE (200)."""

    def __init__(self, fail=None):
        self.calls, self.fail, self.current = [], fail, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == self.fail:
                return 200
            out = args[0]._obj if args and hasattr(args[0], "_obj") else None
            if name == "cuDeviceGetCount":
                out.value = 1
            elif name == "cuDeviceGet":
                out.value = args[1].value
            elif name == "cuDeviceGetAttribute":
                out.value = {75: 9, 76: 0, 16: 132, 97: 232448}[args[1].value]  # cc 9.0, 132 SMs, 227 KiB
            elif name == "cuDevicePrimaryCtxRetain":
                out.value = 0xC0
            elif name == "cuCtxPushCurrent_v2":
                self.current.append(args[0].value)
            elif name == "cuCtxPopCurrent_v2":
                out.value = self.current.pop()
            elif name == "cuModuleLoadData":
                assert bytes(args[1]).startswith(b"\x7fELF")
                out.value = 0x30
            elif name == "cuModuleLoadDataEx":  # PTX the driver compiles
                assert bytes(args[1]).startswith(b".version") and bytes(args[1]).endswith(b"}\n\0")
                out.value = 0x31
            elif name == "cuModuleGetFunction":
                assert (args[1].value, args[2]) in ((0x30, b"_Z6kernel"), (0x31, b"falower_probe"))
                out.value = 0xF0 if args[1].value == 0x30 else 0xF1
            elif name == "cuFuncSetAttribute":
                assert args[1].value == 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                self.smem = args[2].value
            elif name == "cuGetErrorName":
                args[1]._obj.value = b"CUDA_ERROR_INVALID_IMAGE"
            elif name == "cuCtxGetDevice":
                return 201  # no current context
            return 0
        return call


def test_the_driver_loads_in_the_primary_context_and_raises_the_smem_limit():
    lib = FakeLibcuda()
    drv = cubin_cache.Driver(lib)
    assert drv.available() and drv.current_device() == 0 and drv.compute_capability(0) == (9, 0)
    assert drv.load_function(0, b"\x7fELF...", "_Z6kernel", 96 * 1024) == 0xF0
    assert lib.current == []  # pushed and popped
    assert lib.calls[-4:] == ["cuModuleLoadData", "cuModuleGetFunction", "cuFuncSetAttribute", "cuCtxPopCurrent_v2"]
    drv.load_function(0, b"\x7fELF...", "_Z6kernel", 16 * 1024)
    assert "cuFuncSetAttribute" not in lib.calls[-3:]  # the default 48 KiB suffices
    assert lib.calls.count("cuDevicePrimaryCtxRetain") == 1


def test_the_driver_gives_the_sm_count_once():
    lib = FakeLibcuda()
    drv = cubin_cache.Driver(lib)
    assert drv.sm_count(0) == 132 and drv.sm_count(0) == 132
    assert lib.calls.count("cuDeviceGetAttribute") == 1  # cached per device
    with pytest.raises(cubin_cache.DriverError, match="cuDeviceGetAttribute"):
        cubin_cache.Driver(FakeLibcuda(fail="cuDeviceGetAttribute")).sm_count(0)


def test_the_driver_loads_its_probe_once_a_device_with_an_sm_of_shared_memory():
    """Driver.probe: a kernel that does nothing, from PTX, its dynamic shared memory raised to the device's opt-in
    most so that it takes an SM alone (the persistent kernels' blocks, whose clusters runtime.device_clusters_held
    counts)."""
    lib = FakeLibcuda()
    drv = cubin_cache.Driver(lib)
    assert drv.probe(0) == (0xF1, 232448) and lib.smem == 232448
    assert drv.probe(0) == (0xF1, 232448) and lib.calls.count("cuModuleLoadDataEx") == 1
    with pytest.raises(cubin_cache.DriverError, match="could not compile falower_probe's PTX"):
        cubin_cache.Driver(FakeLibcuda(fail="cuModuleLoadDataEx")).probe(0)


def test_the_clusters_held_are_asked_of_the_probe_once_a_device_and_width(monkeypatch):
    """runtime.device_clusters_held: cuOccupancyMaxActiveClusters on the probe (its handle, 128 threads, its shared
    memory, the width) with the device's context current, once a (device, width); 0 (the query failed) and a driver
    error read None, as does a machine without a GPU."""
    from falower.backends.numba_cuda import runtime

    lib = FakeLibcuda()
    monkeypatch.setattr(cubin_cache, "_DRIVER", [cubin_cache.Driver(lib)])
    monkeypatch.setattr(runtime, "_CLUSTERS_HELD", {})
    monkeypatch.setattr(runtime, "_has_gpu", lambda: True)
    asked = []

    def held(func, block, smem, width):
        asked.append((func, block, smem, width, list(lib.current)))
        return {8: 15, 4: 30, 2: 0}[width]

    monkeypatch.setattr(runtime, "max_active_clusters", held)
    assert [runtime.device_clusters_held(w) for w in (8, 4, 8, 2)] == [15, 30, 15, None]
    assert asked == [(0xF1, 128, 232448, 8, [0xC0]), (0xF1, 128, 232448, 4, [0xC0]), (0xF1, 128, 232448, 2, [0xC0])]
    monkeypatch.setattr(cubin_cache, "_DRIVER", [cubin_cache.Driver(FakeLibcuda(fail="cuModuleLoadDataEx"))])
    monkeypatch.setattr(runtime, "_CLUSTERS_HELD", {})
    assert runtime.device_clusters_held(8) is None
    monkeypatch.setattr(runtime, "_has_gpu", lambda: False)
    assert runtime.device_clusters_held(8) is None


def test_a_driver_error_names_the_call_and_pops_the_context():
    lib = FakeLibcuda(fail="cuModuleLoadData")
    drv = cubin_cache.Driver(lib)
    with pytest.raises(cubin_cache.DriverError, match="cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE"):
        drv.load_function(0, b"\x7fELF...", "_Z6kernel", 0)
    assert lib.current == []
    assert not cubin_cache.Driver(FakeLibcuda(fail="cuInit")).available()


def test_cubin_bytes_reads_what_numba_cuda_links():
    """numba-cuda hands a linked cubin over as bytes, or (linking through cuda.core, as on the H100 machine)
    as an ObjectCode whose `code` is the bytes or a file's path; anything else is refused by name."""
    class ObjectCode:
        def __init__(self, code):
            self.code = code

    assert cubin_cache.cubin_bytes(b"\x7fELF") == b"\x7fELF"
    assert cubin_cache.cubin_bytes(ObjectCode(b"\x7fELF1")) == b"\x7fELF1"
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(b"\x7fELF2")
    assert cubin_cache.cubin_bytes(ObjectCode(f.name)) == b"\x7fELF2"
    with pytest.raises(TypeError, match="ObjectCode"):
        cubin_cache.cubin_bytes(ObjectCode(None))


def test_building_the_specs_does_not_import_numba():
    """A warm process builds its kernels' specs (device sources included) before it finds their cubins: the softcap's
    forward and backward specs, tanh_ex2's argument factor among them, need no Numba (the GPU test of a warm
    process caught from_ir importing intrinsics.py for a constant)."""
    code = ("import sys, falower as fl\n"
            "from falower.backends.numba_cuda.from_ir import analyse, build_spec\n"
            "from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec\n"
            "g = fl.attention(score_mod=lambda s, b, h, q, kv: 30.0 * fl.tanh(s / 30.0), name='softcap')\n"
            "c = fl.compile(g, 'numba-cuda')\n"
            "f = build_spec(analyse(c.lowered), {'D': 64}, 'f16', 'mma', None)\n"
            "b = build_backward_spec(analyse_backward(c.lowered_backward), {'D': 64}, 'f16', 'mma', None)\n"
            "assert 'tanh_ex2_f32(' in f.device_source and 'tanh_ex2_f32(' in b.device_source\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_key_separates_linked_setmaxnreg_kernels(monkeypatch):
    """FALOWER_PTX_JIT=0 links a setmaxnreg kernel where it otherwise goes to the driver as PTX: another image, so
    another key (a warm cache must not hand the one over for the other)."""
    monkeypatch.delenv("FALOWER_PTX_JIT", raising=False)
    jit = cubin_cache.cache_key("k", (9, 0))
    monkeypatch.setenv("FALOWER_PTX_JIT", "0")
    assert cubin_cache.cache_key("k", (9, 0)) != jit
    monkeypatch.setenv("FALOWER_PTX_JIT", "1")
    assert cubin_cache.cache_key("k", (9, 0)) == jit


def test_ptx_the_driver_refuses_says_why():
    """A PTX image goes through cuModuleLoadDataEx with the JIT's error log, and a refusal carries that log in its
    one line (a cubin keeps cuModuleLoadData)."""
    import ctypes

    calls = []

    class Lib:
        def cuCtxPushCurrent_v2(self, ctx):
            return 0

        def cuCtxPopCurrent_v2(self, out):
            return 0

        def cuModuleLoadData(self, module, image):
            calls.append("cubin")
            return 0

        def cuModuleGetFunction(self, func, module, name):
            return 0

        def cuModuleLoadDataEx(self, module, image, n, opts, vals):
            calls.append("ptx")
            ctypes.memmove(vals[0], b"ptxas fatal   : Unsupported .version 9.9\0", 41)
            return 218  # CUDA_ERROR_INVALID_PTX

    drv = cubin_cache.Driver(lib=Lib())
    drv._ctx[0] = 1
    drv.load_function(0, b"\x7fELF....", "k", 0)
    with pytest.raises(cubin_cache.DriverError, match=r"could not compile k's PTX \(CUresult 218\): ptxas fatal : "
                                                      r"Unsupported \.version 9\.9"):
        drv.load_function(0, b".version 9.9\n.target sm_90a\n\0", "k", 0)
    assert calls == ["cubin", "ptx"]
