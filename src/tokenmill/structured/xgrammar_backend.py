"""The xgrammar grammar backend (--structured-outputs-config's "xgrammar", the default): xgrammar's
GrammarCompiler, one GrammarMatcher per request, and its batch fill for a step's rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.structured.backend import GrammarBackend
from tokenmill.structured.grammar import GrammarKey, build_grammar

if TYPE_CHECKING:
    import xgrammar as xgr


def _tensor(rows: np.ndarray) -> Any:
    """The int32 array as the torch tensor xgrammar fills (torch is imported here, not at module import:
    the API process imports this module with the engine's and never fills a bitmask)."""
    import torch

    return torch.from_numpy(rows)


class XGrammarBackend(GrammarBackend):
    _compiler: xgr.GrammarCompiler | None = None  # made by the pool, on the first compilation
    _batch: xgr.BatchGrammarMatcher | None = None

    def _setup(self) -> None:
        if self._compiler is None:  # (only the pool's one thread runs this)
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compile_key(self, key: GrammarKey) -> xgr.CompiledGrammar:
        self._setup()
        assert self._compiler is not None
        return self._compiler.compile_grammar(build_grammar(key, self.max_json_whitespace))

    def _library_matcher(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def _fill_row(self, matcher: xgr.GrammarMatcher, rows: np.ndarray, index: int) -> None:
        matcher.fill_next_token_bitmask(_tensor(rows), index)

    def _fill_rows(self, matchers: list[Any], rows: np.ndarray, indices: list[int]) -> None:
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._batch.batch_fill_next_token_bitmask(matchers, _tensor(rows), indices)
