"""Tensor types: a dtype and a shape of symbolic dims. A scalar is a tensor of rank 0 (printed `f32`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from ..errors import ShapeError
from .dims import Const, Dim, DimLike, dim

FLOAT_DTYPES = ("f16", "bf16", "f32", "f64")
INT_DTYPES = ("i8", "i32")
DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool",)

_NUMPY = {"f16": np.float16, "bf16": np.float32, "f32": np.float32, "f64": np.float64,
          "i8": np.int8, "i32": np.int32, "bool": np.bool_}


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy storage of a dtype. bf16 is held in float32 rounded to bf16 (numpy has no bf16)."""
    return np.dtype(_NUMPY[dtype])


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def is_int(dtype: str) -> bool:
    return dtype in INT_DTYPES


def int_range(dtype: str) -> tuple[int, int]:
    """The least and greatest value of an integer dtype (past them the interpreter's integers wrap around)."""
    info = np.iinfo(numpy_dtype(dtype))
    return int(info.min), int(info.max)


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ShapeError(f"unknown dtype {self.dtype!r} (known: {', '.join(DTYPES)})")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_scalar(self) -> bool:
        return not self.shape

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(dtype, self.shape)

    def with_shape(self, shape: Iterable[DimLike]) -> "TensorType":
        return TensorType(self.dtype, tuple(dim(d) for d in shape))

    def static_shape(self) -> tuple[int, ...] | None:
        """The shape as ints when every dim is a constant (tiles), else None."""
        if all(isinstance(d, Const) for d in self.shape):
            return tuple(d.value for d in self.shape)  # type: ignore[attr-defined]
        return None

    def concrete(self, env: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(d.eval(env) for d in self.shape)

    def __str__(self) -> str:
        if not self.shape:
            return self.dtype
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


def tensor(dtype: str, *shape: DimLike) -> TensorType:
    return TensorType(dtype, tuple(dim(d) for d in shape))


def scalar(dtype: str) -> TensorType:
    return TensorType(dtype, ())


def broadcast_shapes(*shapes: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    """numpy broadcasting on symbolic shapes: dims must be equal or 1. None when they do not fit."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        cur: Dim = Const(1)
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            d = s[j]
            if d == Const(1):
                continue
            if cur == Const(1):
                cur = d
            elif cur != d:
                return None
        out.append(cur)
    return tuple(out)
