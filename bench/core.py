"""What every scenario receives (:class:`Context`) and returns (:class:`ScenarioResult`)."""

from __future__ import annotations

import math
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from bench.plus import SCHEME as PLUS_SCHEME
from bench.stats import Measure, Ratio

#: A ``redis.Redis`` client answering bytes; typed loosely because redis-py's
#: reply types are unions of every possible answer.
RedisClient = Any

#: Transport names used in results.
ENVELOPE = "envelope"
STOCK = "redis"
AMQP = "amqp"
#: celery-redis-plus (:mod:`bench.plus`), Celery scenarios only.
PLUS = "plus"


@dataclass
class Context:
    """The run's shared state: the private Redis, the optional RabbitMQ, sizes."""

    redis_url: str
    amqp_url: str | None
    repeat: int
    quick: bool
    sizes: dict[str, dict[str, float]]
    verbose: bool = True
    #: Whether celery-redis-plus is importable (:func:`bench.plus.load`).
    plus: bool = False

    @property
    def hostport(self) -> str:
        """``host:port/db`` of the private Redis."""
        return self.redis_url.split("://", 1)[1]

    def url(self, transport: str) -> str:
        """Broker URL of ``transport`` (``envelope``, ``redis``, ``plus`` or ``amqp``)."""
        if transport == AMQP:
            assert self.amqp_url is not None
            return self.amqp_url
        if transport == PLUS:
            return f"{PLUS_SCHEME}://{self.hostport}"
        return f"{transport}://{self.hostport}"

    def celery_transports(self) -> list[str]:
        """The brokers Celery scenarios compare: envelope://, stock redis://, then
        celery-redis-plus and RabbitMQ when they are available."""
        return ([ENVELOPE, STOCK] + ([PLUS] if self.plus else [])
                + ([AMQP] if self.amqp_url else []))

    def size(self, scenario: str, name: str) -> int:
        """Integer size ``name`` of ``scenario``."""
        return int(self.sizes[scenario][name])

    def real(self, scenario: str, name: str) -> float:
        """Size ``name`` of ``scenario`` as a float."""
        return float(self.sizes[scenario][name])

    def client(self) -> RedisClient:
        """A new client on the private Redis."""
        return redis.Redis.from_url(self.redis_url, protocol=2)

    def flush(self) -> None:
        """Empty the private Redis (it holds nothing but benchmark data)."""
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()

    def used_memory(self) -> int:
        """Redis ``used_memory`` (bytes)."""
        client = self.client()
        try:
            return int(client.info("memory")["used_memory"])
        finally:
            client.close()

    def log(self, message: str) -> None:
        """Progress line on stderr."""
        if self.verbose:
            print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def paced(rate: float, count: int) -> Iterator[int]:
    """Yield ``0 .. count - 1``, number ``n`` no sooner than ``n / rate`` seconds after the
    first (at once when behind: the pace is kept, never made up by sending faster)."""
    interval = 1.0 / rate
    start = time.perf_counter()
    for index in range(count):
        delay = start + index * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        yield index


def new_run_id() -> str:
    """A short id for keys and queues of one repetition."""
    return uuid.uuid4().hex[:10]


@dataclass
class Target:
    """A goal one figure is checked against."""

    name: str
    source: Measure | Ratio
    threshold: float
    at_least: bool = True
    unit: str = ""

    @property
    def value(self) -> float:
        """The figure's median."""
        return self.source.median

    @property
    def met(self) -> bool | None:
        """Whether the median reaches the threshold (None when not measured)."""
        if math.isnan(self.value):
            return None
        return self.value >= self.threshold if self.at_least else self.value <= self.threshold

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"name": self.name, "value": self.value, "threshold": self.threshold,
                "at_least": self.at_least, "unit": self.unit, "met": self.met}


@dataclass
class ScenarioResult:
    """Measures, ratios, targets and notes of one scenario."""

    key: str
    title: str
    description: str
    number: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    measures: list[Measure] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None
    seconds: float = 0.0

    def measure(self, label: str, transport: str, unit: str,
                higher_is_better: bool = True) -> Measure:
        """Add (or return the existing) measure ``label``."""
        for known in self.measures:
            if known.label == label:
                return known
        created = Measure(label, transport, unit, higher_is_better)
        self.measures.append(created)
        return created

    def ratio(self, label: str, numerator: Measure, denominator: Measure) -> Ratio:
        """Add a per-repetition ratio."""
        created = Ratio(label, numerator, denominator)
        self.ratios.append(created)
        return created

    def ratios_to_envelope(self, what: str, measures: dict[str, Measure],
                           names: dict[str, str]) -> None:
        """``what: envelope / <other>`` for every other transport in ``measures``
        (``names`` gives each transport's short name)."""
        for transport, measure in measures.items():
            if transport != ENVELOPE:
                self.ratio(f"{what}: envelope / {names[transport]}", measures[ENVELOPE],
                           measure)

    def target(self, name: str, source: Measure | Ratio, threshold: float,
               at_least: bool = True, unit: str = "") -> Target:
        """Add a goal for ``source``'s median."""
        created = Target(name, source, threshold, at_least, unit)
        self.targets.append(created)
        return created

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "key": self.key, "number": self.number, "title": self.title,
            "description": self.description,
            "params": self.params, "seconds": round(self.seconds, 1),
            "skipped": self.skipped, "error": self.error, "notes": self.notes,
            "measures": [m.to_json() for m in self.measures],
            "ratios": [r.to_json() for r in self.ratios],
            "targets": [t.to_json() for t in self.targets],
        }


#: A scenario: fills in the result it is given.
ScenarioFunc = Callable[[Context, ScenarioResult], None]


@dataclass(frozen=True)
class Scenario:
    """A registered scenario."""

    key: str
    title: str
    description: str
    run: ScenarioFunc
    sizes: dict[str, float]
    quick_sizes: dict[str, float]
    #: Run only when named in ``--scenarios`` (it starts servers of its own).
    opt_in: bool = False
