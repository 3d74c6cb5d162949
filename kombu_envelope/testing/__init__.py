"""A private, throw-away ``redis-server`` for tests, benchmarks and the demo."""
