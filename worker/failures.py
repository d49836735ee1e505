"""What a failure means for a retry, decided in one place: `final_cause` names the errors that fail the same way on
every attempt (a kernel that does not compile on this worker, a bad parameter that passed the submit checks), so
the runner fails the shard once with that cause in one line instead of retrying it (worker/runtime.py,
core/leases.py `fail_final`); every other error is retried as possibly transient, and so is any error raised from
running out of memory, even inside a compiler's (the next attempt may find the memory, or take a smaller
micro-batch: worker/training/setup.py MERGE_REFUSED). `name_rows` puts a row's line
(or row) in front of every row error the engines write, as the submit checks do.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not imported at run time: the flex_attention probe's child names its failure with final_cause
    from core.leases import RowResult

# torch.compile's errors (Dynamo, Inductor, the C++/Triton compilers it runs): the same code on the same worker
# fails to compile the same way again
COMPILE_ERRORS = (
    "BackendCompilerFailed",
    "InductorError",
    "CppCompileError",
    "InvalidCxxCompiler",
    "CUDACompileError",
    "LoweringException",
)
# a parameter or a value the code refuses: the same input is refused again
BAD_VALUE_ERRORS = (ValueError, TypeError, NotImplementedError)
NOISE = (
    "Set TORCHDYNAMO_VERBOSE",
    "You can suppress this exception",
    "For even more developer context",
    "Traceback",
    "Command:",
    "Output:",
)
COMPILER_ERROR = re.compile(r"\b(fatal )?error:", re.IGNORECASE)  # `x.cpp:1:10: fatal error: Python.h: No such file`
MAX_CAUSE = 400  # characters of the one-line cause


def final_cause(exc: BaseException) -> str | None:
    """One line naming the root cause when `exc` would fail the same way on every attempt, else None."""
    chain = exception_chain(exc)
    if any(type(e).__name__ == "OutOfMemoryError" for e in chain):  # torch's, by name: no torch import here
        return None
    compiled = [e for e in chain if type(e).__name__ in COMPILE_ERRORS]
    if compiled:
        root = compiled[-1]  # the innermost: the compiler's own error, not Dynamo's wrapper
        return _one_line(f"torch.compile failed on this worker, {type(root).__name__}: {_message(root)}")
    if isinstance(exc, BAD_VALUE_ERRORS):
        root = chain[-1]
        return _one_line(f"{type(root).__name__}: {_message(root)}")
    return None


def name_rows(results: list[RowResult], lines: dict[int, int], where: str) -> None:
    """Put `line N: ` (or `row N: `) before each row error that does not name its place yet."""
    for result in results:
        if result.error and result.idx in lines:
            prefix = f"{where} {lines[result.idx]}: "
            if not result.error.startswith(prefix):
                result.error = prefix + result.error


def exception_chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from (or during), outermost first, each once."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _message(exc: BaseException) -> str:
    """The meaningful lines of an exception's message: the first one, and a compiler's first `error:` line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(NOISE)] or [type(exc).__name__]
    first = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]  # `AssertionError:`
    errors = [line for line in lines[1:] if COMPILER_ERROR.search(line)]
    return first + (f": {errors[0]}" if errors and errors[0] not in first else "")


def _one_line(text: Any) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_CAUSE else text[: MAX_CAUSE - 1] + "…"
