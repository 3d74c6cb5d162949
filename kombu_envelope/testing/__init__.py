"""Private, throw-away ``redis-server`` processes (one, or a Redis Cluster) for tests,
benchmarks and the demo."""
