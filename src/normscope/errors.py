"""The one exception family normscope raises.

Every message says what was wrong and what to do about it.
"""

from __future__ import annotations


class NormscopeError(Exception):
    """Base class of every error normscope raises on purpose."""


class SpecError(NormscopeError, ValueError):
    """A NormSpec (or its JSON) is invalid."""


class TargetError(NormscopeError):
    """A target (module, function, ONNX model) cannot be used as asked."""


class TargetRaised(TargetError):
    """The target's own code raised while it was called: ``kind`` is the exception's type name, ``line`` the first
    line of its message and ``what`` the input it was given. A TargetError, so every probe that reads a refusal as
    one still does; ``check`` reports one raised on an input its battery built (a valid one) as a failed finding,
    never as a usage error."""

    def __init__(self, message: str, kind: str, line: str, what: str) -> None:
        super().__init__(message)
        self.kind, self.line, self.what = kind, line, what


class MissingExtraError(NormscopeError, ImportError):
    """An optional dependency is not installed."""

    def __init__(self, package: str, extra: str):
        verb = "are" if " and " in package else "is"
        super().__init__(f"{package} {verb} not installed; install the extra with: pip install 'normscope[{extra}]'")
        self.package = package
        self.extra = extra


class NotANormalization(NormscopeError):
    """The target behaves like no normalization a NormSpec can express."""


class InputError(NormscopeError, ValueError):
    """An array or argument handed to normscope does not fit the contract it is used with."""


class TargetTimeout(NormscopeError, TimeoutError):
    """A call of the target did not return within the per-call deadline (it hangs, or is far too slow).

    Not a :class:`TargetError`: a target that hangs has not refused its input, and no probe may read a
    timeout as a refusal.
    """


class DeadlinePassed(BaseException):
    """A command's own ``--timeout`` passed while it was working (raised by its timer). Not an ``Exception``:
    nothing inside the work (a site's failure handler, a target's error wrapper) may take it for a failure of
    what was being probed; the command turns it into :class:`TargetTimeout` at its edge."""
