"""The fault drill: real workers and a real Redis killed while tasks are published.

Hundreds of Celery tasks (a fifth of them delayed), each with an idempotency key and
an effect recorded in a second Redis that is never killed; prefork workers SIGKILLed
every few seconds and replaced; the broker's redis-server SIGKILLed and restarted
from its AOF while the producer goes on publishing. The drill then counts lost
tasks, duplicate effects and redelivered starts, on ``envelope://`` or on Celery's
stock ``redis://``.

Run it with ``python -m bench drill`` (``--help`` for the sizes); the suite runs a
small one (``tests/test_fault_drill.py``). ``--topology sentinel`` drills a Sentinel
group instead: its primary SIGKILLed, then the next one SIGSTOPped for longer than the
lease, with or without ``--wait-replicas``, the kill striking while a burst of delayed
tasks larger than a promoter batch is promoted (``tests/test_sentinel.py`` runs small ones);
``--topology cluster`` drills a Redis Cluster: a primary SIGKILLed, a replica promoted
with ``CLUSTER FAILOVER`` while a burst of delayed tasks is promoted, a queue's slot moved
and a primary SIGSTOPped (``--topology single|sentinel|cluster``). ``--languages
python,go,node,java`` puts Go, Node.js and Java workers (the interop peers' ``drill``
commands, :mod:`~bench.drill.peers`) in the fleet next to Celery's.
Modules: :mod:`~bench.drill.config` (the sizes), :mod:`~bench.drill.app` (the Celery app
of the workers), :mod:`~bench.drill.ledger` (what the tasks record),
:mod:`~bench.drill.brokers` (what differs between the two brokers),
:mod:`~bench.drill.peers` (the Go, Node.js and Java workers), :mod:`~bench.drill.workers`,
:mod:`~bench.drill.faults`, :mod:`~bench.drill.producer`, :mod:`~bench.drill.tally` (the
figures), :mod:`~bench.drill.run` (one drill) and :mod:`~bench.drill.cli`.
"""
