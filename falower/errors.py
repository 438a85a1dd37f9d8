"""Errors a user can cause. The CLI prints them as one line and exits non-zero; anything else is our bug."""

from __future__ import annotations


class FalowerError(Exception):
    """Base class: a clear, one-line message about bad input."""


class ParseError(FalowerError):
    """Text that is not valid IR, pipeline or shape syntax."""


class VerifyError(FalowerError):
    """IR that breaks a rule; the message names the op and shows the IR around it."""


class PassError(FalowerError):
    """A pass was asked to run on a graph whose precondition does not hold."""


class ShapeError(FalowerError):
    """Inputs whose shapes or dtypes do not fit the graph."""


class NaNError(FalowerError):
    """The graph itself computes NaN on the inputs drawn for it, so its numbers cannot be checked."""
