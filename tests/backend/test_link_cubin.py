"""The direct link (runtime.link_cubin): a kernel's PTX goes to nvJitLink itself, not through Numba's linker
(1.38 s -> 0.18 s of a cold compile on the H100 host). No GPU needed: nvJitLink runs on the CPU; on the GPU every
kernel the GPU tests launch is linked this way."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvjitlink")

from numba import cuda, types  # noqa: E402

from falower.backends.numba_cuda import runtime  # noqa: E402


def _ptx() -> str:
    @cuda.jit
    def twice(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = a[i] * 2.0 + 1.0

    return runtime.ptx_of(twice, (types.float32[::1],), (9, 0))


def test_nvjitlink_makes_a_cubin_with_the_entry() -> None:
    ptx = _ptx()
    entry = next(line.split()[2].split("(")[0] for line in ptx.splitlines() if ".entry" in line)
    cubin, log = runtime.nvjitlink_cubin([ptx], "sm_90", ["-verbose"])
    assert cubin[:4] == b"\x7fELF" and entry.encode() in cubin
    assert "registers" in log
    assert runtime.resource_usage(ptx)["registers"] > 0


class _Lib:
    """What link_cubin reads of Numba's CUDACodeLibrary."""

    def __init__(self, ptx: str, **kw) -> None:
        self.ptx, self.numba_links = ptx, 0
        self._lto, self._linking_files, self.needs_cudadevrt, self._max_registers = False, [], False, None
        self.__dict__.update(kw)

    def get_asm_strs(self, cc):
        self.cc = cc
        return [self.ptx]

    def get_cubin(self, cc):
        self.numba_links += 1
        return b"numba's"


def test_link_cubin_links_the_ptx_itself_and_leaves_numba_what_it_links_more_into(monkeypatch) -> None:
    ptx = _ptx()
    lib = _Lib(ptx)
    assert runtime.link_cubin(lib, (9, 0, ""))[:4] == b"\x7fELF" and lib.numba_links == 0
    seen = []
    monkeypatch.setattr(runtime, "nvjitlink_cubin", lambda p, arch, opts: seen.append((arch, opts)) or (b"x", ""))
    runtime.link_cubin(_Lib(ptx, _max_registers=128), (9, 0, ""))
    runtime.link_cubin(_Lib(ptx), (9, 0, "a"))  # an H100: wgmma needs sm_90a
    assert seen == [("sm_90", ["-maxrregcount=128"]), ("sm_90a", [])]
    for kw in ({"_lto": True}, {"_linking_files": ["x.a"]}, {"needs_cudadevrt": True}):
        lib = _Lib(ptx, **kw)
        assert runtime.link_cubin(lib, (9, 0, "")) == b"numba's" and lib.numba_links == 1, kw
    monkeypatch.setenv("FALOWER_NUMBA_LINK", "1")
    assert runtime.link_cubin(_Lib(ptx), (9, 0, "")) == b"numba's"


def test_compiles_run_the_lean_pipeline(monkeypatch) -> None:
    """numba-cuda's compile_cuda names its pipeline by the module global CUDACompiler: lean_compiles swaps it for
    the compile only (the lean pipeline skips InlineClosureLikes where there is nothing to inline)."""
    import numba.cuda.compiler as cuda_compiler
    from numba.cuda.core.untyped_passes import InlineClosureLikes

    runs = []
    original_run = InlineClosureLikes.run_pass
    monkeypatch.setattr(InlineClosureLikes, "run_pass", lambda self, state: runs.append(1) or original_run(self, state))
    before = cuda_compiler.CUDACompiler
    _ptx()
    assert runs == [] and cuda_compiler.CUDACompiler is before  # lean: not run; the global restored
    monkeypatch.setenv("FALOWER_NUMBA_PIPELINE", "default")
    _ptx()
    assert runs  # numba-cuda's own pipeline runs it


def test_compile_unbound_skips_bind_and_lto(monkeypatch) -> None:
    """Dispatcher.compile would bind (a Numba link + load, which needs a GPU) and link with LTO: compile_unbound
    makes the _Kernel only, LTO off unless FALOWER_LTO=1."""
    import numba.cuda.dispatcher as dispatcher_module
    from numba.cuda import codegen

    class _NoDevice:
        compute_capability = (9, 0)

    monkeypatch.setattr(dispatcher_module, "get_current_device", lambda: _NoDevice)
    monkeypatch.setattr(codegen.CUDACodeLibrary, "_ensure_cc", lambda self, cc: (9, 0, "a") if cc is None else cc)
    from falower.backends.numba_cuda.intrinsics import kernel_jit

    def twice(a):
        a[0] = a[0] * 2.0

    k = kernel_jit(twice)
    kern = runtime.compile_unbound(k, (types.float32[::1],))
    assert not kern._codelibrary._lto and not k.overloads  # nothing bound, nothing in the dispatcher
    assert runtime.link_cubin(kern._codelibrary, (9, 0, "a"))[:4] == b"\x7fELF"
    monkeypatch.setenv("FALOWER_LTO", "1")
    assert runtime.compile_unbound(kernel_jit(twice), (types.float32[::1],))._codelibrary._lto


def test_lto_cubins_are_cached_apart(monkeypatch) -> None:
    from falower.backends.numba_cuda import cubin_cache

    monkeypatch.delenv("FALOWER_LTO", raising=False)
    plain = cubin_cache.cache_key("k", (9, 0))
    monkeypatch.setenv("FALOWER_LTO", "1")
    assert cubin_cache.cache_key("k", (9, 0)) != plain


def test_setmaxnreg_kernels_go_to_the_driver_as_whole_program_ptx(monkeypatch) -> None:
    """A kernel whose one PTX module uses setmaxnreg is not linked (ptxas would ignore setmaxnreg: C7504): its image
    is the PTX itself, null-terminated and targeted at sm_90a, for the driver to compile whole at load. Not where the
    PTX calls out to another module, nor under FALOWER_PTX_JIT=0, nor under a -maxrregcount cap (a linker option)."""
    ptx = (".version 9.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\n"
           "\tsetmaxnreg.inc.sync.aligned.u32 232;\n\tret;\n}\n")
    seen = []
    monkeypatch.setattr(runtime, "nvjitlink_cubin", lambda p, arch, opts: seen.append(arch) or (b"linked", ""))
    img = runtime.link_cubin(_Lib(ptx), (9, 0, "a"))
    assert img.endswith(b"\0") and b".target sm_90a\n" in img and b"setmaxnreg.inc" in img and seen == []
    assert img[:-1].decode() == ptx.replace(".target sm_90\n", ".target sm_90a\n")
    assert runtime.link_cubin(_Lib(ptx, _max_registers=168), (9, 0, "a")) == b"linked"
    assert runtime.link_cubin(_Lib(ptx.replace("{\n", ".extern .func f();\n{\n")), (9, 0, "a")) == b"linked"
    assert runtime.link_cubin(_Lib(_ptx()), (9, 0, "a")) == b"linked"  # no setmaxnreg: linked as before
    monkeypatch.setenv("FALOWER_PTX_JIT", "0")
    assert runtime.link_cubin(_Lib(ptx), (9, 0, "a")) == b"linked"
    assert seen == ["sm_90a"] * 4
