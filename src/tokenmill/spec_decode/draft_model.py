"""The draft-model proposer: a smaller checkpoint with the target's tokenizer, its own paged KV cache
(planned from its own KVCacheConfig) and its own block allocator, run in the target's step loop.

Each propose() call first brings the draft's cache up to each request's tokens (the first call
prefills the prompt; later ones feed what the target took since), then runs k - 1 more one-token
steps, all requests batched. Under the adaptive rule a call feeds the shortest feed whole and the
others up to FEED_BUDGET tokens in all, shortest first: a request whose feed does not fit gets no
drafts that step and is fed the budget's rest, so that a catch-up of many requests (their prompts;
their tokens after steps the rule kept plain) is spread over steps instead of one step as long as a
prefill of every request. The draft's cache holds its own drafts too: the next call keeps only the
longest prefix that the request's tokens still share (the rejected drafts' slots are rolled back and
rewritten). Greedy requests take the draft's argmax; the others sample the draft's temperature-scaled
distribution q, which the proposer keeps (`draft_probs`) for the sampler's min(1, p/q) rule.

Where the draft model takes the fused decode path (worker/fused_decode.py, built by
ProposerContext.fused_decode: bf16, packed weights, the C++ CPU backend), a call whose feeds are all
short runs as decode rows (each fed token a query of its own over its request's blocks up to it) in one
C++ call, to the argmax tokens where every request is greedy; the prompt's first feed, and every call
without the fused path, runs the model's layer path."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.arch import load_arch_config
from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.config import SpeculativeConfig, bf16_weights_kept
from tokenmill.kv_cache_spec import FullAttentionSpec, KVCacheConfig, plan_kv_cache
from tokenmill.layers import use_cpu_kernels
from tokenmill.layers.attention import attention_layers
from tokenmill.layers.linear import LinearMethod, UnquantizedLinearMethod
from tokenmill.layers.quantization import QuantizedLinearMethod
from tokenmill.models.loader import TORCH_DTYPES, load_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.proposer import ProposalInput, ProposerContext

# the longest feed a fused call takes (a feed is a request's tokens since its last call: one, or the
# accepted drafts and one more); a longer one (the prompt) runs the layer path
FUSED_FEED_MAX = 32
# under the adaptive rule, the most tokens one propose() feeds the draft model (the sum over its requests; its
# shortest feed goes whole whatever its length): a longer catch-up (new requests' prompts; many requests' tokens
# after steps the rule kept plain) spreads over steps
FEED_BUDGET = 256


@dataclass
class _DraftSeq:
    seq: list[int] = field(default_factory=list)  # the tokens whose KV the draft's cache holds, in order
    blocks: list[int] = field(default_factory=list)
    committed: int = 0  # the length of seq known to be the request's own tokens
    generator: torch.Generator | None = None


class DraftBlocks:
    """The draft cache's block ids: a free list, and each request's blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    def ensure(self, st: _DraftSeq, num_tokens: int) -> bool:
        """Blocks for num_tokens positions; False (and nothing taken) where the pool cannot give them."""
        need = -(-num_tokens // self.block_size) - len(st.blocks)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            st.blocks.append(self.free.pop())
        return True

    def release(self, st: _DraftSeq) -> None:
        self.free.extend(reversed(st.blocks))
        st.blocks = []


class DraftModelProposer:
    def __init__(self, k: int, model: Any, backend: AttentionBackend, kv_config: KVCacheConfig,
                 device: torch.device, max_len: int, fused: Any = None) -> None:
        self.k, self.model, self.backend, self.device, self.max_len = k, model, backend, device, max_len
        self.fused = fused  # the draft's fused decode path, or None: every call through the layer path
        # True: the calls the fused path would take run the layer loop over the same decode rows (the
        # reference the tests compare the fused path with)
        self.rows_reference = False
        self.block_size = kv_config.block_size
        self.blocks = DraftBlocks(kv_config.num_blocks, kv_config.block_size)
        self.states: dict[str, _DraftSeq] = {}
        self.draft_probs: dict[str, torch.Tensor] = {}  # [drafts, vocab] q of the random requests' drafts
        # of the last propose(), the seconds its first forward took beyond a one-token one: feeding the draft
        # the tokens it had not seen (adaptive.SpecDecoder leaves them out of the drafted steps' cost)
        self.catchup_s = 0.0
        # the feed budget under the adaptive rule (load sets it; None: every feed whole, each step drafting for all)
        self.feed_budget: int | None = None
        self._one_token_s: float | None = None  # the last propose's fastest forward of one-token feeds

    @classmethod
    def load(cls, spec: SpeculativeConfig, ctx: ProposerContext) -> DraftModelProposer:
        assert spec.model is not None
        cfg = ctx.engine_config
        arch = load_arch_config(spec.model)
        dtype = TORCH_DTYPES[cfg.model.dtype]
        # its quantized method (`quantization`, or its checkpoint's), else the target's float method where the draft's
        # checkpoint may keep bf16 weights as the target's does
        quant = spec.draft_quantization()
        method: LinearMethod
        if quant is not None:
            method = QuantizedLinearMethod(quant, ctx.kernels, ctx.ops)
        elif ctx.linear_method is not None and bf16_weights_kept(arch):
            method = ctx.linear_method()
        else:
            method = UnquantizedLinearMethod(ctx.ops)
        model = load_model(spec.model, arch, dtype, ctx.device, method)
        if ctx.fuse_elementwise is not None:
            ctx.fuse_elementwise(model)
        else:
            use_cpu_kernels(model, ctx.ops)
        backend = get_backend(cfg.attention_backend)
        layers = attention_layers(model)
        specs = {name: layer.kv_cache_spec(cfg.cache.block_size, cfg.model.dtype) for name, layer in layers.items()}
        kv_config = plan_kv_cache(specs, spec.draft_kv_cache_memory)
        for group in kv_config.groups:
            pair = (2,) if isinstance(group.spec, FullAttentionSpec) else ()
            shape = (len(group.layer_names), *pair, kv_config.num_blocks, *group.spec.block_shape())
            tensor = torch.zeros(shape, dtype=getattr(torch, group.spec.dtype), device=ctx.device)
            for i, name in enumerate(group.layer_names):
                layers[name].bind(tensor[i], backend)
        proposer = cls(spec.num_speculative_tokens, model, backend, kv_config, ctx.device,
                       min(arch.max_position_embeddings, cfg.model.max_model_len),
                       ctx.fused_decode(model, ctx.kernels, backend) if ctx.fused_decode is not None else None)
        proposer.feed_budget = FEED_BUDGET if spec.adaptive else None
        return proposer

    @property
    def num_free_blocks(self) -> int:
        return len(self.blocks.free)

    def finished(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            st = self.states.pop(rid, None)
            if st is not None:
                self.blocks.release(st)
            self.draft_probs.pop(rid, None)

    @torch.inference_mode()
    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        self.draft_probs = {}
        wanted: list[tuple[str, _DraftSeq, int, SamplingParams | None, list[int]]] = []
        for i, (rid, tokens) in enumerate(zip(batch.req_ids, batch.token_ids, strict=True)):
            k = self.k if batch.max_drafts is None else batch.max_drafts[i]
            k = min(k, self.max_len - len(tokens))
            if k <= 0:
                continue
            params = batch.sampling_params[i] if batch.sampling_params is not None else None
            st = self.states.get(rid)
            if st is None:
                st = self.states[rid] = _DraftSeq(generator=_generator(params, self.device))
            c = min(st.committed, len(st.seq))
            keep = c + _common_prefix(st.seq[c:], tokens[c:])
            keep = st.committed = min(keep, len(tokens) - 1)  # the last token is fed: its logits give the first draft
            del st.seq[keep:]
            wanted.append((rid, st, k, params, list(tokens[keep:])))
        # the feeds within the step's budget, shortest first (the first one whole): a request whose whole feed does
        # not fit is fed the budget's rest (no drafts this step) or nothing, and catches up over the next steps
        budget = self.feed_budget if self.feed_budget is not None else sum(len(w[4]) for w in wanted)
        active: list[tuple[str, _DraftSeq, int, SamplingParams | None]] = []
        feeds: list[list[int]] = []
        for rid, st, k, params, feed in sorted(wanted, key=lambda w: len(w[4])):
            if len(feed) > budget and active:
                k, feed = 0, feed[:budget]
                if not feed:  # the budget is spent
                    continue
            if not self.blocks.ensure(st, len(st.seq) + len(feed) + max(k - 1, 0)):
                self.blocks.release(st)  # the draft pool is full: this request starts over later
                st.seq, st.committed = [], 0
                continue
            budget = max(budget - len(feed), 0)
            active.append((rid, st, k, params))
            feeds.append(feed)
        drafts: dict[str, list[int]] = {rid: [] for rid, *_ in active}
        probs: dict[str, list[torch.Tensor]] = {}
        # a step after one that verified drafts feeds one or two tokens a request (its last draft and the
        # verified token after it, when every draft was taken): more is catching up
        catching_up = any(len(feed) > 2 for feed in feeds)
        times: list[float] = []
        for _ in range(max((max(k, 1) for _, _, k, _ in active), default=0)):
            if not active:
                break
            greedy = all(params is None or params.greedy for *_, params in active)
            start = time.perf_counter()
            out = self._forward([st for _, st, _, _ in active], feeds, greedy)
            times.append(time.perf_counter() - start)
            nxt: list[tuple[str, _DraftSeq, int, SamplingParams | None]] = []
            feeds = []
            for row, (rid, st, k, params) in enumerate(active):
                if k == 0:  # fed part of its catch-up only
                    continue
                if out.dtype == torch.long:  # the rows' argmax tokens
                    tok = int(out[row])
                else:
                    tok = self._choose(out[row], params, st.generator, probs.setdefault(rid, []))
                drafts[rid].append(tok)
                if len(drafts[rid]) < k:
                    nxt.append((rid, st, k, params))
                    feeds.append([tok])
            active = nxt
        for rid, rows in probs.items():
            if rows:
                self.draft_probs[rid] = torch.stack(rows)
        # the catch-up: the first forward's time beyond a one-token forward (this propose's fastest after the
        # first, else the last one measured; none yet: nothing is set apart)
        if len(times) > 1:
            self._one_token_s = min(times[1:])
        one = self._one_token_s
        self.catchup_s = max(0.0, times[0] - one) if catching_up and times and one is not None else 0.0
        return {rid: d for rid, d in drafts.items() if d}

    def _forward(self, states: list[_DraftSeq], feeds: list[list[int]], greedy: bool) -> torch.Tensor:
        """Feed each state its tokens (appended to its seq); each one's last row's logits, in order, or
        (greedy, where the fused path gives them) its last row's argmax token (int64)."""
        if self.fused is not None and max(map(len, feeds)) <= FUSED_FEED_MAX:
            return self._forward_fused(states, feeds, greedy, self.fused)
        order = sorted(range(len(states)), key=lambda j: len(feeds[j]) != 1)  # decodes first
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl, lens, tables, last = [0], [], [], []
        bs = self.block_size
        for j in order:
            st, feed = states[j], feeds[j]
            start = len(st.seq)
            for p, tok in enumerate(feed, start):
                ids.append(tok)
                pos.append(p)
                slots.append(st.blocks[p // bs] * bs + p % bs)
            st.seq.extend(feed)
            qsl.append(qsl[-1] + len(feed))
            lens.append(len(st.seq))
            tables.append(st.blocks)
            last.append(qsl[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), query_start_loc=qsl,
                                 seq_lens=lens, block_tables=tables,
                                 num_decodes=sum(1 for j in order if len(feeds[j]) == 1), block_size=bs)
        self.backend.prepare(meta, dev)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta)
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(last, device=dev)))
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=dev)] = logits
        return out

    def _forward_fused(self, states: list[_DraftSeq], feeds: list[list[int]], greedy: bool,
                       fused: Any) -> torch.Tensor:
        """_forward with every fed token a decode row, in one fused call."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        tables: list[list[int]] = []
        last: list[int] = []
        bs = self.block_size
        for st, feed in zip(states, feeds, strict=True):
            for p, tok in enumerate(feed, len(st.seq)):
                ids.append(tok)
                pos.append(p)
                slots.append(st.blocks[p // bs] * bs + p % bs)
                lens.append(p + 1)
                tables.append(st.blocks)
            st.seq.extend(feed)
            last.append(len(ids) - 1)
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 query_start_loc=list(range(len(ids) + 1)), seq_lens=lens, block_tables=tables,
                                 num_decodes=len(ids), block_size=bs)
        self.backend.prepare(meta, dev)
        input_ids, positions = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
        pick = last if len(last) < len(ids) else None
        if self.rows_reference:
            hidden = self.model(input_ids, positions, meta)
            return self.model.compute_logits(hidden if pick is None else hidden[pick])
        if greedy and (tokens := fused.greedy(input_ids, positions, meta)) is not None:
            return tokens if pick is None else tokens[pick]
        hidden = fused.forward(input_ids, positions, meta)
        return self.model.compute_logits(hidden if pick is None else hidden[pick])

    @staticmethod
    def _choose(logits: torch.Tensor, params: SamplingParams | None, gen: torch.Generator | None,
                probs: list[torch.Tensor]) -> int:
        if params is None or params.greedy:
            return int(logits.argmax())
        q = (logits.float() / params.temperature).softmax(dim=-1)
        probs.append(q)
        return int(torch.multinomial(q, 1, generator=gen))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _generator(params: SamplingParams | None, device: torch.device) -> torch.Generator | None:
    """A seeded request's drafts come from a generator of its own, so that its output is reproducible."""
    if params is None or params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen
