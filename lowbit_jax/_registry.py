"""The backend seam: each op's implementations in order of preference, each saying what it covers.

An implementation's ``supports(call)`` raises ``NotImplementedError`` with the reason when it does not cover a
call; :func:`pick` takes the first one that does. The public functions validate their arguments, pick an
implementation per op and call it; what layout an implementation wants its operands in is its own business
(asked through the implementation object, never decided by the public function).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

Call = TypeVar("Call", contravariant=True)


class Implementation(Protocol, Generic[Call]):
    """One backend of one op."""

    name: str

    def supports(self, call: Call) -> None:
        """Return if this implementation covers ``call``, else raise ``NotImplementedError`` saying why."""


I = TypeVar("I", bound=Implementation)


def require(condition: bool, reason: str) -> None:
    """For ``supports``: raise ``NotImplementedError(reason)`` unless ``condition`` holds."""
    if not condition:
        raise NotImplementedError(reason)


def pick(implementations: Sequence[I], call) -> I:
    """The first of ``implementations`` that supports ``call``.

    Raises:
      NotImplementedError: none does; the message lists each one's reason.
    """
    reasons = []
    for implementation in implementations:
        try:
            implementation.supports(call)
        except NotImplementedError as e:
            reasons.append(f"{implementation.name}: {e}")
            continue
        return implementation
    raise NotImplementedError("no implementation covers this call (" + "; ".join(reasons) + ")")
