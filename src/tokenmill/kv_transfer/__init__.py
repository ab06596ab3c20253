"""KV transfer between instances (disaggregated prefill and decode): the connectors, chosen by
`kv_transfer_config.kv_connector` from `tokenmill.kv_transfer_config.CONNECTORS`."""

from __future__ import annotations

import importlib

from tokenmill.kv_transfer.base import KVConnector
from tokenmill.kv_transfer_config import CONNECTORS, KVTransferConfig, check_connector


def create_connector(config: KVTransferConfig) -> KVConnector:
    """The configured connector, bound and ready (ValueError where it cannot start, e.g. a port in use)."""
    check_connector(config.kv_connector)
    module, name = CONNECTORS[config.kv_connector]
    cls = getattr(importlib.import_module(module), name)
    connector: KVConnector = cls(config)
    return connector
