"""`--kv-transfer-config`: vLLM's KVTransferConfig JSON, checked once at start-up (torch-free).

Disaggregated prefill and decode (docs/architecture.md, "KV transfer"): a `kv_producer` computes a
prompt and keeps its KV blocks for a consumer to pull; a `kv_consumer` pulls them into its own paged
cache and decodes; `kv_both` does either, as each request's `kv_transfer_params` asks. `kv_connector`
names the transport in the registry below: tokenmill's own `ZMQConnector` (the default), or a library's
connector, which needs that library installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from typing import Any

from tokenmill.json_arg import json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_CONNECTOR = "ZMQConnector"
# connector name -> the module (under tokenmill.kv_transfer) and class that implement it
CONNECTORS: dict[str, tuple[str, str]] = {DEFAULT_CONNECTOR: ("tokenmill.kv_transfer.zmq_connector", "ZMQConnector")}
# other engines' connectors: name -> the Python package it needs
EXTERNAL_CONNECTORS: dict[str, str] = {
    "LMCacheConnectorV1": "lmcache",
    "LMCacheConnector": "lmcache",
    "MooncakeConnector": "mooncake",
    "MooncakeConnectorV1": "mooncake",
    "NixlConnector": "nixl",
}
# the ZMQ connector's kv_connector_extra_config keys and their defaults
ZMQ_EXTRA_DEFAULTS: dict[str, float] = {
    "transfer_timeout_s": 30.0,  # a consumer's longest wait for the producer's next message
    "hold_timeout_s": 120.0,  # how long a producer keeps a finished prompt's blocks for its consumer
    "blocks_per_step": 64,  # the most blocks a producer reads out for sending in one engine step
}


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's fields; tokenmill reads kv_connector, kv_role, kv_ip, kv_port, engine_id and
    kv_connector_extra_config, and accepts the others (kv_rank, kv_parallel_size, kv_buffer_size,
    kv_buffer_device, kv_connector_module_path) for command lines written for vLLM."""

    kv_role: str
    kv_connector: str = DEFAULT_CONNECTOR
    kv_ip: str = "127.0.0.1"  # the address a producer listens on and advertises to its consumers
    kv_port: int = 14579
    engine_id: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_buffer_size: float = 1e9
    kv_buffer_device: str = "cpu"
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str) -> float:
        return float(self.kv_connector_extra_config.get(key, ZMQ_EXTRA_DEFAULTS[key]))


def resolve_kv_transfer_config(value: dict[str, Any] | str | None) -> KVTransferConfig | None:
    """The config from a dict (Python) or its JSON (the CLI); one ValueError that says what to change."""
    if value is None:
        return None
    raw = json_object(value, "kv_transfer_config")
    known = {f.name for f in fields(KVTransferConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown field(s) {unknown}; known: {sorted(known)}")
    role = raw.get("kv_role")
    if role not in KV_ROLES:
        raise ValueError(f"kv_transfer_config: kv_role must be one of {list(KV_ROLES)}, got {role!r}")
    connector = raw.get("kv_connector") or DEFAULT_CONNECTOR
    check_connector(connector)
    ip = raw.get("kv_ip", "127.0.0.1")
    if not isinstance(ip, str) or not ip:
        raise ValueError(f"kv_transfer_config: kv_ip must be a host name or address, got {ip!r}")
    port = raw.get("kv_port", 14579)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"kv_transfer_config: kv_port must be a TCP port (1-65535), got {port!r}")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"kv_transfer_config: kv_connector_extra_config must be an object, got {extra!r}")
    for key, v in extra.items():
        if key not in ZMQ_EXTRA_DEFAULTS:
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config key {key!r} unknown to {connector}; "
                             f"known: {sorted(ZMQ_EXTRA_DEFAULTS)}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config {key} must be a number > 0, got {v!r}")
    engine_id = raw.get("engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        raise ValueError(f"kv_transfer_config: engine_id must be a string, got {engine_id!r}")
    return KVTransferConfig(**{**raw, "kv_connector": connector, "kv_connector_extra_config": dict(extra)})


def check_connector(name: Any) -> None:
    if name in CONNECTORS:
        return
    if name in EXTERNAL_CONNECTORS:
        package = EXTERNAL_CONNECTORS[name]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"kv_transfer_config: kv_connector {name!r} needs the {package!r} package, which is "
                             f"not installed; install it, or use {DEFAULT_CONNECTOR!r} (tokenmill's ZMQ/TCP connector)")
        raise ValueError(f"kv_transfer_config: kv_connector {name!r}: {package!r} is installed, but tokenmill has "
                         f"no adapter for it yet; use {DEFAULT_CONNECTOR!r}")
    raise ValueError(f"kv_transfer_config: kv_connector {name!r} unknown; choose from "
                     f"{sorted(CONNECTORS) + sorted(EXTERNAL_CONNECTORS)}")
