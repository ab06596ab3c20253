"""The proposer seam: after each step's sampling the model runner asks its proposer (None by default)
for draft tokens to follow each request's tokens; they come back to the scheduler in
ModelRunnerOutput.spec_token_ids and are verified the step after (rejection_sampler.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.sampling_params import SamplingParams


@dataclass
class ProposalInput:
    """The requests that took tokens this step, in batch order."""

    req_ids: list[str]
    token_ids: list[list[int]]  # each one's prompt and output tokens, this step's included (read only)
    num_new_tokens: list[int]  # how many each took this step (accepted drafts and one more)
    # the target's final-normed hidden state [num_reqs, hidden] at the position whose logits gave each
    # request's newest token; filled only for a proposer with a truthy `needs_hidden_states`
    hidden_states: Any | None = None
    sampling_params: list[SamplingParams] | None = None  # each request's
    # each request's token sampled at each row it verified (1 + its drafts), past a rejection too
    target_token_ids: list[list[int]] | None = None
    # the most drafts each request may get this step (the adaptive rule's choice; 0: none); None: k each
    max_drafts: list[int] | None = None
    # the step's own seconds (model and sampling, before proposing) where it ran decodes and verification
    # runs only; None: not measured (prefill rows), or not timed
    step_s: float | None = None
    # steps ran since the last proposal that were not asked to propose (overlapped, or over max_batch_size)
    resumed: bool = False


@dataclass(frozen=True)
class ProposerContext:
    """What a method's factory (registry.py) may need from the target's side besides the configs."""

    engine_config: Any  # config.EngineConfig
    device: Any  # torch.device of the target
    ops: Any  # tokenmill's C++ CPU kernels, or None
    # (model, ops, backend) -> that model's fused decode path or None (worker.fused_decode.FusedDecode.create),
    # for a proposer that runs a model of its own; None: no fused path
    fused_decode: Callable[[Any, Any, Any], Any] | None = None
    # a fresh unquantized LinearMethod as the target's float layers take it (bf16-stored weights on an AVX2 CPU),
    # and (model) -> None routing a model's elementwise layers through the fused ops the target's take; None:
    # UnquantizedLinearMethod(ops) and use_cpu_kernels(model, ops)
    linear_method: Callable[[], Any] | None = None
    fuse_elementwise: Callable[[Any], None] | None = None
    # the C++ kernels wherever the target's worker uses them: `ops`, or the same library under a float32 model
    kernels: Any = None


class Proposer(Protocol):
    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        """Draft tokens to follow each request's tokens (a request left out gets none). The scheduler
        cuts them to what the request can still take and the step's token budget allows."""
        ...
