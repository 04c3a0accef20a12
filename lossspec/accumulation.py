"""The accumulation check: the mistakes that make a micro-batched step silently wrong, caught.

Two mistakes give a plausible but wrong loss and gradients, with no error anywhere:

- a micro-batch's loss normalised locally: the loss is called without ``denominator=``, so each
  micro-batch divides by its own count and the sum over ``K`` micro-batches is about ``K`` times
  the full batch's (and the tokens of small micro-batches weigh more);
- the count and the loss disagree: ``count_denominator`` without ``causal_shift`` counts ``T``
  positions per row while a ``causal_shift=True`` loss scores ``T - 1`` (or the count is of
  another normalisation than the loss's).

While a :func:`recording` is active, every public loss function (the six kinds and the fused
heads, in both frameworks) and ``count_denominator`` record their call here (:func:`record`),
at no cost otherwise. :func:`problems` reads the calls of one step; ``accumulate(check=...)``
and :func:`check_accumulation` (a context manager for hand-written loops) report them with
:func:`report`. The frameworks share this module, so the messages are the same in both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Iterator, Optional

from .config import COUNTED_NORMALIZATIONS

CHECK_MODES = ("off", "warn", "raise")


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded call: a loss (``name`` the public function) or a count (``count_denominator``)."""

    name: str
    normalization: str
    causal_shift: bool
    denominator: bool = False  # a loss called with denominator= (counts: always False)

    @property
    def is_count(self) -> bool:
        return self.name == "count_denominator"


# The active recordings, innermost last. A plain module global rather than a ContextVar: the
# public functions read it on every call, also while torch.compile's Dynamo traces them (a
# global read is a guard there, not a graph break). One recording per process at a time, as
# one training step runs at a time.
_RECORDINGS: list[list[Call]] = []


def record(name: str, normalization: Any, causal_shift: Any, denominator: Any = None) -> None:
    """Record one call when a :func:`recording` is active (a no-op otherwise)."""
    if _RECORDINGS:
        _RECORDINGS[-1].append(Call(name, str(normalization), bool(causal_shift), denominator is not None))


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """The calls made inside the ``with`` block; an enclosing recording gets them too when the
    block ends (``accumulate(check=...)`` inside :func:`check_accumulation`)."""
    calls: list[Call] = []
    _RECORDINGS.append(calls)
    try:
        yield calls
    finally:
        _RECORDINGS.pop()
        if _RECORDINGS:
            _RECORDINGS[-1].extend(calls)


def check_mode(check: Any) -> str:
    """``check`` of ``accumulate`` / :func:`check_accumulation`: ``"off"``, ``"warn"`` or ``"raise"``."""
    if not isinstance(check, str) or check not in CHECK_MODES:
        raise ValueError(f"check must be one of 'off', 'warn', 'raise'; got {check!r}")
    return check


def _shift(value: bool) -> str:
    return f"causal_shift={value} (" + ("T - 1 scored positions per row)" if value else "T positions per row)")


def problems(calls: list[Call], normalization: Optional[str] = None) -> list[str]:
    """The mistakes in the calls of one accumulated step (``[]``: none found).

    ``normalization``: the step's (``accumulate``'s), when known; else the counts' normalisation.
    Losses with ``normalization="none"`` reduce nothing and are not checked.
    """
    losses = [call for call in calls if not call.is_count and call.normalization != "none"]
    counts = [call for call in calls if call.is_count]
    if not losses:
        return ["the step made no loss call that the check could see (a jaxloss / torchloss loss with a "
                "reduced normalization, called while the step ran or was traced): nothing was checked"]
    found: list[str] = []
    for call in dict.fromkeys(c for c in losses if not c.denominator and c.normalization != "sum"):
        found.append(
            f"{call.name}(normalization={call.normalization!r}) was called without denominator=: each micro-batch "
            "was normalised by its own count, so the summed loss and gradients are about K times (the number of "
            "micro-batches) too large and the tokens of small micro-batches weigh more; pass denominator= (the "
            "step's count: accumulate's third argument to loss_fn, or the sum of count_denominator over the "
            "micro-batches and replicas) to the loss"
        )
    expected = normalization or next((call.normalization for call in counts), None)
    if expected is not None:
        for call in dict.fromkeys(c for c in losses if c.normalization != expected):
            counted = "a denominator of 1" if expected == "sum" else f"the {expected!r} count"
            found.append(
                f"{call.name}(normalization={call.normalization!r}) was given {counted}: the loss divides its "
                f"{call.normalization!r} sum by a count of another normalization; use one normalization for the "
                "count and the loss"
            )
    for count_shift in dict.fromkeys(call.causal_shift for call in counts if call.normalization in COUNTED_NORMALIZATIONS):
        for call in dict.fromkeys(c for c in losses if c.causal_shift != count_shift and c.denominator):
            effect = ("D also counts each row's first position, which the shifted loss never scores" if call.causal_shift
                      else "D leaves out each row's first position, which the loss scores")
            found.append(
                f"count_denominator counted with {_shift(count_shift)} but {call.name} scores with "
                f"{_shift(call.causal_shift)}: {effect}; pass causal_shift={call.causal_shift} to the count too "
                "(accumulate(..., causal_shift=...) for its default count)"
            )
    return found


def report(found: list[str], check: str, where: str, stacklevel: int = 3) -> None:
    """Raise a ``ValueError`` (``check="raise"``) or warn (``"warn"``) naming every problem."""
    if not found or check == "off":
        return
    message = f"{where}: " + ("; and ".join(found) if len(found) > 1 else found[0])
    if check == "raise":
        raise ValueError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def run_checked(step: Callable[[], Any], check: Any, normalization: Optional[str], where: str) -> Any:
    """``step()`` with its loss and count calls recorded and checked (:func:`problems`) unless
    ``check == "off"``: the body of both frameworks' ``accumulate(check=...)``."""
    check = check_mode(check)
    with recording() if check != "off" else contextlib.nullcontext([]) as calls:
        result = step()
    report(problems(calls, normalization), check, where, stacklevel=4)  # the caller of accumulate
    return result


@contextlib.contextmanager
def check_accumulation(check: str = "raise", normalization: Optional[str] = None) -> Iterator[None]:
    """Check the loss and count calls of a hand-written accumulated step (the block): the
    mistakes of :func:`problems`, raised (``check="raise"``) or warned (``"warn"``) when the
    block ends without an error of its own. ``normalization``: the step's, if not the counts'."""
    check = check_mode(check)
    with recording() as calls:
        yield
    report(problems(calls, normalization), check, "check_accumulation")
