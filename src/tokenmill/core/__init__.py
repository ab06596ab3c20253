"""The engine core: scheduling, KV block management and prefix caching. Pure Python, no torch."""
