from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.entrypoints.server import RemoteServer

FLOAT32_NAME = "tiny"


@pytest.fixture(scope="session")
def float32_server(llama_dir: str) -> Iterator[RemoteServer]:
    """`tokenmill serve` on the tiny Llama in float32 (served as "tiny"), for tests that compare its
    answers with the offline engine's."""
    srv = RemoteServer(llama_dir, "--served-model-name", FLOAT32_NAME, "--dtype", "float32")
    try:
        yield srv
    finally:
        srv.stop()
