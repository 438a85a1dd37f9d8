"""The pass manager: runs a pipeline, verifies after every pass, prints, times and checks numbers.

Debug output follows one switch, FALOWER_DEBUG (or `debug=`): 1 = pass names and times, 2 = also the IR
after each pass that changed it, 3 = also emitted kernel source, 4 = also PTX (the backend reads 3 and 4).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, Optional, TextIO

from ..errors import FalowerError, PassError, VerifyError
from ..ir.core import Func
from ..ir.printer import print_func
from ..ir.verifier import verify
from .check import CheckSuite
from .pipeline import Pipeline, parse_pipeline


def debug_level() -> int:
    try:
        return int(os.environ.get("FALOWER_DEBUG", "0"))
    except ValueError:
        return 0


@dataclass
class PassRecord:
    name: str
    seconds: float
    changed: bool
    check: Optional[str] = None  # "ok", or the problem found


@contextlib.contextmanager
def deep_graphs(limit: int = 20000):
    """Python's recursion limit raised to `limit` (never lowered) while passes walk a graph: the walks from a value
    to its definitions recurse once an op, and a score function of a few hundred chained ops (an unrolled
    polynomial) passed Python's default 1000 frames (score-licm, tile-bwd: RecursionError). Also a decorator
    (`@deep_graphs()`: the pipeline, the compiler's kernel builders)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, limit))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


@dataclass
class PassManager:
    pipeline: Pipeline
    print_after_all: bool = False
    print_after: tuple[str, ...] = ()
    print_after_change: bool = False
    check: bool = False
    shapes: Optional[Mapping[str, int]] = None
    out: TextIO = field(default_factory=lambda: sys.stdout)
    debug: Optional[int] = None
    header_extra: Optional[Callable[[Func, Pipeline, int], str]] = None
    records: list[PassRecord] = field(default_factory=list)
    suite: Optional[CheckSuite] = None

    def __post_init__(self) -> None:
        if isinstance(self.pipeline, str):
            self.pipeline = parse_pipeline(self.pipeline)
        if self.debug is None:
            self.debug = debug_level()
        known = {p.name for p in self.pipeline.passes}
        for n in self.print_after:
            if n not in known:
                raise FalowerError(f"--print-ir-after={n}: no pass named {n} in the pipeline ({self.pipeline})")

    def tile_sizes(self) -> list[int]:
        """Every tile size the pipeline's passes are given (bq, bk, ...): --check tries sizes around them."""
        sizes = []
        for p in self.pipeline.passes:  # type: ignore[union-attr]
            sizes += [getattr(p, f) for f in ("bq", "bk") if isinstance(getattr(p, f, None), int)]
        return sizes

    def _header(self, func: Func, i: int) -> str:
        done = ", ".join(str(s) for s in self.pipeline.stages[: i + 1])
        name = self.pipeline.stages[i].pass_.name
        extra = self.header_extra(func, self.pipeline, i) if self.header_extra else ""
        extra = f"\n// {extra}" if extra else ""
        return f"// ----- IR after {name}   [{done}] ----- //{extra}"

    @deep_graphs()  # (Python's recursion limit raised for the pipeline's duration)
    def run(self, func: Func) -> Func:
        verify(func)
        ref = CheckSuite.build(func, self.shapes, tiles=self.tile_sizes()) if self.check else None
        self.suite = ref
        removed: set[str] = set()
        before = print_func(func)
        for i, stage in enumerate(self.pipeline.stages):
            p = stage.pass_
            t0 = time.perf_counter()
            try:
                func = p(func)
            except FalowerError as e:  # one line that names the pass (a builder's or retype's error did not)
                if str(e).startswith(f"pass {p.name}:"):
                    raise
                try:
                    named = type(e)(f"pass {p.name}: {e}")
                except Exception:
                    named = PassError(f"pass {p.name}: {e}")
                raise named from None
            except Exception as e:  # a bug in the pass: still one line, naming the pass and what broke
                raise PassError(f"pass {p.name}: internal error ({type(e).__name__}: {e}); please report the "
                                "graph") from e
            dt = time.perf_counter() - t0
            removed |= set(p.removes)
            try:
                verify(func, removed)
            except VerifyError as e:
                raise VerifyError(f"after pass {p.name}: {e}") from None
            text = print_func(func)
            changed = text != before
            before = text
            rec = PassRecord(p.name, dt, changed)
            self.records.append(rec)
            if ref is not None:
                problems = ref.compare(func)
                rec.check = "ok" if not problems else "; ".join(problems)
                if problems:
                    raise PassError(f"--check failed after pass {p.name}: {rec.check}")
            if self.debug and self.debug >= 1:
                flag = "changed" if changed else "no change"
                chk = f", numbers {rec.check}" if rec.check else ""
                print(f"[falower] {p.name}: {dt * 1e3:.1f} ms, {flag}{chk}", file=sys.stderr)
            show = self.print_after_all or p.name in self.print_after or \
                (self.print_after_change and changed) or (self.debug is not None and self.debug >= 2 and changed)
            if show:
                self.out.write(print_func(func, self._header(func, i)))
                self.out.write("\n")
        return func


def run_pipeline(func: Func, pipeline: str, **kwargs) -> Func:
    """Lower `func` through a pipeline string; keyword arguments go to PassManager."""
    if not isinstance(func, Func):
        raise FalowerError(f"lower: the graph must be a falower Func, got {type(func).__name__}")
    if not isinstance(pipeline, (str, Pipeline)):
        raise FalowerError(f"lower: the pipeline must be a string such as 'fa2-fwd', got {type(pipeline).__name__}")
    known = [f.name for f in fields(PassManager) if f.name not in ("pipeline", "records", "suite")]
    for k in kwargs:
        if k not in known:
            raise FalowerError(f"lower: unknown option {k}= (known: {', '.join(known)})")
    return PassManager(parse_pipeline(pipeline) if isinstance(pipeline, str) else pipeline, **kwargs).run(func)
