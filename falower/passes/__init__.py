"""Passes, the pass manager and pipelines. Importing this package registers every pass."""

from . import canonicalize, decompose_softmax  # noqa: F401  (registration)
from .base import PASSES, Pass, register
from .manager import PassManager, run_pipeline
from .pipeline import NAMED_PIPELINES, Pipeline, parse_pipeline

__all__ = ["PASSES", "Pass", "register", "PassManager", "run_pipeline", "NAMED_PIPELINES", "Pipeline",
           "parse_pipeline"]
