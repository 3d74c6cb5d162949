"""Positional arguments <-> named payload fields.

An Envelope has no positional arguments: its ``payload`` is an object. A
Celery task's positional arguments are named with the signature of the
task's ``run`` method (a bound method, so ``self`` of ``bind=True`` tasks is
already left out). The names are recorded so the exact ``args`` list comes
back on delivery. Arguments that cannot be named (``*args`` extras, tasks
without a signature, calls that do not bind) stay positional.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class BoundArguments:
    """A call as payload fields: ``payload`` holds named positionals, then kwargs."""

    payload: dict[str, Any]
    argnames: list[str] = field(default_factory=list)
    rest: list[Any] = field(default_factory=list)


def bind(func: Callable[..., Any] | None, args: Sequence[Any],
         kwargs: Mapping[str, Any]) -> BoundArguments:
    """Name as many of ``args`` as ``func``'s signature allows.

    Nothing is named when ``func`` is None or has no signature, when the call
    does not bind (too many arguments) or when a name is also in ``kwargs``.
    """
    names = _names_for(func, args, kwargs)
    named = dict(zip(names, args))
    return BoundArguments(payload={**named, **kwargs}, argnames=names,
                          rest=list(args[len(names):]))


def _names_for(func: Callable[..., Any] | None, args: Sequence[Any],
               kwargs: Mapping[str, Any]) -> list[str]:
    if func is None or not args:
        return []
    try:
        signature = _signature(func)
        signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return []
    positional = [p.name for p in signature.parameters.values() if p.kind in _POSITIONAL]
    names = positional[:len(args)]
    if any(name in kwargs for name in names):
        return []
    return names


def _signature(func: Callable[..., Any]) -> inspect.Signature:
    """``func``'s signature, read once per task function (every publish asks)."""
    try:
        return _cached_signature(func)
    except TypeError:  # an unhashable callable: read every time
        return inspect.signature(func)


@lru_cache(maxsize=1024)
def _cached_signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)


def unbind(payload: Mapping[str, Any], argnames: Sequence[str],
           rest: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """``(args, kwargs)`` of a payload; the inverse of :func:`bind`.

    When the payload no longer holds every name in ``argnames`` (another
    language rewrote it), the whole payload is passed as keyword arguments
    and only the unnamed extras stay positional.
    """
    if not all(name in payload for name in argnames):
        return list(rest), dict(payload)
    args = [payload[name] for name in argnames]
    taken = set(argnames)
    kwargs = {key: value for key, value in payload.items() if key not in taken}
    return [*args, *rest], kwargs
