from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def draft_dir(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A draft for the tiny Llama: its embedding, first layer, norm and head (one layer of two), so
    that it agrees with the target now and then; the target's tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("draft"))
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(out)
    for f in os.listdir(llama_dir):
        if f.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(llama_dir, f), out)
    return out
