"""--structured-outputs-config's "backend" -> the grammar backend the engine core gives its scheduler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.structured.backend import GrammarBackend
from tokenmill.structured_outputs_config import StructuredOutputsConfig


def _xgrammar(config: StructuredOutputsConfig, load_tokenizer: Callable[[], Any], vocab_size: int,
              eos_token_ids: Sequence[int], fill_on_step_loop: bool) -> GrammarBackend:
    from tokenmill.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(load_tokenizer, vocab_size, disable_any_whitespace=config.disable_any_whitespace,
                           fill_on_step_loop=fill_on_step_loop, max_json_whitespace=config.max_json_whitespace)


def _guidance(config: StructuredOutputsConfig, load_tokenizer: Callable[[], Any], vocab_size: int,
              eos_token_ids: Sequence[int], fill_on_step_loop: bool) -> GrammarBackend:
    from tokenmill.structured.guidance import GuidanceBackend

    return GuidanceBackend(load_tokenizer, vocab_size, eos_token_ids,
                           disable_any_whitespace=config.disable_any_whitespace,
                           disable_additional_properties=config.disable_additional_properties,
                           fill_on_step_loop=fill_on_step_loop, max_json_whitespace=config.max_json_whitespace)


# every name in structured_outputs_config.GRAMMAR_BACKENDS
GRAMMAR_BACKENDS: dict[str, Callable[[StructuredOutputsConfig, Callable[[], Any], int, Sequence[int], bool],
                                     GrammarBackend]] = {"xgrammar": _xgrammar, "guidance": _guidance}


def create_grammar_backend(config: StructuredOutputsConfig, load_tokenizer: Callable[[], Any], vocab_size: int,
                           eos_token_ids: Sequence[int], fill_on_step_loop: bool = False) -> GrammarBackend:
    """fill_on_step_loop: structured/backend.py's (where the model runs on the CPU)."""
    return GRAMMAR_BACKENDS[config.backend](config, load_tokenizer, vocab_size, eos_token_ids, fill_on_step_loop)
