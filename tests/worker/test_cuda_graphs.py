"""The CPU-testable parts of the decode CUDA graphs: capture sizes, padding a step to one, the persistent
inputs a padded step leaves (padded rows write and read nothing), which models and backends take graphs,
and the flags that choose them."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata, KVScales
from tokenmill.config import EngineArgs
from tokenmill.layers.attention import PagedAttention
from tokenmill.worker.cuda_graphs import DecodeGraphs, capture_sizes, graphable, padded_size


def test_capture_sizes_and_padding() -> None:
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1] and capture_sizes(4) == [1, 2, 4]
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 17, 20, 21)] == [1, 4, 8, 8, 16, 20, 20, None]


def test_padded_rows_write_nothing_and_see_nothing() -> None:
    graphs = DecodeGraphs(None, max_num_seqs=8, max_model_len=100, block_size=16, device=torch.device("cpu"))
    assert graphs.tables.shape == (8, 7)  # as wide as max_model_len's blocks
    meta = AttentionMetadata(slot_mapping=torch.tensor([17, 40, 3]), query_start_loc=[0, 1, 2, 3],
                             seq_lens=[18, 41, 4], block_tables=[[1, 0], [4, 5, 2], [0]], num_decodes=3,
                             block_size=16)
    get_backend("triton").prepare(meta, torch.device("cpu"))  # as the runner does: the step's tables, lengths
    graphs.slots.fill_(99)
    graphs.lens.fill_(99)
    graphs.tables.fill_(99)
    graphs._fill(3, 4, torch.tensor([5, 6, 7]), torch.tensor([17, 40, 3]), meta)
    assert graphs.slots[:4].tolist() == [17, 40, 3, -1]
    assert graphs.lens[:4].tolist() == [18, 41, 4, 0]
    assert graphs.input_ids[:3].tolist() == [5, 6, 7] and graphs.positions[:4].tolist() == [17, 40, 3, 0]
    # the longest context's 3 blocks wide; the columns past them are left as they were (no row reads them)
    assert graphs.tables[:3, :3].tolist() == [[1, 0, 0], [4, 5, 2], [0, 0, 0]]
    assert graphs.tables[:3, 3:].eq(99).all()
    assert graphs.applies(meta, 3)
    meta.num_decodes = 2  # a step with a prefill chunk runs eagerly
    assert not graphs.applies(meta, 3)


def test_graphs_only_for_the_triton_backend_and_a_float_cache() -> None:
    model = nn.ModuleList([PagedAttention(4, 2, 16, 0.25)])
    assert graphable(model, get_backend("triton"))
    assert not graphable(model, get_backend("sdpa"))  # its decode reads host lists
    model[0].kv_scales = KVScales(torch.zeros(1), torch.zeros(1))
    assert not graphable(model, get_backend("triton"))


def test_enforce_eager_flag_and_triton_needs_a_gpu(llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args([llama_dir, "--enforce-eager"]))
    assert args.create_engine_config().device.enforce_eager
    assert not EngineArgs(model=llama_dir).create_engine_config().device.enforce_eager
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on a CUDA GPU"):
        EngineArgs(model=llama_dir, device="cpu", attention_backend="triton").create_engine_config()


class EagerReplay:
    """A stand-in for a captured graph on the CPU: replay() reruns the padded forward into the same output."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        self.hidden = graphs.forward(size)

    def replay(self) -> None:
        self.hidden.copy_(self.graphs.forward(self.size))


class CpuDecodeGraphs(DecodeGraphs):
    def _capture(self, size: int) -> tuple[EagerReplay, torch.Tensor]:
        graph = EagerReplay(self, size)
        return graph, graph.hidden


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter runs only where no GPU is; on a GPU, "
                    "test_golden.py::test_cuda_triton replays the real graphs")
def test_padded_graph_inputs_give_golden_tokens(model_dirs: dict[str, str]) -> None:
    # every decode step through the graphs' persistent buffers, padded to 1, 2 or 4 rows, with the triton
    # backend (the interpreter here): greedy tokens still equal transformers'
    from tests.models.test_golden import PROMPTS, expected, run
    from tokenmill import LLM

    model_dir = model_dirs["llama-gqa4-untied"]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", attention_backend="triton", block_size=16,
              max_num_seqs=4, device="cpu")
    runner = llm.engine.core.executor.worker.model_runner
    runner.graphs = CpuDecodeGraphs(runner.model, 4, 128, 16, torch.device("cpu"))
    prompts, max_tokens = PROMPTS[:3], [5, 3, 4]
    assert run(llm, prompts, max_tokens) == expected(model_dir, prompts, max_tokens)
    assert sorted(runner.graphs.graphs) == [1, 2, 4]  # 3 rows padded to 4, then 2, then 1
    assert runner.graphs.replays >= 3
