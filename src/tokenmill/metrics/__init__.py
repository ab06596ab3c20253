"""Serving metrics (Prometheus)."""

from __future__ import annotations

from tokenmill.metrics.prometheus import EngineMetrics

__all__ = ["EngineMetrics"]
