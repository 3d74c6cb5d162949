"""The Redis store every front end calls: clients (one Redis, Sentinel, a Cluster),
scripts and batches of them, publishing, delayed tasks, settling helpers, leases,
idempotency, retry slots and dead letters; failovers ridden out as outages, and the
optional ``WAIT`` for replicas after each write (``replication``).

Each step that touches several keys is one Lua script of ``kombu_envelope/lua/`` on the
keys of one queue (docs/protocol.md, section 2); other languages call the same scripts.
"""
