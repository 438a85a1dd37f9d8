"""Give the straight-line re-definitions of a generated kernel unique names (SSA at the Python level).

Numba's front end rebuilds SSA form for every variable that is assigned more than once, and each such
variable costs a few walks over the whole function IR (reconstruct_ssa, strip_phis, the rewrites): on an
unrolled FA2 kernel with hundreds of re-assigned temporaries (`kb0` at every k step, `ld_row` per tile load,
`mx`, `alpha`, `qi` per row) that was most of a cold compile (benchmarks/NOTES.md, "Compile time"). The
emitter writes those names the readable way; `ssa_rename(source)` then renames, in each kernel function, every
definition of a name whose uses all see the definition before them on a straight path (same statement list or
one nested inside it, not across a loop's back edge, not out of an `if` branch), so only truly loop-carried
or branch-merged names keep several assignments. `x += e` on a renamed name becomes `x__2 = x__1 + (e)`.
The program is the same one: only names change (comments and layout are kept: the rewrite edits the text).
Functions that use constructs this pass does not model (nested scopes, try, with, walrus, loop else) are
left as they are.
"""

from __future__ import annotations

import ast

__all__ = ["ssa_rename"]

_POISON = object()  # a name whose last definition is not on every straight path to here


class _Unsupported(Exception):
    pass


class _Scan(ast.NodeVisitor):
    """Finds the names of a function that must keep their name (pinned) by walking its statement lists with
    a scoped environment of reaching definitions."""

    def __init__(self, fn: ast.FunctionDef) -> None:
        self.params = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
        self.locals = set(self.params)
        for node in ast.walk(fn):
            if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
                                 ast.NamedExpr, ast.Try, ast.With, ast.AsyncWith, ast.Global, ast.Nonlocal,
                                 ast.Delete, ast.ClassDef, ast.AsyncFunctionDef, ast.Match)):
                raise _Unsupported(type(node).__name__)
            if isinstance(node, ast.FunctionDef) and node is not fn:
                raise _Unsupported("nested def")
            if isinstance(node, (ast.For, ast.While)) and node.orelse:
                raise _Unsupported("loop else")
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.locals.add(node.id)
        self.pinned = set(self.params)

    # ---- expressions: every load must find a reaching definition in env
    def load(self, expr: ast.AST, env: dict) -> None:
        for node in ast.walk(expr):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in self.locals:
                if env.get(node.id, _POISON) is _POISON:
                    self.pinned.add(node.id)

    def body(self, stmts: list[ast.stmt], env: dict) -> None:
        for st in stmts:
            self.stmt(st, env)

    def stmt(self, st: ast.stmt, env: dict) -> None:
        if isinstance(st, ast.Assign):
            self.load(st.value, env)
            for t in st.targets:
                self.target(t, env)
        elif isinstance(st, ast.AugAssign):
            self.load(st.value, env)
            if isinstance(st.target, ast.Name):
                self.load(ast.Name(st.target.id, ast.Load()), env)
                env[st.target.id] = True
            else:
                self.load(st.target, env)
        elif isinstance(st, ast.AnnAssign):
            raise _Unsupported("annotated assignment")
        elif isinstance(st, ast.If):
            self.load(st.test, env)
            defined = _stored(st.body) | _stored(st.orelse)
            self.body(st.body, dict(env))
            self.body(st.orelse, dict(env))
            for n in defined:
                env[n] = _POISON
        elif isinstance(st, (ast.While, ast.For)):
            defined = _stored(st.body) | ({n.id for n in ast.walk(st.target) if isinstance(n, ast.Name)}
                                          if isinstance(st, ast.For) else set())
            if isinstance(st, ast.For):
                self.load(st.iter, env)
                for n in ast.walk(st.target):
                    if isinstance(n, ast.Name):
                        self.pinned.add(n.id)
            inner = dict(env)
            for n in defined:
                inner[n] = _POISON  # on the second trip, the value is the one from the loop's end
            if isinstance(st, ast.For):
                for n in ast.walk(st.target):
                    if isinstance(n, ast.Name):
                        inner[n.id] = True
            else:
                self.load(st.test, inner)
            self.body(st.body, inner)
            for n in defined:
                env[n] = _POISON
        else:  # Expr, Return, Pass, Break, Continue, Assert, Raise: loads only
            for child in ast.iter_child_nodes(st):
                self.load(child, env)

    def target(self, t: ast.expr, env: dict) -> None:
        if isinstance(t, ast.Name):
            env[t.id] = True
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                self.target(e, env)
        elif isinstance(t, ast.Starred):
            raise _Unsupported("starred target")
        else:  # subscript / attribute store: its parts are loads
            self.load(t, env)


def _stored(stmts: list[ast.stmt]) -> set[str]:
    out: set[str] = set()
    for st in stmts:
        for node in ast.walk(st):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
    return out


class _Rename:
    """Second walk: the same statement order, now handing out versions and recording text edits."""

    def __init__(self, pinned: set[str], locals_: set[str], taken: set[str], offsets: list[int]) -> None:
        self.pinned, self.locals, self.taken, self.offsets = pinned, locals_, taken, offsets
        self.count: dict[str, int] = {}
        self.edits: list[tuple[int, int, str]] = []  # (start byte, end byte, replacement)

    def pos(self, line: int, col: int) -> int:
        return self.offsets[line - 1] + col

    def fresh(self, name: str) -> str:
        k = self.count.get(name, 0)
        self.count[name] = k + 1
        if k == 0:
            return name
        new = f"{name}__{k}"
        while new in self.taken:
            k += 1
            self.count[name] = k + 1
            new = f"{name}__{k}"
        self.taken.add(new)
        return new

    def renamable(self, name: str) -> bool:
        return name in self.locals and name not in self.pinned

    def load(self, expr: ast.AST, env: dict) -> None:
        for node in ast.walk(expr):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and self.renamable(node.id):
                self.sub(node, env[node.id])

    def sub(self, node: ast.Name, new: str) -> None:
        if new != node.id:
            self.edits.append((self.pos(node.lineno, node.col_offset), self.pos(node.end_lineno, node.end_col_offset), new))

    def body(self, stmts: list[ast.stmt], env: dict) -> None:
        for st in stmts:
            self.stmt(st, env)

    def stmt(self, st: ast.stmt, env: dict) -> None:
        if isinstance(st, ast.Assign):
            self.load(st.value, env)
            for t in st.targets:
                self.target(t, env)
        elif isinstance(st, ast.AugAssign):
            self.load(st.value, env)
            t = st.target
            if isinstance(t, ast.Name) and self.renamable(t.id):
                old, new = env[t.id], self.fresh(t.id)
                env[t.id] = new
                op = _BINOPS[type(st.op)]
                start = self.pos(t.lineno, t.col_offset)
                vstart = self.pos(st.value.lineno, st.value.col_offset)
                self.edits.append((start, vstart, f"{new} = {old} {op} ("))
                vend = self.pos(st.value.end_lineno, st.value.end_col_offset)
                self.edits.append((vend, vend, ")"))
            else:
                self.load(t, env)
        elif isinstance(st, ast.If):
            self.load(st.test, env)
            self.body(st.body, dict(env))
            self.body(st.orelse, dict(env))
        elif isinstance(st, ast.While):
            self.load(st.test, env)
            self.body(st.body, dict(env))
        elif isinstance(st, ast.For):
            self.load(st.iter, env)
            self.body(st.body, dict(env))
        else:
            for child in ast.iter_child_nodes(st):
                self.load(child, env)

    def target(self, t: ast.expr, env: dict) -> None:
        if isinstance(t, ast.Name):
            if self.renamable(t.id):
                new = self.fresh(t.id)
                env[t.id] = new
                self.sub(t, new)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                self.target(e, env)
        else:
            self.load(t, env)


_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|", ast.BitXor: "^", ast.BitAnd: "&",
           ast.MatMult: "@"}


def ssa_rename(source: str, functions: set[str] | None = None) -> str:
    """`source` with the straight-line re-definitions in its top-level functions (those named in `functions`,
    or all) renamed apart. Pure renaming: the same program, fewer multiply-assigned variables."""
    tree = ast.parse(source)
    data = source.encode()
    offsets = [0]
    for line in data.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    taken = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    edits: list[tuple[int, int, str]] = []
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or (functions is not None and fn.name not in functions):
            continue
        try:
            scan = _Scan(fn)
            scan.body(fn.body, {p: True for p in scan.params})
        except _Unsupported:
            continue
        ren = _Rename(scan.pinned, scan.locals, taken, offsets)
        ren.body(fn.body, {p: p for p in scan.params})
        edits += ren.edits
    for start, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        data = data[:start] + text.encode() + data[end:]
    return data.decode()
