"""The router's replicas and how one is chosen for a request (no I/O here: the app probes and
proxies, this decides).

Policies:
- `prefix` (default): the healthy replica holding the longest leading run of the prompt's chunks,
  unless its load is over the bound on imbalance (more than `balance_abs` requests in flight above
  the least loaded replica and more than `balance_rel` times its load); then the least loaded. A
  prompt that no replica holds goes to the replica holding the fewest prefix chunks (ties: the
  least loaded), under the same bound, so that distinct prefixes spread evenly over the replicas'
  caches instead of following whichever replica happened to be idle when each first arrived.
- `least_load`: fewest requests in flight (ties: fewest routed so far).
- `round_robin`: each healthy replica in turn.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Collection, Sequence

from tokenmill.entrypoints.router.affinity import PrefixAffinity

POLICIES = ("prefix", "least_load", "round_robin")


@dataclasses.dataclass
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0
    routed: int = 0
    failures: int = 0  # probes or requests failed in a row
    last_ok: float = 0.0
    models: list[str] = dataclasses.field(default_factory=list)


class ReplicaPool:
    def __init__(self, policy: str = "prefix", balance_abs: int = 8, balance_rel: float = 1.5,
                 max_failures: int = 3, affinity: PrefixAffinity | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError("--balance-abs must be >= 0 and --balance-rel >= 1")
        if max_failures < 1:
            raise ValueError("--max-failures must be >= 1")
        self.policy = policy
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_failures = max_failures
        self.affinity = affinity or PrefixAffinity()
        self.replicas: dict[str, Replica] = {}
        self._turn = itertools.count()
        self.prefix_routed = 0  # requests sent to a replica because it held their prefix

    def add(self, url: str) -> Replica:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a replica URL starts with http:// or https://, not {url!r}")
        return self.replicas.setdefault(url, Replica(url))

    def remove(self, url: str) -> None:
        self.replicas.pop(url.rstrip("/"), None)
        self.affinity.forget(url.rstrip("/"))

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def mark_ok(self, replica: Replica, now: float | None = None) -> None:
        if not replica.healthy:
            self.affinity.forget(replica.url)  # back from the dead: its prefix cache may be empty
        replica.healthy, replica.failures = True, 0
        replica.last_ok = time.monotonic() if now is None else now

    def mark_failed(self, replica: Replica) -> None:
        """One failed health probe; at max_failures in a row the replica leaves routing (it stays
        registered, and comes back at its next good probe)."""
        replica.failures += 1
        if replica.failures >= self.max_failures:
            replica.healthy = False

    def mark_dead(self, replica: Replica) -> None:
        """The connection to it was refused or reset: out of routing at once."""
        replica.healthy = False
        replica.failures = max(replica.failures, self.max_failures)

    def choose(self, hashes: Sequence[int], exclude: Collection[str] = ()) -> Replica | None:
        candidates = [r for r in self.healthy() if r.url not in exclude]
        if not candidates:
            return None
        least = min(candidates, key=lambda r: (r.in_flight, r.routed))
        if self.policy == "round_robin":
            return candidates[next(self._turn) % len(candidates)]
        if self.policy == "least_load" or not hashes:
            return least
        matches = self.affinity.matches(hashes)
        held = [r for r in candidates if matches.get(r.url)]
        if held:
            best = max(held, key=lambda r: (matches[r.url], -r.in_flight))
        else:
            best = min(candidates, key=lambda r: (self.affinity.held(r.url), r.in_flight, r.routed))
        overloaded = (best.in_flight > least.in_flight + self.balance_abs
                      and best.in_flight > least.in_flight * self.balance_rel)
        if overloaded:
            return least
        self.prefix_routed += bool(held)
        return best

    def started(self, replica: Replica, hashes: Sequence[int]) -> None:
        replica.in_flight += 1
        replica.routed += 1
        self.affinity.record(hashes, replica.url)

    def finished(self, replica: Replica) -> None:
        replica.in_flight = max(0, replica.in_flight - 1)
