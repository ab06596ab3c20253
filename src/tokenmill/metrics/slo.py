"""`--slo ttft_ms=..,tpot_ms=..`: the service-level objective a request meets when its time to first
token and its time per output token (every sequence's, after the first token) are both within bounds;
goodput is the rate of requests that meet it (DistServe's definition)."""

from __future__ import annotations

from dataclasses import dataclass

SLO_KEYS = ("ttft_ms", "tpot_ms")


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def parse(cls, spec: str | None) -> SLO | None:
        """'ttft_ms=500,tpot_ms=50' (either may be left out); None for None or ''."""
        if not spec:
            return None
        bounds: dict[str, float] = {}
        for part in spec.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"--slo {spec!r}: expected comma-separated {'=..,'.join(SLO_KEYS)}=.. "
                                 f"(milliseconds), got {part.strip()!r}")
            try:
                bounds[key] = float(value)
            except ValueError:
                raise ValueError(f"--slo {spec!r}: {key} must be a number of milliseconds, got {value!r}") from None
            if not bounds[key] > 0:
                raise ValueError(f"--slo {spec!r}: {key} must be positive")
        ttft, tpot = bounds.get("ttft_ms"), bounds.get("tpot_ms")
        return cls(None if ttft is None else ttft / 1e3, None if tpot is None else tpot / 1e3)

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """A request that never produced a token misses a TTFT bound; one with a single token has no TPOT."""
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s

    def describe(self) -> str:
        parts = [f"ttft_ms={self.ttft_s * 1e3:g}" if self.ttft_s is not None else "",
                 f"tpot_ms={self.tpot_s * 1e3:g}" if self.tpot_s is not None else ""]
        return ",".join(p for p in parts if p)
