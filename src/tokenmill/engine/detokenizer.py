"""Incremental detokenization that is right for byte-level BPE merges, SentencePiece
byte-fallback and multi-byte UTF-8: decode a short window of recent ids and emit only
text that is complete (no trailing U+FFFD replacement character)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_CONTEXT = 5  # ids before the read offset decoded with the window, for leading spaces


def fast_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text as tokenizer.decode gives it. For a fast tokenizer that does no clean-up of
    spaces, transformers' decode is the Rust backend's decode behind Python argument handling that
    costs more than the decode itself, and a streamed token costs two calls; call the backend
    directly then (bench/README.md, "Measurements behind the code")."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
    if backend is not None and hasattr(backend, "decode") and not cleans_up:
        return lambda ids: str(backend.decode(ids, skip_special_tokens=skip_special_tokens))
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._decode = fast_decoder(tokenizer, skip_special_tokens)
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append ids; return the text they completed (possibly empty)."""
        new_text = ""
        for tid in token_ids:
            self.ids.append(tid)
            new_text += self._step()
        self.text += new_text
        return new_text

    def _step(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if self.prefix_offset > 64:  # keep the window short
                drop = self.prefix_offset - _CONTEXT
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            return new
        return ""
