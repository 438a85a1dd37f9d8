"""The IR: types with symbolic dims, ops with regions, builder, printer, parser, verifier, interpreter."""

from .builder import Builder, new_func
from .core import Block, Func, Op, Value, clone_func
from .dims import Dim, cdiv, dim
from .interp import Interpreter, interpret
from .parser import parse_func, parse_funcs
from .printer import print_func
from .types import TensorType, scalar, tensor
from .verifier import verify

__all__ = ["Builder", "new_func", "Block", "Func", "Op", "Value", "clone_func", "Dim", "cdiv", "dim",
           "Interpreter", "interpret", "parse_func", "parse_funcs", "print_func", "TensorType", "scalar",
           "tensor", "verify"]
