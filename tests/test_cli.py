"""The `falower` command, run in-process through `falower.cli.main`: outputs, files, and every error path
(one `falower: error:` line, exit 1; usage errors exit 2; never a traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import falower as fl
from falower.cli import main, parse_shapes
from falower.errors import FalowerError
from falower.ir import parse_func, print_func

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden"
LOWER = "decompose-softmax,canonicalize"


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, err: str, match: str, want_code: int = 1) -> None:
    assert code == want_code, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("falower: error:")]
    assert len(lines) == 1, err
    assert match in lines[0], err


# ------------------------------------------------------------------------------------------- passes
def test_passes_lists_every_pass_and_pipeline(capsys) -> None:
    code, out, _ = cli(capsys, "passes")
    assert code == 0
    for name, cls in fl.passes.PASSES.items():
        line = next(ln for ln in out.splitlines() if ln.split()[:1] == [name])
        assert cls.summary in line
    assert "named pipelines:" in out
    for name in fl.passes.NAMED_PIPELINES:
        assert any(ln.split()[:1] == [name] for ln in out.splitlines())


# ---------------------------------------------------------------------------------------------- opt
def test_opt_causal_prints_each_pass_and_reports_numbers(capsys) -> None:
    code, out, err = cli(capsys, "opt", EX / "causal.py", "-p", LOWER, "--print-ir-after-all", "--check")
    assert code == 0, err
    assert out == (GOLDEN / "causal.lowered.fl").read_text()
    assert "// ----- IR after decompose-softmax   [decompose-softmax] ----- //" in err
    assert "// ----- IR after canonicalize   [decompose-softmax, canonicalize] ----- //" in err
    assert "check: decompose-softmax ok\ncheck: canonicalize ok\n" in err
    assert "numbers preserved after 2 passes (float64 reference, shapes B=2,H=3,M=77,N=93,D=16; 11 cases: " in err


def test_opt_check_with_shapes(capsys) -> None:
    code, _, err = cli(capsys, "opt", EX / "gqa.py", "-p", LOWER, "--check", "--shapes", "B=1, HKV=3,M=5,N=9,D=8")
    assert code == 0, err
    assert "shapes B=1,HKV=3,M=5,N=9,D=8" in err


def test_opt_pack_gqa_lowers_the_packed_graph(capsys) -> None:
    """--pack-gqa: the GQA graph with a kv head's query heads as rows (what a decoding call runs), lowered and
    checked; a graph it cannot pack is one error line naming why."""
    code, out, err = cli(capsys, "opt", EX / "gqa.py", "-p", "fa2-fwd", "--pack-gqa", "--check", "--shapes",
                         "B=1,HKV=2,M=3,N=70,D=16")
    assert code == 0, err
    assert "func @gqa_packed(%q: f16[B,HKV,M*4,D]" in out and "repeat_interleave" not in out
    assert "numbers preserved after" in err
    code, _, err = cli(capsys, "opt", EX / "causal.py", "-p", "fa2-fwd", "--pack-gqa")
    assert_one_error_line(code, err, "pack-gqa: k and v are not each repeated over heads once")


def test_opt_print_after_named_and_change(capsys) -> None:
    code, _, err = cli(capsys, "opt", EX / "plain.py", "-p", LOWER, "--print-ir-after=canonicalize")
    assert code == 0 and err.count("// ----- IR after") == 1 and "IR after canonicalize" in err
    code, _, err = cli(capsys, "opt", EX / "naive_tensor_code.py", "-p", LOWER, "--print-ir-after-change")
    assert code == 0 and err.count("// ----- IR after") == 1 and "IR after decompose-softmax" in err


def test_opt_timing(capsys) -> None:
    code, _, err = cli(capsys, "opt", EX / "plain.py", "-p", LOWER, "--timing")
    assert code == 0
    assert "timing: decompose-softmax" in err and "timing: total" in err


def test_opt_writes_output_and_dot_files(capsys, tmp_path) -> None:
    out_file, dot_file = tmp_path / "o.fl", tmp_path / "g.dot"
    code, out, err = cli(capsys, "opt", EX / "document.py", "-p", LOWER, "-o", out_file, "--dot", dot_file)
    assert code == 0, err
    assert out == ""
    text = out_file.read_text()
    assert text == (GOLDEN / "document.lowered.fl").read_text()
    dot = dot_file.read_text()
    assert dot.startswith('digraph "document"') and "gather : i32[B,1,M,1]" in dot


def test_opt_reads_an_ir_dump(capsys, tmp_path) -> None:
    dump = tmp_path / "causal.mlir"
    dump.write_text((GOLDEN / "causal.traced.fl").read_text())
    code, out, err = cli(capsys, "opt", dump, "-p", LOWER, "--check")
    assert code == 0, err
    assert out == (GOLDEN / "causal.lowered.fl").read_text()


def test_opt_reads_a_dump_from_stdin(capsys, monkeypatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO((GOLDEN / "plain.traced.fl").read_text()))
    code, out, err = cli(capsys, "opt", "-", "-p", LOWER)
    assert code == 0, err
    assert out == (GOLDEN / "plain.lowered.fl").read_text()
    monkeypatch.setattr(sys, "stdin", io.StringIO("nonsense"))
    code, _, err = cli(capsys, "opt", "-", "-p", LOWER)
    assert_one_error_line(code, err, "<stdin>: line 1, at 'nonsense'")


def test_opt_graph_selection_by_func_or_variable_name(capsys, tmp_path) -> None:
    src = tmp_path / "two.py"
    src.write_text("import falower as fl\nfirst = fl.attention(name='a')\nsecond = fl.attention(name='b')\n")
    code, out, _ = cli(capsys, "opt", src, "--graph", "b", "-p", "canonicalize")
    assert code == 0 and out.startswith("func @b(")
    code, out, _ = cli(capsys, "opt", src, "--graph", "first", "-p", "canonicalize")
    assert code == 0 and out.startswith("func @a(")


def test_opt_output_reads_back_unchanged(capsys, tmp_path) -> None:
    code, out, _ = cli(capsys, "opt", EX / "relative_bias.py", "-p", LOWER)
    dump = tmp_path / "r.fl"
    dump.write_text(out)
    code2, out2, _ = cli(capsys, "opt", dump, "-p", "canonicalize")
    assert code == code2 == 0 and out2 == out
    assert print_func(parse_func(out)) == out


# ---------------------------------------------------------------------------------------------- run
def test_run_reference_reports_error_and_shapes(capsys) -> None:
    code, out, err = cli(capsys, "run", EX / "softcap.py", "--backend", "reference", "--shapes", "B=1,H=2,M=10,N=12,D=8")
    assert code == 0, err
    assert "@softcap on reference, shapes B=1,H=2,M=10,N=12,D=8, seed 0" in out
    assert "o: float16[1, 2, 10, 8]" in out
    err_value = float(out.split("max abs error vs float64 ")[1].split()[0])
    assert 0 < err_value < 1e-2  # f16 rounding, not garbage


def test_run_lowered_graph(capsys) -> None:
    code, out, err = cli(capsys, "run", EX / "document.py", "--pipeline", LOWER, "--seed", "3")
    assert code == 0, err
    assert "lowered by decompose-softmax,canonicalize" in out and "seed 3" in out


def _gpu() -> bool:
    from falower.cli import _cuda_available

    return _cuda_available()


def test_run_numba_cuda_without_a_gpu_is_one_line(capsys) -> None:
    if _gpu():
        pytest.skip("a CUDA GPU is available: tests/backend runs the kernels")
    code, _, err = cli(capsys, "run", EX / "causal.py", "--backend", "numba-cuda")
    assert_one_error_line(code, err, "backend numba-cuda needs a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("stem", ["causal", "plain"])
def test_run_numba_cuda_on_the_gpu(capsys, stem) -> None:
    code, out, err = cli(capsys, "run", EX / f"{stem}.py", "--backend", "numba-cuda", "--shapes", "B=1,H=2,M=100,N=130,D=64")
    assert code == 0, err
    assert f"@{stem} on numba-cuda" in out and "max abs error vs float64" in out


# --------------------------------------------------------------------------------------------- demo
def test_demo_lowers_every_example(capsys) -> None:
    code, out, err = cli(capsys, "demo")
    assert code == 0, err
    for stem in ("plain", "causal", "document", "gqa", "naive_tensor_code"):
        assert f"\n{stem}  (@{stem}, shapes" in out
    assert out.count("numbers preserved after") == 11
    assert "FAILED" not in out
    assert "func @causal(" in out


# ------------------------------------------------------------------------------------------- errors
BAD_PY = {
    "empty.py": "x = 1\n",
    "boom.py": "import falower as fl\n\nraise ValueError('boom')\n",
    "syntax.py": "def f(:\n",
    "exits.py": "import sys\nsys.exit(3)\n",
    "two.py": "import falower as fl\na = fl.attention(name='a')\nb = fl.attention(name='b')\n",
    "dup.py": "import falower as fl\na = fl.attention(name='x')\nb = fl.attention(name='x')\n",
    "badmask.py": "import falower as fl\ng = fl.attention(mask_mod=lambda b, h, q, kv: q + kv)\n",
    "iftrace.py": "import falower as fl\ng = fl.attention(mask_mod=lambda b, h, q, kv: q if q > kv else kv)\n",
}
BAD_IR = {
    "garbage.fl": "garbage\n",
    "undefined.fl": "func @f(%x: f32[N]) -> (out0: f32[N]) {\n  %0 = neg %y : f32[N]\n  return %0\n}\n",
    "shapes.fl": "func @f(%x: f32[N], %y: f32[M]) -> (out0: f32[N]) {\n  %0 = add %x, %y : f32[N]\n  return %0\n}\n",
    "dtypes.fl": "func @f(%x: f32[N], %y: f16[N]) -> (out0: f32[N]) {\n  %0 = add %x, %y : f32[N]\n  return %0\n}\n",
}


@pytest.fixture
def bad_files(tmp_path) -> Path:
    for name, text in {**BAD_PY, **BAD_IR}.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.fl").write_bytes(b"\xff\xfe\x00")
    return tmp_path


@pytest.mark.parametrize("argv, match", [
    (["opt", "{d}/missing.py", "-p", LOWER], "missing.py: no such file"),
    (["opt", "{d}", "-p", LOWER], "is a directory"),
    (["opt", "{ex}/causal.py", "-p", "nosuch"], "unknown pass 'nosuch'"),
    (["opt", "{ex}/causal.py", "-p", "canonicalize,"], "trailing ','"),
    (["opt", "{ex}/causal.py", "-p", "canonicalize{{x=1}}"], "pass canonicalize has no option 'x'"),
    (["opt", "{ex}/causal.py", "-p", "canonicalize{{"], "malformed pipeline"),
    (["opt", "{ex}/causal.py", "-p", "canonicalize", "--print-ir-after=fuse"], "no pass named fuse in the pipeline"),
    (["opt", "{ex}/causal.py", "-p", LOWER, "--check", "--shapes", "B=x"], "--shapes: bad item 'B=x'"),
    (["opt", "{ex}/causal.py", "-p", LOWER, "--check", "--shapes", "B2"], "--shapes: bad item 'B2'"),
    (["opt", "{ex}/causal.py", "-p", LOWER, "--check", "--shapes", "B=0"], "sizes must be positive"),
    (["opt", "{ex}/causal.py", "-p", LOWER, "--check", "--shapes", "B=-2"], "sizes must be positive"),
    (["opt", "{ex}/causal.py", "-p", LOWER, "--check", "--shapes", "B=2,B=3"], "B is given twice"),
    (["opt", "{ex}/causal.py", "-p", LOWER, "--shapes", "Q=3"], "Q is not a dimension of @causal's inputs"),
    (["opt", "{ex}/gqa.py", "-p", LOWER, "--check", "--shapes", "H=8"], "H is not a dimension of @gqa's inputs"),
    (["opt", "{ex}/causal.py", "-p", LOWER, "--graph", "nope"], "no graph named 'nope' (graphs: causal)"),
    (["opt", "{d}/empty.py", "-p", LOWER], "no graph found"),
    (["opt", "{d}/boom.py", "-p", LOWER], "boom.py:3: ValueError: boom"),
    (["opt", "{d}/syntax.py", "-p", LOWER], "syntax.py:1: SyntaxError"),
    (["opt", "{d}/exits.py", "-p", LOWER], "the file called exit(3)"),
    (["opt", "{d}/two.py", "-p", LOWER], "2 graphs (a, b); choose one with --graph NAME"),
    (["opt", "{d}/dup.py", "-p", LOWER], "two graphs named 'x'"),
    (["opt", "{d}/badmask.py", "-p", LOWER], "badmask.py:2: mask_mod must return a bool tensor"),
    (["opt", "{d}/iftrace.py", "-p", LOWER], "has no truth value while tracing"),
    (["opt", "{d}/garbage.fl", "-p", LOWER], "garbage.fl: line 1, at 'garbage': expected func"),
    (["opt", "{d}/undefined.fl", "-p", LOWER], "use of undefined value %y"),
    (["opt", "{d}/binary.fl", "-p", LOWER], "cannot read"),
    (["opt", "{d}/shapes.fl", "-p", LOWER], "operand shapes do not broadcast"),
    (["opt", "{d}/dtypes.fl", "-p", LOWER], "operand dtypes differ"),
    (["opt", "{ex}/causal.py", "-p", LOWER, "-o", "{d}/no/such/dir/out.fl"], "cannot write"),
    (["run", "{ex}/causal.py", "--shapes", "M=0"], "sizes must be positive"),
    (["run", "{d}/two.py"], "choose one with --graph NAME"),
    (["run", "{ex}/causal.py", "--pipeline", "nosuch"], "unknown pass 'nosuch'"),
    (["demo", "--examples", "{d}/nothere"], "no examples directory"),
])
def test_error_paths(capsys, bad_files, argv, match) -> None:
    argv = [a.format(d=bad_files, ex=EX) for a in argv]
    code, out, err = cli(capsys, *argv)
    assert_one_error_line(code, err, match)


def test_verify_error_prints_context_after_the_error_line(capsys, bad_files) -> None:
    code, _, err = cli(capsys, "opt", bad_files / "shapes.fl", "-p", LOWER)
    assert code == 1 and "Traceback" not in err
    first, *context = err.rstrip("\n").split("\n")
    assert first.startswith("falower: error: ") and "verifier: 'add'" in first
    assert any(line.startswith(">") and "add %x, %y" in line for line in context)


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["opt", "x.py"],  # -p is required
    ["opt", "x.py", "-p", LOWER, "--print-ir-after-all", "--print-ir-after-change"],
    ["run", "x.py", "--backend", "cpu"],
    ["run", "x.py", "--seed", "s"],
])
def test_usage_errors_exit_2(capsys, argv) -> None:
    code, _, err = cli(capsys, *argv)
    assert_one_error_line(code, err, "", want_code=2)


def test_help_exits_0(capsys) -> None:
    code, out, _ = cli(capsys, "--help")
    assert code == 0
    for name in ("passes", "opt", "run", "demo"):
        assert name in out


@pytest.mark.parametrize("text, want", [("", {}), ("B=2", {"B": 2}), (" B = 2 ,H=4", {"B": 2, "H": 4})])
def test_parse_shapes(text, want) -> None:
    assert parse_shapes(text) == want


@pytest.mark.parametrize("text", ["B", "B=", "=2", "B=2,", "B=2.5", "2=B", "B=2;H=3"])
def test_parse_shapes_errors(text) -> None:
    with pytest.raises(FalowerError, match="--shapes"):
        parse_shapes(text)


def test_as_a_process_error_is_one_line_without_traceback(tmp_path) -> None:
    bad = tmp_path / "boom.py"
    bad.write_text("raise RuntimeError('kaput')\n")
    proc = subprocess.run([sys.executable, "-m", "falower.cli", "opt", str(bad), "-p", LOWER],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"falower: error: {bad}:1: RuntimeError: kaput"]


def test_readme_and_ci_use_the_same_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    line = next(ln for ln in ci.splitlines() if ln.startswith("TEST_CMD="))
    cmd = line.split("=", 1)[1].strip().strip("'")
    assert "pytest" in cmd
    assert cmd in (ROOT / "README.md").read_text()


def test_opt_cost_in_headers_and_print_kernel(capsys) -> None:
    from falower.cli import main

    rc = main(["opt", "examples/causal.py", "-p", "fa2-fwd", "--cost", "--print-ir-after=tile",
               "--shapes", "B=1,H=2,M=256,N=256,D=64", "--print-kernel"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "// cost: " in err and "GFLOP" in err
    assert "numba-cuda kernel source (D = 64, f16, mma path)" in out
    assert "def score_fn(s, b, h, q, kv):" in out and "def tile_class_fn(" in out


def test_print_kernel_on_the_backward(capsys) -> None:
    """--print-kernel after fa2-bwd: the backward's main kernel module (the Hopper schedule at f16 D = 64), its
    device functions showing what the backend took out of the elements (lse_row_fn, delta_row_fn) and the kernel
    reading the LSE and Delta through them; the deterministic pipeline says wgmma refused it and prints mma.sync's."""
    from falower.cli import main

    rc = main(["opt", "examples/causal.py", "-p", "fa2-bwd", "--shapes", "B=1,H=2,M=256,N=256,D=64", "--print-kernel"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "numba-cuda backward kernel source (D = 64, f16, wgmma schedule)" in out
    assert "def lse_row_fn(lse):" in out and "def delta_row_fn(delta):" in out
    assert "lse_row_fn(lse[" in out and "delta_row_fn(delta[" in out and "wgmma_ss" in out
    rc = main(["opt", "examples/causal.py", "-p", "fa2-bwd-deterministic", "--shapes", "D=64", "--print-kernel"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "mma schedule; wgmma refused: wgmma backward: the deterministic mode" in out


@pytest.mark.parametrize("pipeline, shapes, match", [
    ("fa2-bwd", "D=48", "--print-kernel: numba-cuda backend: mma path: the backward needs block_k = 16 * num_warps"),
    ("autodiff", "D=64", "needs the fa2-fwd IR (one parallel_for over (b, h, q-tile)); lower with pipeline fa2-fwd "
                         "first (or fa2-bwd for the backward's kernel)"),
])
def test_print_kernel_on_other_forms_is_one_line(capsys, pipeline, shapes, match) -> None:
    code, out, err = cli(capsys, "opt", EX / "causal.py", "-p", pipeline, "--print-kernel", "--shapes", shapes)
    assert_one_error_line(code, err, match)
    assert out == ""


def test_print_kernel_and_compile_refuse_a_backward_schedule_alike(capsys) -> None:
    """The backward's unbuildable schedule is one line, the same from `falower opt --print-kernel` as from the
    compiled function (from_ir.unbuildable_backward, written once)."""
    import runpy

    import falower as fl
    from falower.backends.numba_cuda.from_ir import BackendError

    code, out, err = cli(capsys, "opt", EX / "causal.py", "-p", "fa2-bwd", "--print-kernel", "--shapes", "D=48")
    assert code != 0 and out == ""
    graph = runpy.run_path(str(EX / "causal.py"))["graph"]
    with pytest.raises(BackendError) as info:
        fl.compile(graph, "numba-cuda", path="mma")._backward_kernel_and_dims_for("f16", 48)
    assert "\n" not in str(info.value) and "(backward tiles " in str(info.value)
    assert err.strip() == f"falower: error: --print-kernel: {info.value}"


# ------------------------------------------------------------------ error paths found by review
@pytest.mark.parametrize("pipeline, shapes, match", [
    ("fa2-fwd", "D=512", "bytes of shared memory exceed 227 KB (tiles 128x64, D = 512, mma path"),
    ("fa2-fwd", "D=1000", "simt path: 2 * block_k * head_dim floats of shared memory must fit in 48 KB"),
    ("decompose-softmax,canonicalize,fuse,tile{bq=3,bk=5},online-softmax,canonicalize", "D=16",
     "block_k must be a multiple of 16, got 5 (tiles 3x5"),
    ("decompose-softmax,canonicalize,fuse,tile{bq=4096,bk=4096},online-softmax,canonicalize", "D=16",
     "shared memory exceed 227 KB (tiles 4096x4096"),
])
def test_print_kernel_unbuildable_schedule_is_one_line(capsys, pipeline, shapes, match) -> None:
    """A schedule the emitter refuses (validate_spec's ValueError) is one `--print-kernel:` line, as in compile."""
    code, out, err = cli(capsys, "opt", EX / "causal.py", "-p", pipeline, "--print-kernel", "--shapes", shapes)
    assert_one_error_line(code, err, match)
    assert "--print-kernel: numba-cuda backend:" in err and out == ""


def test_run_refuses_a_negative_seed(capsys) -> None:
    code, out, err = cli(capsys, "run", EX / "causal.py", "--seed", "-1")
    assert_one_error_line(code, err, "argument --seed: -1 is negative; seeds are integers >= 0", want_code=2)
    assert out == ""
    code, out, err = cli(capsys, "run", EX / "plain.py", "--seed", "4294967296", "--shapes", "B=1,H=1,M=5,N=6,D=4")
    assert code == 0 and "seed 4294967296" in out, err


@pytest.mark.parametrize("argv, match", [
    (["cost", "{ex}/causal.py", "-p", "fa2-fwd", "--shapes", "M=1000000000000"],
     "--shapes: M=1000000000000 is too large for `falower cost` (at most 8192 for dims other than B, H, HKV, D"),
    (["cost", "{ex}/causal.py", "-p", "fa2-fwd", "--shapes", "B=1,N=8193"], "N=8193 is too large for `falower cost`"),
    (["opt", "{ex}/causal.py", "-p", "fa2-fwd", "--cost", "--shapes", "M=1000000000000"],
     "M=1000000000000 is too large for --cost (at most 8192"),
])
def test_cost_refuses_sizes_it_cannot_enumerate(capsys, argv, match) -> None:
    """The cost model visits every tile (M*N of them, about): a huge size is one error line, not a MemoryError."""
    code, out, err = cli(capsys, *[a.format(ex=EX) for a in argv])
    assert_one_error_line(code, err, match)
    assert out == ""


def test_cost_at_the_size_limit_and_huge_batch_heads_head_dim(capsys) -> None:
    """The limit is inclusive, and batch, heads and head dim only scale the counts (not limited)."""
    from falower.cli import COST_MAX_SIZE

    code, out, err = cli(capsys, "cost", EX / "plain.py", "-p", "fa2-fwd", "--shapes",
                         f"B=100000,H=100000,D=100000,M={COST_MAX_SIZE},N=64")
    assert code == 0, err
    assert f"M={COST_MAX_SIZE}" in out.splitlines()[0]


@pytest.fixture
def two_examples(tmp_path) -> Path:
    (tmp_path / "causal.py").write_text((EX / "causal.py").read_text())
    (tmp_path / "gqa.py").write_text((EX / "gqa.py").read_text())
    return tmp_path


def test_demo_refuses_an_unknown_show_and_shapes_typo(capsys, two_examples) -> None:
    code, out, err = cli(capsys, "demo", "--examples", two_examples, "-p", LOWER, "--show", "nope")
    assert_one_error_line(code, err, "--show: no example named 'nope' in ")
    assert "(examples: causal, gqa)" in err and out == ""
    code, out, err = cli(capsys, "demo", "--examples", two_examples, "-p", LOWER, "--shapes", "TYPO=5")
    assert_one_error_line(code, err, "--shapes: TYPO is not a dimension of any example's inputs "
                                     "(their dims: B, D, H, HKV, M, N)")
    assert out == ""


def test_demo_shapes_a_dim_of_some_example_and_show(capsys, two_examples) -> None:
    """H is a dim of causal only (gqa has HKV): fine, each example gets the dims it has; --show picks the dump."""
    code, out, err = cli(capsys, "demo", "--examples", two_examples, "-p", LOWER, "--shapes", "H=2,HKV=1,M=5",
                         "--show", "gqa")
    assert code == 0, err
    assert "\ncausal  (@causal, shapes B=2,H=2,M=5," in out and "\ngqa  (@gqa, shapes B=2,HKV=1,M=5," in out
    assert "// ----- gqa after `decompose-softmax,canonicalize` ----- //" in out and "func @gqa(" in out


BASE_EXC_PY = {
    "custom_base.py": "class Stop(BaseException):\n    pass\n\n\nraise Stop('custom base')\n",
    "gen_exit.py": "x = 1\nraise GeneratorExit('closing')\n",
}


@pytest.mark.parametrize("name, match", [("custom_base.py", "custom_base.py:5: Stop: custom base"),
                                         ("gen_exit.py", "gen_exit.py:2: GeneratorExit: closing")])
@pytest.mark.parametrize("how", ["opt", "demo"])
def test_user_file_raising_a_base_exception_is_one_line(capsys, tmp_path, name, match, how) -> None:
    (tmp_path / name).write_text(BASE_EXC_PY[name])
    argv = ["opt", tmp_path / name, "-p", LOWER] if how == "opt" else ["demo", "--examples", tmp_path, "-p", LOWER]
    code, _, err = cli(capsys, *argv)
    assert_one_error_line(code, err, match)


def test_user_file_raising_keyboard_interrupt_still_interrupts(capsys, tmp_path) -> None:
    (tmp_path / "kbd.py").write_text("raise KeyboardInterrupt\n")
    code, _, err = cli(capsys, "opt", tmp_path / "kbd.py", "-p", LOWER)
    assert code == 130 and err == "falower: interrupted\n"
