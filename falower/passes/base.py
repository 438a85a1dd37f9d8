"""What a pass is: a small frozen dataclass whose fields are its options, a function of IR to IR.

A pass never mutates its input: `__call__` hands `run` a fresh clone. Each pass class states its
preconditions and shows a before/after snippet in its docstring; `removes` lists the ops that are illegal
once it has run (the verifier enforces that for the rest of the pipeline).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import PassError
from ..ir.core import Func, clone_func

PASSES: dict[str, type["Pass"]] = {}


@dataclass(frozen=True)
class Pass:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    removes: ClassVar[tuple[str, ...]] = ()

    def run(self, func: Func) -> Func:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, func: Func) -> Func:
        return self.run(clone_func(func))

    def fail(self, why: str) -> PassError:
        """The error a pass raises when its precondition does not hold."""
        return PassError(f"pass {self.name}: {why}")

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    def text(self, explicit: tuple[str, ...] | None = None) -> str:
        """`name{opt=value,...}` with the options that were given (or that differ from the defaults)."""
        if explicit is not None:  # as the user wrote them, in their order
            names = list(explicit)
        else:
            names = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        parts = [f"{n}={format_option(getattr(self, n))}" for n in names]
        return self.name + ("{" + ",".join(parts) + "}" if parts else "")


def format_option(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def register(cls: type[Pass]) -> type[Pass]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    PASSES[cls.name] = cls
    return cls
