"""Benchmarks: kombu-envelope (``envelope://``) side by side with kombu's ``redis://``.

Run every scenario with ``python -m bench``; see ``docs/benchmarks.md``.
"""
