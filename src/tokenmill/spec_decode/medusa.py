"""Medusa heads: extra decoding heads on the target's last hidden state (Medusa-1, chain proposal).

Head i (0-based) reads the target's final-normed hidden state h_t, the one whose logits produced the
newest token x_{t+1}, and guesses the token i + 1 places after it, x_{t+2+i}:

    z_i = h_t, then per residual block z_i = z_i + SiLU(W z_i + b);    logits_i = lm_head(z_i)

Every head shares one lm_head, a frozen copy of the target's (its tied embedding for the demo
model), stored once in the heads' checkpoint so the proposer needs nothing of the target at run
time. The proposal for a request is the chain of the heads' argmaxes, verified by the runner as any
other drafts (rejection_sampler.py).

Where the target's hidden states are bf16 on the CPU and tokenmill's C++ kernels are loaded, the heads
(one residual block each) run packed (`PackedHeads`): the k heads' blocks read the same h_t, so their
weights are stacked into one packed [k * hidden, hidden] layer, and the lm_head takes the k rows in one
packed call: two GEMV calls and an argmax a step, against the module's per-head calls (the reference
the tests compare with). Under a float32 target on a CPU without oneDNN's bf16 path (AVX2) the same two
layers keep bf16-exact weights in bf16 and the widening GEMV multiplies them (half the bytes of the module's
float32 weights, and the C++ argmax).

The checkpoint is a directory in Hugging Face layout: ``config.json`` (``model_type`` "medusa",
``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` residual blocks per head) and
``model.safetensors`` with ``heads.{i}.{j}.weight`` / ``heads.{i}.{j}.bias`` (head i's block j) and
``lm_head.weight``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.spec_decode.proposer import ProposalInput

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_hidden_layers: int = 1  # residual blocks per head

    def to_json(self) -> dict[str, Any]:
        return {"architectures": ["MedusaHeads"], "model_type": "medusa", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> MedusaConfig:
        if data.get("model_type") != "medusa":
            raise ValueError(f"{where}: model_type is {data.get('model_type')!r}, not 'medusa'")
        values = {}
        for name in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
            values[name] = value
        return cls(**values)


class ResBlock(nn.Module):
    """h + SiLU(W h + b); W starts at zero, so a new head begins as the target's own next-token head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.silu(self.linear(h))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.num_hidden_layers)))
            for _ in range(config.num_heads))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits [num_heads, *hidden.shape[:-1], vocab] of the first num_heads heads (all by default)."""
        heads = self.heads[:num_heads] if num_heads is not None else self.heads
        return self.lm_head(torch.stack([head(hidden) for head in heads]))

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """The weights under the checkpoint's names (``heads.{i}.{j}.weight``, ``lm_head.weight``)."""
        return {name.replace(".linear.", "."): t for name, t in self.state_dict().items()}

    def save(self, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(json.dumps(
            {**self.config.to_json(), "dtype": str(dtype).removeprefix("torch.")}, indent=2) + "\n")
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.state_for_checkpoint().items()}
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def load_medusa_heads(path: str | Path) -> MedusaHeads:
    """The heads stored at ``path`` (float32 in memory), or a ValueError that says what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        data = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"medusa heads: cannot read {path / CONFIG_FILE}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"medusa heads: {path / CONFIG_FILE} is not a JSON object")
    heads = MedusaHeads(MedusaConfig.from_json(data, f"medusa heads {path}"))
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError) as e:
        raise ValueError(f"medusa heads: cannot read {path / WEIGHTS_FILE}: {e}") from e
    expected = heads.state_for_checkpoint()
    if tensors.keys() != expected.keys():
        raise ValueError(f"medusa heads: {path / WEIGHTS_FILE} has tensors {sorted(tensors)}, "
                         f"its config.json asks for {sorted(expected)}")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"medusa heads: {name} in {path / WEIGHTS_FILE} has shape {tuple(t.shape)}, "
                             f"its config.json asks for {tuple(expected[name].shape)}")
    with torch.no_grad():
        for name, t in expected.items():
            t.copy_(tensors[name])
    return heads.eval()


class PackedHeads:
    """The first k heads of one residual block each, as two bf16 layers: the blocks' stacked
    [k * hidden, hidden] weights (every head's block reads the same hidden state) and the lm_head; packed for
    oneDNN over bf16 hidden states (`dtype`), or kept in bf16 for the widening GEMV over float32 ones."""

    def __init__(self, heads: MedusaHeads, k: int, ops: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        from tokenmill.layers.linear import UnquantizedLinearMethod, packed_linear

        # packed, with the GEMV where its probe passes; or bf16-stored, widened by ops.bf16w_gemv
        method = (UnquantizedLinearMethod(ops) if dtype == torch.bfloat16
                  else UnquantizedLinearMethod(weight_dtype=torch.bfloat16, widen_ops=ops))
        blocks = _blocks(heads, k)
        weight = torch.cat([b.weight.detach() for b in blocks]).to(torch.bfloat16)
        bias = torch.cat([b.bias.detach() for b in blocks]).to(torch.bfloat16)
        self.blocks = packed_linear(weight, bias, method=method)
        self.lm_head = packed_linear(heads.lm_head.weight.detach().to(torch.bfloat16), None, method=method)
        self.k, self.hidden_size, self.ops, self.dtype = k, heads.config.hidden_size, ops, dtype

    @classmethod
    def create(cls, heads: MedusaHeads, k: int, ops: Any, widen_ops: Any = None) -> PackedHeads | None:
        """The packed heads over bf16 hidden states (with `ops`, where oneDNN packs bf16), else over float32 ones
        (with `widen_ops`, where the widening GEMV is built and every weight is bf16-exact), or None where neither
        applies (or the heads are deeper than one block)."""
        from tokenmill.layers.linear import packing_available

        if heads.config.num_hidden_layers != 1:
            return None
        if ops is not None and packing_available():
            return cls(heads, k, ops)
        if widen_ops is not None and int(widen_ops.bf16w_gemv_max_rows()) > 0 and _bf16_exact(heads, k):
            return cls(heads, k, widen_ops, torch.float32)
        return None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[k, rows, vocab] bf16 logits of the k heads, as MedusaHeads.forward(hidden, k) computes them."""
        rows = hidden.shape[0]
        z = torch.nn.functional.silu(self.blocks(hidden).view(rows, self.k, self.hidden_size)).add_(hidden[:, None])
        return self.lm_head(z.transpose(0, 1).reshape(self.k * rows, self.hidden_size)).view(self.k, rows, -1)

    def drafts(self, hidden: torch.Tensor) -> list[list[int]]:
        """Each row's chain of the k heads' argmaxes [rows][k]."""
        logits = self.logits(hidden)
        ids: list[int] = self.ops.argmax_rows(logits.view(-1, logits.shape[-1])).tolist()
        rows = hidden.shape[0]
        return [ids[i::rows] for i in range(rows)]


def _blocks(heads: MedusaHeads, k: int) -> list[nn.Linear]:
    """The first k heads' (only) residual blocks' linear layers."""
    return [head[0].linear for head in list(heads.heads)[:k]]  # type: ignore[index]


def _bf16_exact(heads: MedusaHeads, k: int) -> bool:
    """Whether the first k heads' weights and the lm_head are bf16 values (a bf16 checkpoint's), so that storing
    them in bf16 changes nothing."""
    tensors = [heads.lm_head.weight] + [t for b in _blocks(heads, k) for t in (b.weight, b.bias)]
    return all(torch.equal(t, t.to(torch.bfloat16).to(t.dtype)) for t in tensors)


class MedusaProposer:
    """Drafts the chain of the first k heads' argmaxes from each request's newest hidden state."""

    needs_hidden_states = True

    def __init__(self, heads: MedusaHeads, num_speculative_tokens: int, ops: Any = None,
                 widen_ops: Any = None) -> None:
        if not 1 <= num_speculative_tokens <= heads.config.num_heads:
            raise ValueError(f"num_speculative_tokens is {num_speculative_tokens}; these medusa heads "
                             f"propose 1 to {heads.config.num_heads} tokens")
        self.heads = heads.requires_grad_(False)
        self.k = num_speculative_tokens
        # the packed path for bf16 (or, widened, float32) hidden states on the CPU (None: the module for every step)
        self.packed = PackedHeads.create(self.heads, self.k, ops, widen_ops)

    @torch.inference_mode()
    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        hidden = getattr(batch, "hidden_states", None)
        if hidden is None or not batch.req_ids:
            return {}
        if hidden.shape != (len(batch.req_ids), self.heads.config.hidden_size):
            raise ValueError(f"medusa: hidden states of shape {tuple(hidden.shape)} for {len(batch.req_ids)} "
                             f"requests of hidden size {self.heads.config.hidden_size}")
        # the adaptive rule's cap per request (0: no drafts), where the runner gives one
        limits: list[int] = getattr(batch, "max_drafts", None) or [self.k] * len(batch.req_ids)
        rows = [i for i, limit in enumerate(limits) if limit > 0]
        if not rows:
            return {}
        if len(rows) < len(limits):
            hidden = hidden[torch.tensor(rows, device=hidden.device)]
        if self.packed is not None and hidden.dtype == self.packed.dtype and hidden.device.type == "cpu":
            chains = self.packed.drafts(hidden.contiguous())
            return {batch.req_ids[i]: d[:limits[i]] for i, d in zip(rows, chains, strict=True)}
        weight = self.heads.lm_head.weight
        if weight.dtype != hidden.dtype or weight.device != hidden.device:
            self.heads.to(device=hidden.device, dtype=hidden.dtype)
        k = min(self.k, max(limits))
        drafts = self.heads(hidden, k).argmax(dim=-1).t().tolist()  # [len(rows), k]
        return {batch.req_ids[i]: d[:limits[i]] for i, d in zip(rows, drafts, strict=True)}


def load_medusa_proposer(spec_config: Any, target_model_config: Any, ops: Any = None,
                         widen_ops: Any = None) -> MedusaProposer:
    """The proposer for ``spec_config`` (``.model``: the heads' directory, ``.num_speculative_tokens``),
    checked against the target's model config (its ``hidden_size`` and ``vocab_size``: the HF config or
    tokenmill's ArchConfig); ops: tokenmill's C++ CPU kernels, for the packed path; widen_ops: the same kernels
    under a float32 target, for its widened form."""
    path = getattr(spec_config, "model", None)
    if not path:
        raise ValueError("speculative_config: method 'medusa' needs 'model', the directory of the medusa heads")
    heads = load_medusa_heads(path)
    cfg = heads.config
    for name in ("hidden_size", "vocab_size"):
        target = getattr(target_model_config, name, None)
        if getattr(cfg, name) != target:
            raise ValueError(f"medusa heads at {path} have {name} {getattr(cfg, name)}, the target model's is "
                             f"{target}: train heads for this target (tools/train_medusa.py)")
    return MedusaProposer(heads, int(spec_config.num_speculative_tokens), ops, widen_ops)
