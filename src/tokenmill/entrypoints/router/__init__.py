"""`tokenmill router`: prefix-aware routing over replicas (affinity.py, pool.py, app.py)."""
