"""The `falower` command: list passes, run pipelines on graphs (`opt`), execute graphs (`run`), `demo`.

Conventions follow mlir-opt/xdsl-opt: the result (the final IR) goes to stdout or `-o`; IR dumps after
passes, `--check` and `--timing` reports go to stderr, so `falower opt f.py -p ... > out.fl` keeps a clean
dump that `falower opt out.fl` reads back. Bad input of any kind ends in one `falower: error: ...` line
and exit code 1 (argparse usage errors: 2), never a traceback; a traceback means a bug in falower.

Adding a subcommand is one function that fills its argparse parser and one that runs it, registered in
`COMMANDS` (see `command`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import runpy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, TextIO

import numpy as np

from .errors import FalowerError
from .ir.core import Func
from .ir.printer import print_func

PROG = "falower"


class UserError(FalowerError):
    """A mistake on the command line or in the user's file (missing file, bad --shapes, a raising script)."""


# ------------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Command:
    name: str
    help: str
    setup: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, setup: Callable[[argparse.ArgumentParser], None]):
    """Register `fn(args) -> exit code` as subcommand `name`; `setup(parser)` declares its arguments."""

    def wrap(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = Command(name, help, setup, fn)
        return fn

    return wrap


# ------------------------------------------------------------------------------------ loading graphs
def load_graphs(path: str | os.PathLike) -> dict[str, Func]:
    """The graphs in a file, by name: module-level `Func`s of a Python file, or the funcs of an IR dump.

    A Python graph is reachable under its variable name and its `Func.name` (one entry per graph: the
    func name, with the variable name as an alias handled by `select_graph`).
    """
    return {name: f for name, (f, _aliases) in _load(path).items()}


def _load(path: str | os.PathLike) -> dict[str, tuple[Func, set[str]]]:
    if str(path) == "-":  # an IR dump on stdin: `falower opt a.py -p x | falower opt - -p y`
        return _load_ir(sys.stdin.read(), "<stdin>")
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file")
    if p.is_dir():
        raise UserError(f"{p}: is a directory, expected a .py file or an IR dump")
    if p.suffix == ".py":
        return _load_python(p)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{p}: cannot read: {e}") from None
    return _load_ir(text, str(p))


def _load_ir(text: str, p: str) -> dict[str, tuple[Func, set[str]]]:
    from .ir.parser import parse_funcs

    try:
        funcs = parse_funcs(text)
    except FalowerError as e:
        raise type(e)(f"{p}: {e}") from None
    from .ir.verifier import verify

    out: dict[str, tuple[Func, set[str]]] = {}
    for f in funcs:
        if f.name in out:
            raise UserError(f"{p}: two funcs named @{f.name}")
        try:
            verify(f)
        except FalowerError as e:
            raise type(e)(f"{p}: {e}") from None
        out[f.name] = (f, {f.name})
    return out


def _load_python(p: Path) -> dict[str, tuple[Func, set[str]]]:
    try:
        ns = runpy.run_path(str(p), run_name=f"__falower_{p.stem}__")
    except FalowerError as e:
        raise type(e)(f"{p}{_user_frame(e, p)}: {_first_line(str(e))}") from None
    except SystemExit as e:
        raise UserError(f"{p}: the file called exit({e.code})") from None
    except KeyboardInterrupt:  # Ctrl-C (or a file raising it) stops falower as usual: `falower: interrupted`
        raise
    except BaseException as e:  # the user's code raised (an Exception, or a BaseException such as GeneratorExit
        where = _user_frame(e, p)  # or its own subclass): report it, without our traceback
        raise UserError(f"{p}{where}: {type(e).__name__}: {_first_line(str(e))}") from None
    found: dict[int, tuple[Func, set[str]]] = {}
    for var, value in ns.items():
        if isinstance(value, Func) and not var.startswith("__"):
            entry = found.setdefault(id(value), (value, {value.name}))
            entry[1].add(var)
    out: dict[str, tuple[Func, set[str]]] = {}
    for f, aliases in found.values():
        if f.name in out:
            raise UserError(f"{p}: two graphs named {f.name!r}; give them distinct names")
        out[f.name] = (f, aliases)
    return out


def _user_frame(e: BaseException, p: Path) -> str:
    """`:LINE` of the innermost frame of the traceback that lies in the user's file."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f":{e.lineno}"
    tb, line = e.__traceback__, None
    target = str(p.resolve())
    while tb is not None:
        if str(Path(tb.tb_frame.f_code.co_filename).resolve()) == target:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f":{line}" if line else ""


def select_graph(path: str | os.PathLike, name: Optional[str]) -> Func:
    """The one graph of a file, or the one called `name` (its Func name or Python variable name)."""
    graphs = _load(path)
    if not graphs:
        raise UserError(f"{path}: no graph found (define a module-level graph with falower.attention or "
                        f"falower.trace)")
    names = ", ".join(sorted(graphs))
    if name is None:
        if len(graphs) > 1:
            raise UserError(f"{path}: {len(graphs)} graphs ({names}); choose one with --graph NAME")
        return next(iter(graphs.values()))[0]
    for f, aliases in graphs.values():
        if name in aliases:
            return f
    raise UserError(f"{path}: no graph named {name!r} (graphs: {names})")


# ------------------------------------------------------------------------------------------ --shapes
_SHAPE_ITEM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(-?\d+)\s*")


def parse_shapes(text: Optional[str]) -> dict[str, int]:
    """`B=2,H=4,M=100` as a dict; every size a positive int, every name given once."""
    if text is None or not text.strip():
        return {}
    out: dict[str, int] = {}
    for item in text.split(","):
        m = _SHAPE_ITEM.fullmatch(item)
        if not m:
            raise UserError(f"--shapes: bad item {item.strip()!r} (write NAME=SIZE, e.g. --shapes B=2,H=4,M=100)")
        name, size = m.group(1), int(m.group(2))
        if size <= 0:
            raise UserError(f"--shapes: {name}={size}: sizes must be positive")
        if name in out:
            raise UserError(f"--shapes: {name} is given twice")
        out[name] = size
    return out


def graph_dims(func: Func) -> set[str]:
    syms: set[str] = set()
    for a in func.args:
        for d in a.type.shape:
            syms |= d.symbols()
    return syms


def check_shapes(func: Func, shapes: Mapping[str, int]) -> dict[str, int]:
    """The sizes for every dimension of `func`'s inputs (given ones, then defaults); names must exist."""
    from .passes.check import bind_dims

    known = graph_dims(func)
    for name in shapes:
        if name not in known:
            dims = ", ".join(sorted(known)) or "none"
            raise UserError(f"--shapes: {name} is not a dimension of @{func.name}'s inputs (its dims: {dims})")
    return bind_dims(func, shapes)


def format_shapes(env: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in env.items())


_DIM_ORDER = ("B", "H", "HKV", "M", "N", "D")


def _ordered_env(func: Func, env: Mapping[str, int]) -> dict[str, int]:
    """The dims of `func`'s inputs in the usual order (B, H, HKV, M, N, D, then the rest sorted), for reports."""
    used = graph_dims(func)
    order = [s for s in _DIM_ORDER if s in used] + sorted(used - set(_DIM_ORDER))
    return {s: env[s] for s in order if s in env}


# ------------------------------------------------------------------------------------------- passes
def _setup_passes(p: argparse.ArgumentParser) -> None:
    pass


@command("passes", "list the registered passes and named pipelines", _setup_passes)
def cmd_passes(args: argparse.Namespace) -> int:
    from .passes import NAMED_PIPELINES, PASSES

    width = max([len(n) for n in PASSES] + [len(n) for n in NAMED_PIPELINES] + [8])
    print("passes:")
    for name in sorted(PASSES):
        cls = PASSES[name]
        opts = ", ".join(f"{f.name}={_default_text(f)}" for f in dataclasses.fields(cls))
        opts = f"  {{{opts}}}" if opts else ""
        print(f"  {name:<{width}}  {cls.summary}{opts}")
    print("named pipelines:")
    if not NAMED_PIPELINES:
        print("  (none registered)")
    for name in sorted(NAMED_PIPELINES):
        print(f"  {name:<{width}}  {NAMED_PIPELINES[name]}")
    return 0


def _default_text(f: dataclasses.Field) -> str:
    from .passes.base import format_option

    if f.default is not dataclasses.MISSING:
        return format_option(f.default)
    return "?"


# ---------------------------------------------------------------------------------------------- opt
def _add_graph_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE",
                   help="a Python file defining graphs, or an IR dump (.fl, .mlir, ...; - reads a dump from stdin)")
    p.add_argument("--graph", metavar="NAME", help="which graph of FILE (its name or Python variable name)")
    p.add_argument("--shapes", metavar="B=2,H=4,...", help="sizes of the symbolic dims (others get defaults)")


def _setup_opt(p: argparse.ArgumentParser) -> None:
    _add_graph_args(p)
    p.add_argument("-p", "--pipeline", "--pass-pipeline", dest="pipeline", required=True, metavar="PIPELINE",
                   help="e.g. decompose-softmax,canonicalize or a named pipeline (see `falower passes`)")
    show = p.add_mutually_exclusive_group()
    show.add_argument("--print-ir-after-all", action="store_true", help="dump the IR after every pass (stderr)")
    show.add_argument("--print-ir-after", metavar="NAMES", help="dump the IR after these passes (comma-separated)")
    show.add_argument("--print-ir-after-change", action="store_true", help="dump the IR after passes that changed it")
    p.add_argument("--check", action="store_true",
                   help="interpret after every pass on random inputs; compare with the float64 reference")
    p.add_argument("--dot", metavar="OUT", help="write the final graph as Graphviz DOT to OUT")
    p.add_argument("--timing", action="store_true", help="report each pass's time (stderr)")
    p.add_argument("--cost", action="store_true",
                   help="show FLOPs and main-memory traffic (at --shapes) in every dump header and at the end")
    p.add_argument("--print-kernel", action="store_true",
                   help="also print the Numba CUDA source the numba-cuda backend emits for the final IR "
                        "(at --shapes; the fa2-fwd or the fa2-bwd form, no GPU)")
    p.add_argument("--dtype", choices=("f16", "bf16"), help="input dtype for --print-kernel (default: the graph's)")
    p.add_argument("--pack-gqa", action="store_true",
                   help="lower the GQA graph packed (a kv head's query heads as rows: what falower.compile runs "
                        "for decoding; passes/pack_gqa.py); --check then checks the packed graph's lowering")
    p.add_argument("-o", "--output", metavar="OUT", help="write the final IR to OUT instead of stdout")


@dataclass
class OptResult:
    func: Func
    records: list
    env: Optional[dict[str, int]]
    suite: Any = None  # the CheckSuite --check ran


def run_opt(func: Func, pipeline: str, *, check: bool = False, shapes: Optional[Mapping[str, int]] = None,
            print_after_all: bool = False, print_after: Sequence[str] = (), print_after_change: bool = False,
            dumps: Optional[TextIO] = None, cost_dims: Optional[Mapping[str, int]] = None) -> OptResult:
    """Lower `func` through `pipeline` with a PassManager; `records` holds what each pass did."""
    from .passes import PassManager, parse_pipeline

    if check:
        check_shapes(func, shapes or {})  # names must exist; --check varies the sizes not given
    pm = PassManager(parse_pipeline(pipeline), print_after_all=print_after_all, print_after=tuple(print_after),
                     print_after_change=print_after_change, check=check, shapes=dict(shapes or {}),
                     out=dumps if dumps is not None else sys.stderr)
    if cost_dims is not None:
        from .passes.cost import cost_header

        pm.header_extra = cost_header(dict(cost_dims))
    try:
        out = pm.run(func)
    except FalowerError as e:
        e.records = pm.records  # type: ignore[attr-defined]
        raise
    return OptResult(out, pm.records, pm.suite.env if pm.suite else None, pm.suite)


def _report_checks(records: Sequence, err: TextIO) -> None:
    for r in records:
        if r.check is not None:
            print(f"check: {r.name} {r.check}", file=err)


@command("opt", "run a pass pipeline on a graph and print the result", _setup_opt)
def cmd_opt(args: argparse.Namespace) -> int:
    shapes = parse_shapes(args.shapes)
    func = select_graph(args.file, args.graph)
    if args.pack_gqa:
        from .passes.pack_gqa import pack_gqa

        func = pack_gqa(func)[0]
    if shapes and not args.check:
        check_shapes(func, shapes)  # still catch typos in --shapes
    after = tuple(n.strip() for n in args.print_ir_after.split(",") if n.strip()) if args.print_ir_after else ()
    cost_dims = check_shapes(func, shapes) if (args.cost or args.print_kernel) else None
    if args.cost:
        refuse_costly_sizes(cost_dims, "--cost")  # type: ignore[arg-type]
    try:
        res = run_opt(func, args.pipeline, check=args.check, shapes=shapes, print_after_all=args.print_ir_after_all,
                      print_after=after, print_after_change=args.print_ir_after_change,
                      cost_dims=cost_dims if args.cost else None)
    except FalowerError as e:
        _report_checks(getattr(e, "records", []), sys.stderr)
        raise
    if args.check:
        _report_checks(res.records, sys.stderr)
        env = _ordered_env(func, res.env or {})
        print(f"numbers preserved after {_passes(len(res.records))} (float64 reference, shapes {format_shapes(env)}; "
              f"{res.suite.describe()})", file=sys.stderr)
    if args.timing:
        total = sum(r.seconds for r in res.records)
        for r in res.records:
            print(f"timing: {r.name:<24} {r.seconds * 1e3:8.2f} ms  {'changed' if r.changed else 'no change'}",
                  file=sys.stderr)
        print(f"timing: {'total':<24} {total * 1e3:8.2f} ms", file=sys.stderr)
    text = print_func(res.func)
    if args.cost:
        from .passes.cost import cost_of, format_cost

        print(f"{format_cost(cost_of(res.func, cost_dims))} (shapes {format_shapes(_ordered_env(func, cost_dims))})",
              file=sys.stderr)
    if args.print_kernel:
        text += _kernel_source(res.func, args.dtype or func.args[0].type.dtype, cost_dims["D"])  # type: ignore[index]
    if args.dot:
        from .ir.graph import to_dot

        _write(args.dot, to_dot(res.func))
    if args.output:
        _write(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


def _backward_kernel_source(lowered: Func, dtype: str, head_dim: int, path: str) -> str:
    """--print-kernel on a backward (the fa2-bwd form: the function takes the forward's LSE): the main backward
    kernel's module, its device functions first (the element code, lse_row_fn / delta_row_fn: what the backend
    hoisted out of the elements), on the schedule a Hopper GPU runs (wgmma at f16 / bf16, D = 64 or 128; else
    `path`, mma.sync or SIMT, as `_kernel_source` picks it for the forward)."""
    from .backends.numba_cuda.emit_fa2_bwd import emit_fa2_backward
    from .backends.numba_cuda.emit_fa3_bwd import backward_extra, resolve, uses_wgmma
    from .backends.numba_cuda.from_ir import unbuildable_backward
    from .backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec

    low = analyse_backward(lowered)
    extra = backward_extra({}, env={}, dtype=dtype, head_dim=head_dim, cc=(9, 0) if path == "mma" else None)
    spec, refused = resolve(build_backward_spec(low, {"D": head_dim}, dtype, path, None, extra))
    try:
        source = emit_fa2_backward(spec)
    except ValueError as e:
        err = unbuildable_backward(e, spec, path)
        raise type(err)(f"--print-kernel: {err}") from None
    sched = "wgmma" if uses_wgmma(spec) else path
    return (f"\n# ----- numba-cuda backward kernel source (D = {head_dim}, {dtype}, {sched} schedule"
            + (f"; wgmma refused: {refused}" if refused else "") + ") -----\n" + source)


def _kernel_source(lowered: Func, dtype: str, head_dim: int) -> str:
    """What --print-kernel appends: the numba-cuda forward kernel's source for `lowered` at head dim `head_dim`
    (or the backward's, `_backward_kernel_source`, for a function that takes the LSE). A schedule the emitter
    cannot build (tile sizes, head dim, shared memory) is one error line, as in `falower.compile`
    (compiler._kernel_for)."""
    from .backends.numba_cuda.emit_fa2 import emit_fa2_forward
    from .backends.numba_cuda.from_ir import BackendError, analyse, build_spec, unbuildable

    path = "mma" if head_dim % 16 == 0 and dtype in ("f16", "bf16") else "simt"
    if any(a.name == "lse" for a in lowered.args):
        return _backward_kernel_source(lowered, dtype, head_dim, path)
    try:
        low = analyse(lowered)
    except BackendError as e:  # neither form: say both
        raise BackendError(f"--print-kernel: {e} (or fa2-bwd for the backward's kernel)") from None
    dims = {"D": head_dim}
    spec = None
    try:
        spec = build_spec(low, dims, dtype, path, None)
        source = emit_fa2_forward(spec)
    except ValueError as e:  # the emitter's validate_spec
        err = unbuildable(e, head_dim, path, spec)
        raise type(err)(f"--print-kernel: {err}") from None
    return f"\n# ----- numba-cuda kernel source (D = {head_dim}, {dtype}, {path} path) -----\n" + source


def _passes(n: int) -> str:
    return f"{n} pass" if n == 1 else f"{n} passes"


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


# --------------------------------------------------------------------------------------------- cost
def _setup_cost(p: argparse.ArgumentParser) -> None:
    _add_graph_args(p)
    p.add_argument("-p", "--pipeline", "--pass-pipeline", dest="pipeline", required=True, metavar="PIPELINE",
                   help="the passes to report on, e.g. fa2-fwd (see `falower passes`)")
    p.add_argument("--per-tensor", action="store_true", help="also list the final IR's traffic per tensor")


# The cost model visits every tile of a lowered loop nest (passes/cost.py), so its time grows about as M*N (and
# linearly in any other sequence-like dim): M = N = 8192 takes about 2 s (fa2-fwd; 4 s for document's fa2-bwd),
# 16384 already 6 s, and a size like 1e12 would never finish (or end in MemoryError). Batch, head and head-dim
# sizes only scale the counts, so they are not limited.
COST_MAX_SIZE = 8192
COST_UNLIMITED_DIMS = ("B", "H", "HKV", "D")


def refuse_costly_sizes(env: Mapping[str, int], what: str) -> None:
    """One error line for a size the cost model cannot enumerate in a few seconds (`what`: who asked)."""
    for name, size in env.items():
        if name not in COST_UNLIMITED_DIMS and size > COST_MAX_SIZE:
            raise UserError(f"--shapes: {name}={size} is too large for {what} (at most {COST_MAX_SIZE} for dims other "
                            f"than {', '.join(COST_UNLIMITED_DIMS)}: the cost model visits every tile, its time grows "
                            f"as M*N; FLOPs and traffic scale likewise, so extrapolate from smaller sizes)")


@command("cost", "FLOPs and main-memory traffic after each pass of a pipeline", _setup_cost)
def cmd_cost(args: argparse.Namespace) -> int:
    from .passes.cost import cost_table

    func = select_graph(args.file, args.graph)
    env = _ordered_env(func, check_shapes(func, parse_shapes(args.shapes)))
    refuse_costly_sizes(env, f"`{PROG} cost`")
    sys.stdout.write(cost_table(func, args.pipeline, env, per_tensor=args.per_tensor))
    return 0


# ---------------------------------------------------------------------------------------------- run
def _setup_run(p: argparse.ArgumentParser) -> None:
    _add_graph_args(p)
    p.add_argument("--backend", choices=("reference", "numba-cuda"), default="reference",
                   help="reference: the numpy interpreter in the graph's own dtypes; numba-cuda: the GPU kernel")
    p.add_argument("--pipeline", metavar="P", help="lower the graph through this pipeline first")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs (default 0)")


def _seed(text: str) -> int:
    """--seed's type: a non-negative integer (numpy's generators take no negative seed)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; seeds are integers >= 0")
    return value


def _max_errors(outs: Sequence[np.ndarray], names: Sequence[str], ref: Mapping[str, np.ndarray]) -> dict[str, float]:
    errs: dict[str, float] = {}
    for name, got in zip(names, outs):
        want = ref.get(name)
        if want is None:
            continue
        g = np.asarray(got, dtype=np.float64)
        w = np.broadcast_to(np.asarray(want, dtype=np.float64), g.shape) if np.size(want) != g.size \
            else np.asarray(want, dtype=np.float64).reshape(g.shape)
        fin = np.isfinite(w) & np.isfinite(g)
        bad = np.isnan(g) & ~np.isnan(w)
        errs[name] = float("nan") if bad.any() else float(np.max(np.abs(g[fin] - w[fin]), initial=0.0))
    return errs


def _device_inputs(func: Func, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The random inputs in the dtypes the graph declares (bf16 as raw bits in uint16, as the GPU takes them)."""
    from .ir.interp import round_bf16
    from .ir.types import numpy_dtype

    out = []
    for a, x in zip(func.args, inputs):
        if a.type.dtype == "bf16":
            out.append((round_bf16(np.asarray(x, np.float32)).view(np.uint32) >> 16).astype(np.uint16))
        else:
            out.append(np.ascontiguousarray(np.asarray(x).astype(numpy_dtype(a.type.dtype))))
    return out


def _host_output(x) -> np.ndarray:
    """A kernel output as a numpy array (device arrays are copied; bf16 bits become float32)."""
    if hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    elif hasattr(x, "cpu") and hasattr(x, "numpy"):  # a torch tensor
        x = x.float().cpu().numpy() if str(getattr(x, "dtype", "")) == "torch.bfloat16" else x.cpu().numpy()
    x = np.asarray(x)
    if x.dtype == np.uint16:
        x = (x.astype(np.uint32) << 16).view(np.float32)
    return x


def _cuda_available() -> bool:
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # numba without its CUDA target, or no driver: either way, no GPU for us
        return False


@command("run", "execute a graph on random inputs and compare with the float64 reference", _setup_run)
def cmd_run(args: argparse.Namespace) -> int:
    import falower

    from .ir.interp import interpret
    from .passes.check import Reference

    shapes = parse_shapes(args.shapes)
    func = select_graph(args.file, args.graph)
    env = check_shapes(func, shapes)
    ref = Reference.build(func, env, seed=args.seed)
    if args.backend == "reference":
        lowered = func
        if args.pipeline:
            from .passes import run_pipeline

            lowered = run_pipeline(func, args.pipeline, out=sys.stderr)
        inputs = ref.inputs_for(lowered)  # a joint function (autodiff) also takes the cotangents
        t0 = time.perf_counter()
        outs = interpret(lowered, inputs, "native", env)
        dt = time.perf_counter() - t0
        names = lowered.result_names
        if len(inputs) > len(ref.inputs):  # its gradients are compared with its own float64 interpretation
            want = interpret(lowered, inputs, "f64", env)
            ref.outputs.update({n: w for n, w in zip(names, want) if n not in ref.outputs})
    else:
        compile_fn = getattr(falower, "compile", None)
        if compile_fn is None:
            raise UserError("backend numba-cuda is not available yet (falower.compile is not defined)")
        if not _cuda_available():
            raise UserError("backend numba-cuda needs a CUDA GPU and numba-cuda (pip install -e \".[cuda]\"); "
                            "none is usable here")
        kwargs = {"pipeline": args.pipeline} if args.pipeline else {}
        compiled = compile_fn(func, backend="numba-cuda", **kwargs)
        dev_inputs = _device_inputs(func, ref.inputs)
        compiled(*dev_inputs)  # the first call compiles; time the second
        t0 = time.perf_counter()
        result = compiled(*dev_inputs)
        dt = time.perf_counter() - t0
        outs = [_host_output(x) for x in (result if isinstance(result, (tuple, list)) else [result])]
        lowered_func = getattr(compiled, "lowered", None)
        names = lowered_func.result_names if isinstance(lowered_func, Func) else func.result_names
    naive = interpret(func, ref.inputs, "native", env)
    errs = _max_errors(outs, names, ref.outputs)
    naive_errs = _max_errors(naive, func.result_names, ref.outputs)
    label = f"@{func.name}" + (f" lowered by {args.pipeline}" if args.pipeline else "")
    print(f"{label} on {args.backend}, shapes {format_shapes(_ordered_env(func, env))}, seed {args.seed}, "
          f"{dt * 1e3:.1f} ms")
    for oname, out in zip(names, outs):
        arr = np.asarray(out)
        line = f"  {oname}: {arr.dtype}{list(arr.shape)}"
        if oname in errs:
            line += f"  max abs error vs float64 {errs[oname]:.3g}"
            if oname in naive_errs:
                line += f" (input graph in its own dtypes: {naive_errs[oname]:.3g})"
        print(line)
    if any(np.isnan(e) for e in errs.values()):
        raise FalowerError("the result has NaN where the float64 reference has none")
    return 0


# --------------------------------------------------------------------------------------------- demo
def _setup_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--examples", metavar="DIR", help="directory of example files (default: the repo's examples/)")
    p.add_argument("-p", "--pipeline", metavar="PIPELINE",
                   help="pipeline to lower with (default: fa2-fwd when registered, else decompose-softmax,canonicalize)")
    p.add_argument("--shapes", metavar="B=2,H=4,...", help="sizes for --check (others get defaults)")
    p.add_argument("--show", metavar="NAME", help="example whose final IR is printed (default causal, if there is one)")


def default_pipeline() -> str:
    from .passes import NAMED_PIPELINES

    return "fa2-fwd" if "fa2-fwd" in NAMED_PIPELINES else "decompose-softmax,canonicalize"


def examples_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "examples"


@command("demo", "lower every example with --check and show what each pass did", _setup_demo)
def cmd_demo(args: argparse.Namespace) -> int:
    folder = Path(args.examples) if args.examples else examples_dir()
    if not folder.is_dir():
        raise UserError(f"{folder}: no examples directory (run from a source checkout, or pass --examples DIR)")
    files = sorted(f for f in folder.glob("*.py") if not f.name.startswith("_"))
    if not files:
        raise UserError(f"{folder}: no example files")
    pipeline = args.pipeline or default_pipeline()
    shapes = parse_shapes(args.shapes)
    stems = [f.stem for f in files]
    if args.show is not None and args.show not in stems:
        raise UserError(f"--show: no example named {args.show!r} in {folder} (examples: {', '.join(stems)})")
    show = args.show or "causal"
    funcs = [select_graph(f, None) for f in files]
    known = set().union(*(graph_dims(func) for func in funcs))
    for name in shapes:  # a dim is fine if some example has it (each example gets the ones it has)
        if name not in known:
            dims = ", ".join(sorted(known)) or "none"
            raise UserError(f"--shapes: {name} is not a dimension of any example's inputs (their dims: {dims})")
    print(f"falower demo: lowering {len(files)} examples from {folder} with `{pipeline}`, --check after every pass")
    shown: Optional[Func] = None
    failures = 0
    for f, func in zip(files, funcs):
        given = {k: v for k, v in shapes.items() if k in graph_dims(func)}
        print()
        try:
            res = run_opt(func, pipeline, check=True, shapes=given)
        except FalowerError as e:
            failures += 1
            print(f"{f.stem}: FAILED: {_first_line(str(e))}")
            continue
        env = _ordered_env(func, res.env or {})
        print(f"{f.stem}  (@{func.name}, shapes {format_shapes(env)})")
        print(f"  {'pass':<24} {'changed':<8} {'numbers':<10} {'ms':>8}")
        for r in res.records:
            print(f"  {r.name:<24} {'yes' if r.changed else 'no':<8} {r.check or '-':<10} {r.seconds * 1e3:8.1f}")
        n_ops = sum(1 for _ in res.func.walk())
        print(f"  numbers preserved after {_passes(len(res.records))} on {len(res.suite.cases)} size/data cases; "
              f"{n_ops} ops in the result")
        if f.stem == show:
            shown = res.func
    if shown is not None:
        print()
        sys.stdout.write(print_func(shown, f"// ----- {show} after `{pipeline}` ----- //"))
    if failures:
        raise FalowerError(f"{failures} of {len(files)} examples failed")
    return 0


# --------------------------------------------------------------------------------------------- main
def _first_line(msg: str) -> str:
    return msg.strip().split("\n", 1)[0] if msg.strip() else "(no message)"


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as `falower: error: ...` (exit 2), like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="falower: lower attention graphs to FlashAttention-2 kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for cmd in COMMANDS.values():
        sp = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.setup(sp)
        sp.set_defaults(_run=cmd.run)
    return parser


def report_error(e: BaseException, err: TextIO) -> None:
    """One `falower: error:` line; a VerifyError's IR context follows it (it is part of the message)."""
    msg = str(e).strip() or type(e).__name__
    first, _, rest = msg.partition("\n")
    print(f"{PROG}: error: {first}", file=err)
    from .errors import VerifyError

    if isinstance(e, VerifyError) and rest:
        print(rest, file=err)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script; returns the exit code (0 ok, 1 error, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return args._run(args)
    except FalowerError as e:
        report_error(e, sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `falower opt ... | head`
        sys.stderr.close()
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
