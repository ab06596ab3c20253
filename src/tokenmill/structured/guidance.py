"""The llguidance grammar backend (--structured-outputs-config '{"backend": "guidance"}'): a request's
constraint as llguidance grammar text, one LLMatcher per request (a copy of the one compiled per grammar),
and a step's rows filled one by one (each call runs without the GIL).

JSON follows the xgrammar backend's rules: any whitespace between JSON tokens, at most max_json_whitespace
characters where that is set, none with disable_any_whitespace; objects take only the properties their schema names (as
xgrammar's strict mode) unless disable_additional_properties is false. EBNF/GBNF grammars go through
llguidance's converter to Lark; llguidance's own Lark syntax is accepted too.

The stop tokens are the tokenizer's EOS tokens in llguidance: the LLTokenizer is made with the engine's
(the checkpoint's eos_token_id and the tokenizer's, as the InputProcessor gives every request). A request
with other stop tokens gets a matcher built for its own (compiled again, on the step loop)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.structured.backend import DEFAULT_CACHE_SIZE, GrammarBackend
from tokenmill.structured.grammar import GrammarKey, guidance_grammar, guidance_message, invalid

if TYPE_CHECKING:
    import llguidance as llg


class GuidanceMatcher:
    """An LLMatcher behind xgrammar's GrammarMatcher interface (structured/backend.py's matchers)."""

    __slots__ = ("inner", "stop_token_ids")

    def __init__(self, inner: llg.LLMatcher, stop_token_ids: list[int]) -> None:
        self.inner = inner
        self.stop_token_ids = stop_token_ids

    def accept_token(self, token: int) -> bool:
        return self.inner.try_consume_tokens([token]) == 1  # (a rejected token leaves the state as it was)

    def is_terminated(self) -> bool:
        """A stop token was taken, or nothing but one may follow (llguidance's stopped state)."""
        return self.inner.is_stopped()

    def is_completed(self) -> bool:
        return self.inner.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)


@dataclass
class _Compiled:
    grammar: str
    matcher: llg.LLMatcher  # at the grammar's start, for the engine's stop tokens; copied per request


class GuidanceBackend(GrammarBackend):
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Sequence[int] = (),
                 cache_size: int = DEFAULT_CACHE_SIZE, compile_threads: int = 1, disable_any_whitespace: bool = False,
                 disable_additional_properties: bool = True, fill_on_step_loop: bool = False,
                 max_json_whitespace: int | None = None) -> None:
        super().__init__(load_tokenizer, vocab_size, cache_size, compile_threads, disable_any_whitespace,
                         fill_on_step_loop, max_json_whitespace)
        self.disable_additional_properties = disable_additional_properties
        self._eos = frozenset(eos_token_ids)  # the checkpoint's; the tokenizer's is added in _setup
        self._hf_tokenizer: Any = None
        self._tokenizers: dict[frozenset[int], llg.LLTokenizer] = {}  # by stop tokens

    def _setup(self) -> None:
        if self._hf_tokenizer is None:  # (only the pool's one thread runs this)
            self._hf_tokenizer = self._load_tokenizer()
            if self._hf_tokenizer.eos_token_id is not None:
                self._eos = self._eos | {int(self._hf_tokenizer.eos_token_id)}
            self._tokenizer(self._eos)

    def _tokenizer(self, stops: frozenset[int]) -> llg.LLTokenizer:
        tokenizer = self._tokenizers.get(stops)
        if tokenizer is None:
            import llguidance.hf

            try:
                tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                         eos_token=sorted(stops) or None)
            except ValueError as e:  # a slow (Python) tokenizer
                raise ValueError(f"structured output: the guidance backend cannot use this tokenizer: {e}") from None
            self._tokenizers[stops] = tokenizer
        return tokenizer

    def _compile_key(self, key: GrammarKey) -> _Compiled:
        import llguidance as llg

        self._setup()
        grammar = guidance_grammar(key, self.disable_additional_properties, self.max_json_whitespace)
        matcher = llg.LLMatcher(self._tokenizer(self._eos), grammar, log_level=0)
        if matcher.is_error():
            raise invalid(key[0], guidance_message(matcher.get_error()))
        return _Compiled(grammar, matcher)

    def _library_matcher(self, compiled: _Compiled, stop_token_ids: list[int]) -> GuidanceMatcher:
        stops = frozenset(stop_token_ids)
        if stops == self._eos:
            return GuidanceMatcher(compiled.matcher.deep_copy(), stop_token_ids)
        import llguidance as llg

        return GuidanceMatcher(llg.LLMatcher(self._tokenizer(stops), compiled.grammar, log_level=0), stop_token_ids)

    def _fill_row(self, matcher: GuidanceMatcher, rows: np.ndarray, index: int) -> None:
        assert rows.flags.c_contiguous and rows.dtype == np.int32
        row_bytes = rows.shape[1] * 4
        matcher.inner.unsafe_compute_mask_ptr(rows.ctypes.data + index * row_bytes, row_bytes)

    def _fill_rows(self, matchers: list[Any], rows: np.ndarray, indices: list[int]) -> None:
        # row by row on the fill thread: llguidance's LLExecutor runs a batch on a thread pool of its own, whose
        # threads compete with the model's compute threads
        for m, i in zip(matchers, indices, strict=True):
            self._fill_row(m, rows, i)
