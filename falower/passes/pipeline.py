"""Pipelines are strings: `decompose-softmax,fuse,tile{bq=64,bk=64},online-softmax`.

They parse into passes and print back as written. Named pipelines (`fa2-fwd`) are strings too.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ParseError
from .base import PASSES, Pass

NAMED_PIPELINES: dict[str, str] = {}


def named(name: str, text: str) -> None:
    NAMED_PIPELINES[name] = text


@dataclass(frozen=True)
class Stage:
    """One pass in a pipeline and the option names the user wrote (so it prints back as written)."""

    pass_: Pass
    explicit: tuple[str, ...]

    def __str__(self) -> str:
        return self.pass_.text(self.explicit)


class Pipeline:
    def __init__(self, stages: list[Stage]):
        self.stages = stages

    @property
    def passes(self) -> list[Pass]:
        return [s.pass_ for s in self.stages]

    def __str__(self) -> str:
        return ",".join(str(s) for s in self.stages)

    def __len__(self) -> int:
        return len(self.stages)


_ITEM = re.compile(r"\s*([A-Za-z][A-Za-z0-9_-]*)\s*(\{([^{}]*)\})?\s*")


def _convert(pass_cls: type[Pass], field: dataclasses.Field, raw: str) -> Any:
    t = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    where = f"option {field.name} of pass {pass_cls.name}"
    if t == "int":
        if not re.fullmatch(r"-?\d+", raw):
            raise ParseError(f"{where} must be an int, got {raw!r}")
        return int(raw)
    if t == "float":
        try:
            return float(raw)
        except ValueError:
            raise ParseError(f"{where} must be a number, got {raw!r}") from None
    if t == "bool":
        if raw not in ("true", "false", "1", "0"):
            raise ParseError(f"{where} must be true or false, got {raw!r}")
        return raw in ("true", "1")
    return raw


def parse_pipeline(text: str, _depth: int = 0) -> Pipeline:
    """Parse a pipeline string; named pipelines expand in place."""
    if _depth > 8:
        raise ParseError("named pipelines nest too deeply")
    text = text.strip()
    if not text:
        raise ParseError("empty pipeline (try `falower passes` for the list)")
    stages: list[Stage] = []
    pos = 0
    while pos < len(text):
        m = _ITEM.match(text, pos)
        if not m or m.end() == pos:
            raise ParseError(f"malformed pipeline {text!r} at position {pos}: {text[pos:pos + 12]!r}")
        name, body = m.group(1), m.group(3)
        if m.end() < len(text) and text[m.end()] != ",":  # a name that goes on in other characters (`tïle`)
            word = re.match(r"[^,{]*", text[pos:]).group(0)  # type: ignore[union-attr]
            raise ParseError(f"malformed pipeline {text!r} at position {pos}: {word!r} is not a pass name")
        if name in NAMED_PIPELINES and name not in PASSES:
            if body is not None:
                raise ParseError(f"named pipeline {name} takes no options")
            stages += parse_pipeline(NAMED_PIPELINES[name], _depth + 1).stages
        else:
            stages.append(_stage(name, body))
        pos = m.end()
        if pos < len(text):
            if text[pos] != ",":
                raise ParseError(f"malformed pipeline {text!r} at position {pos}: expected ','")
            pos += 1
            if pos >= len(text) or not text[pos:].strip():
                raise ParseError(f"malformed pipeline {text!r}: trailing ','")
    return Pipeline(stages)


def _stage(name: str, body: str | None) -> Stage:
    cls = PASSES.get(name)
    if cls is None:
        known = ", ".join(sorted(PASSES) + sorted(NAMED_PIPELINES))
        raise ParseError(f"unknown pass {name!r} (known: {known})")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    explicit: list[str] = []
    if body is not None and body.strip():
        for item in body.split(","):
            if "=" not in item:
                raise ParseError(f"malformed option {item.strip()!r} for pass {name} (write key=value)")
            k, raw = (s.strip() for s in item.split("=", 1))
            if k not in fields:
                opts = ", ".join(fields) or "none"
                raise ParseError(f"pass {name} has no option {k!r} (options: {opts})")
            if k in values:
                raise ParseError(f"option {k} of pass {name} is given twice")
            values[k] = _convert(cls, fields[k], raw)
            explicit.append(k)
    try:
        inst = cls(**values)
    except ValueError as e:
        raise ParseError(f"pass {name}: {e}") from None
    return Stage(inst, tuple(explicit))
