"""Exceptions raised by kombu-envelope.

Every class subclasses :class:`kombu.exceptions.KombuError`, so code that
already catches kombu's errors keeps working. Publishing problems are
:class:`kombu.exceptions.EncodeError`s, problems with stored data are
:class:`kombu.exceptions.DecodeError`s.
"""

from __future__ import annotations

from dataclasses import dataclass

from kombu.exceptions import DecodeError, EncodeError, KombuError


@dataclass(frozen=True)
class Violation:
    """One broken rule: the field (dotted path), the rule's name and a message."""

    field: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message} [{self.rule}]"


class EnvelopeError(KombuError):
    """Base class of every kombu-envelope error."""


class InvalidEnvelope(EnvelopeError, EncodeError, ValueError):
    """An Envelope breaks a validation rule; nothing was published.

    Pickling keeps the violations. Celery's result backend keeps only an exception's
    message and rebuilds it from that: ``InvalidEnvelope(message)`` has the same message
    and no violations.
    """

    def __init__(self, violations: list[Violation] | str) -> None:
        if isinstance(violations, str):  # rebuilt from its message
            self.violations: list[Violation] = []
            super().__init__(violations)
            return
        self.violations = list(violations)
        super().__init__("invalid envelope: " + "; ".join(str(v) for v in self.violations))

    def __reduce__(self) -> tuple[type[InvalidEnvelope], tuple[list[Violation] | str]]:
        return type(self), (self.violations or str(self),)

    @property
    def fields(self) -> list[str]:
        """The offending fields, in the order they were found."""
        return [v.field for v in self.violations]

    @property
    def rules(self) -> list[str]:
        """The names of the broken rules, in the order they were found."""
        return [v.rule for v in self.violations]


class MalformedEntry(EnvelopeError, DecodeError):
    """A stream entry cannot be decoded into a valid Envelope."""

    def __init__(self, reason: str, violations: list[Violation] | None = None) -> None:
        self.reason = reason
        self.violations = list(violations or [])
        super().__init__(reason)


class UnsupportedMessage(EnvelopeError, EncodeError):
    """A message cannot become an Envelope (for example it is not JSON)."""


class InvalidSchema(EnvelopeError, ValueError):
    """A payload schema is not a valid JSON Schema (draft 2020-12); nothing was stored."""


class InvalidQueueName(EnvelopeError, ValueError):
    """A queue name cannot be used in a Redis Cluster hash tag."""


class InvalidTransportOption(EnvelopeError, ValueError):
    """Transport options that are unknown, of the wrong type, or of no use on envelope://.

    :attr:`problems` maps each offending option to what is wrong with it.
    """

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = dict(problems)
        super().__init__("; ".join(f"transport option {name!r}: {why}"
                                   for name, why in self.problems.items()))

    @property
    def options(self) -> list[str]:
        """The offending option names, in the order they were found."""
        return list(self.problems)


#: How to make Celery tasks Envelopes: said by every :class:`CeleryExtensionMissing`.
CELERY_FIX = ("add `import celery_ext` to the module that creates the Celery app (the "
              "`celery` command line imports it for you)")


class CeleryExtensionMissing(EnvelopeError, RuntimeError):
    """Celery uses envelope:// without ``celery_ext``: its tasks would not become Envelopes,
    so no other language would read them."""


class InvalidTaskLimit(EnvelopeError, ValueError):
    """Limits of a task type that break a rule (docs/protocol.md, section 19)."""

    def __init__(self, field: str, rule: str, message: str) -> None:
        self.field, self.rule = field, rule
        super().__init__(f"{field or 'limits'}: {message} ({rule})")
