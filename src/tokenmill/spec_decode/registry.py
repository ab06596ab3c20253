"""Speculative-decoding methods by name (config.SPECULATIVE_METHODS): each builds its Proposer from the
SpeculativeConfig, the target's model config and the target's runner context. Factories import their
method's module lazily, so a method's dependencies load only when it is chosen."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tokenmill.config import SpeculativeConfig
from tokenmill.spec_decode.proposer import Proposer, ProposerContext

Factory = Callable[[SpeculativeConfig, ProposerContext], Proposer]


def _ngram(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    from tokenmill.spec_decode.ngram import NgramProposer

    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def _lookahead(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    from tokenmill.spec_decode.lookahead import LookaheadProposer

    return LookaheadProposer(spec.num_speculative_tokens, spec.lookahead_ngram, spec.lookahead_pool_size)


def _draft_model(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    from tokenmill.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer.load(spec, ctx)


def _medusa(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    try:
        medusa = importlib.import_module("tokenmill.spec_decode.medusa")
    except ModuleNotFoundError as e:
        if e.name != "tokenmill.spec_decode.medusa":
            raise
        raise ValueError("speculative_config: method 'medusa' is not available in this build "
                         "(tokenmill.spec_decode.medusa is missing)") from None
    widen_ops = ctx.kernels if ctx.ops is None else None  # a float32 target on a CPU: the heads' widened form
    proposer: Proposer = medusa.load_medusa_proposer(spec, ctx.engine_config.model.arch, ctx.ops, widen_ops)
    return proposer


PROPOSERS: dict[str, Factory] = {"ngram": _ngram, "lookahead": _lookahead, "draft_model": _draft_model,
                                 "medusa": _medusa}


def create_proposer(spec: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    factory = PROPOSERS.get(spec.method)
    if factory is None:
        raise ValueError(f"speculative_config: method {spec.method!r} has no proposer; known: {sorted(PROPOSERS)}")
    return factory(spec, ctx)
