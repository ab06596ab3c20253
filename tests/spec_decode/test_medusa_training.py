"""tools/train_medusa.py end to end on a tiny random Llama: it trains heads that load as a proposer for
that target, lowers the distillation loss, is seeded, and writes the card with acceptance per head;
and the shipped heads for the demo model fit it."""

from __future__ import annotations

import importlib
import json
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tokenmill.spec_decode.medusa import load_medusa_heads, load_medusa_proposer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool() -> Any:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module("train_medusa")
    finally:
        sys.path.remove(str(REPO / "tools"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root, stdlib = tmp_path_factory.mktemp("text"), Path(sysconfig.get_paths()["stdlib"])
    (root / "train.txt").write_text((stdlib / "textwrap.py").read_text())
    (root / "held.txt").write_text((stdlib / "shlex.py").read_text()[:6000])
    return root / "train.txt", root / "held.txt"


def train(tool: Any, llama_dir: str, texts: tuple[Path, Path], out: Path) -> dict[str, Any]:
    argv = ["--target", llama_dir, "--out", str(out), "--steps", "8", "--seed", "3", "--heads", "3",
            "--batch", "2", "--seq-len", "32", "--lr", "0.01", "--text", str(texts[0]), "--eval-text",
            str(texts[1]), "--eval-positions", "24", "--eval-context", "16"]
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        summary: dict[str, Any] = tool.main(argv)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    return summary


def test_train_medusa_trains_heads_that_load_for_their_target(tool: Any, llama_dir: str, texts: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    summary = train(tool, llama_dir, texts, tmp_path / "a")
    target_config = json.loads((Path(llama_dir) / "config.json").read_text())
    proposer = load_medusa_proposer(SimpleNamespace(model=str(tmp_path / "a"), num_speculative_tokens=3),
                                    SimpleNamespace(**target_config))
    assert proposer.k == 3 and proposer.heads.config.num_heads == 3
    # the residual blocks left their zero start and the distillation loss went down on a training batch
    assert all(head[0].linear.weight.abs().sum() > 0 for head in proposer.heads.heads)
    target = tool.load_target(Path(llama_dir))
    x = tool.demo.windows(tool.token_streams(tool.parse_args(
        ["--target", llama_dir, "--out", "-", "--text", str(texts[0]), "--eval-text", str(texts[1])]))[0], 32)[:4]
    with torch.no_grad():
        hidden = target.model(input_ids=x).last_hidden_state
        logits = target.lm_head(hidden)
        before = tool.distill_loss(tool.new_heads(target, 3, 1), hidden, logits)
        after = tool.distill_loss(load_medusa_heads(tmp_path / "a"), hidden, logits)
    assert (after < before).all(), (before, after)
    metrics = summary["metrics"]
    assert metrics["positions"] == 24 and len(metrics["head_acceptance"]) == 3
    assert all(0.0 <= a <= 1.0 for a in metrics["head_acceptance"])
    lengths = metrics["mean_accepted_length"]
    assert 1.0 <= lengths[0] and lengths == sorted(lengths)  # one more head never takes fewer tokens
    card = (tmp_path / "a" / "README.md").read_text()
    assert "--steps 8 --batch 2 --seed 3" in card and f"| 2 | +3 | {metrics['head_acceptance'][2]:.1%} |" in card
    # seeded: a second run gives the same weights
    train(tool, llama_dir, texts, tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


SHIPPED, DEMO = REPO / "models" / "tokenmill-demo-medusa", REPO / "models" / "tokenmill-demo"


def test_the_shipped_heads_fit_the_demo_model_and_guess_its_greedy_continuation() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert all((SHIPPED / name).is_file() for name in ("config.json", "model.safetensors", "README.md"))
    config = json.loads((DEMO / "config.json").read_text())
    proposer = load_medusa_proposer(SimpleNamespace(model=str(SHIPPED), num_speculative_tokens=4),
                                    SimpleNamespace(**config))
    target = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    assert torch.equal(proposer.heads.lm_head.weight, target.get_output_embeddings().weight)  # the frozen copy
    ids = AutoTokenizer.from_pretrained(DEMO)("HAMLET.\nTo be, or not to be, that is the question:\n",
                                            return_tensors="pt").input_ids
    with torch.no_grad():
        seq = target.generate(ids, max_new_tokens=80, do_sample=False)
        hidden = target.model(input_ids=seq).last_hidden_state[0]
        guesses = proposer.heads(hidden).argmax(-1)  # [heads, positions]: from h_t, tokens t + 2 + i
        untrained = proposer.heads.lm_head(hidden).argmax(-1)  # what zero-initialised heads guess
    start, n = ids.shape[1] - 1, 80 - 5  # positions t whose token t + 1 and four after are generated
    truth = torch.stack([seq[0, start + 2 + i:start + 2 + i + n] for i in range(4)])
    accepted = (guesses[:, start:start + n] == truth).float().mean(1)
    baseline = (untrained[start:start + n] == truth[0]).float().mean()
    assert accepted[0] > max(0.3, baseline + 0.1), (accepted, baseline)
