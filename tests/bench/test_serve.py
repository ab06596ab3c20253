from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.bench.fake_openai import ITL_S, FakeOpenAIServer
from tokenmill.bench.serve_client import RequestResult
from tokenmill.bench.serve_data import PromptMaker, arrival_offsets, random_chains, shared_prefix_chains
from tokenmill.bench.serve_metrics import parse_slo, summarize
from tokenmill.entrypoints.cli import main

SLACK_S = 1.0  # scheduling noise allowed on a loaded 2-core machine; lower bounds are exact


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as s:
        yield s


def run_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--no-progress", "--output-json", str(out), *argv]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads(out.read_text())
    assert saved["num_prompts"] == printed["num_prompts"]
    return saved


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_summary_math_on_known_results() -> None:
    def res(ttft: float, e2e: float, out: int, itl: list[float], prompt: int = 10) -> RequestResult:
        return RequestResult(start_s=0.0, prompt_len=prompt, output_tokens=out, ttft_s=ttft, itl_s=itl, e2e_s=e2e)

    results = [res(0.1, 0.5, 5, [0.1] * 4), res(0.3, 0.7, 3, [0.2, 0.2]), res(0.2, 0.2, 1, []),
               RequestResult(start_s=0.0, prompt_len=10, error="HTTP 500: boom")]
    s = summarize(results, duration_s=2.0, slo={"ttft_ms": 250, "tpot_ms": 150})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 9
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.5 and s["total_token_throughput"] == 19.5
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["p90_ttft_ms"] == pytest.approx(280)  # linear interpolation between 200 and 300
    # TPOT = (e2e - ttft) / (out - 1): 100 ms and 200 ms; the one-token request has none
    assert s["mean_tpot_ms"] == pytest.approx(150) and s["p99_tpot_ms"] == pytest.approx(199)
    assert s["mean_itl_ms"] == pytest.approx(800 / 6, abs=1e-3) and s["median_itl_ms"] == pytest.approx(100)
    assert s["mean_e2el_ms"] == pytest.approx(1400 / 3, abs=1e-3)
    # goodput: request 1 (ttft 100, tpot 100) and request 3 (ttft 200, no tpot) meet both SLOs
    assert s["good_requests"] == 2 and s["request_goodput"] == 1.0
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert summarize(results, 2.0, {})["request_goodput"] is None


def test_parse_slo() -> None:
    assert parse_slo("ttft_ms=500,tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert parse_slo("ttft:2000 tpot:100") == {"ttft_ms": 2000.0, "tpot_ms": 100.0}  # vLLM's --goodput form
    for bad in ("ttft_ms", "speed=3", "ttft_ms=-1", "ttft_ms=x"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)


def test_arrivals() -> None:
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, math.inf, 0) == [0.0, 0.5, 1.0, 1.5]
    offsets = arrival_offsets(4001, 10.0, 1.0, 7)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.15)  # exponential: std == mean
    with pytest.raises(ValueError):
        arrival_offsets(1, 0.0, 1.0, 0)


def test_random_and_shared_prefix_datasets() -> None:
    maker = PromptMaker(None)
    chains = random_chains(20, "8:12", "3", (10, 50), 0, maker)
    reqs = [c[0] for c in chains]
    assert all(len(c) == 1 for c in chains) and all(r.max_tokens == 3 for r in reqs)
    assert all(isinstance(r.prompt, list) and 8 <= len(r.prompt) <= 12 for r in reqs)
    assert all(10 <= int(t) < 50 for r in reqs for t in r.prompt)
    assert chains == random_chains(20, "8:12", "3", (10, 50), 0, maker)  # deterministic

    chains = shared_prefix_chains(7, "10", "4", (10, 1000), 0, maker, prefix_len=6, num_prefixes=2, turns=3)
    assert [len(c) for c in chains] == [3, 3, 1]
    firsts = [c[0].prompt for c in chains]
    assert firsts[0][:6] == firsts[2][:6] != firsts[1][:6]  # prefix i mod 2
    a, b, c = chains[0]
    assert len(a.prompt) == 10 and b.prompt[:10] == a.prompt and len(b.prompt) == 10 + 4 + 4
    assert c.prompt[: len(b.prompt)] == b.prompt and len(c.prompt) == 18 + 4 + 4
    with pytest.raises(ValueError, match="prefix-len"):
        shared_prefix_chains(2, "4", "4", (10, 100), 0, maker, prefix_len=5, num_prefixes=1, turns=1)
    drawn = shared_prefix_chains(64, "10", "2", (10, 1000), 0, maker, prefix_len=6, num_prefixes=4, turns=1,
                                 prefix_order="random")
    prefixes = [tuple(c[0].prompt[:6]) for c in drawn]
    assert len(set(prefixes)) == 4 and prefixes[0::2] != prefixes[1::2] and len(set(prefixes[0::4])) > 1
    assert drawn == shared_prefix_chains(64, "10", "2", (10, 1000), 0, maker, prefix_len=6, num_prefixes=4,
                                         turns=1, prefix_order="random")  # deterministic
    with pytest.raises(ValueError, match="prefix-order"):
        shared_prefix_chains(2, "4", "4", (10, 100), 0, maker, prefix_len=2, num_prefixes=1, turns=1,
                             prefix_order="shuffled")


def test_serve_against_fake_server(server: FakeOpenAIServer, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"prompt_token_ids": [50, 11, 12], "max_tokens": 4}] * 3 + [
        {"prompt_token_ids": [400, 11], "max_tokens": 4},
        {"prompt_token_ids": [903, 11], "max_tokens": 5},  # no usage chunk: tokens counted from chunks
        {"prompt_token_ids": [900], "max_tokens": 4},  # HTTP 500
        {"prompt_token_ids": [901], "max_tokens": 4},  # connection dropped mid-stream
        {"prompt_token_ids": [902], "max_tokens": 4},  # error event
    ]
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    r = run_bench(tmp_path, capsys, "--base-url", server.url, "--model", "m", "--dataset", "jsonl",
                  "--dataset-path", path, "--warmup", "0", "--slo", "ttft_ms=250", "--save-detailed",
                  "--ignore-eos")
    assert (r["completed"], r["failed"]) == (5, 3)
    assert sum(r["errors"].values()) == 3 and any(e.startswith("HTTP 500: boom") for e in r["errors"])
    assert any("engine died" in e for e in r["errors"])
    d = r["detailed"]
    assert [x["output_tokens"] for x in d[:5]] == [4, 4, 4, 4, 5]
    assert r["total_output_tokens"] == 21 and r["total_input_tokens"] == 3 * 3 + 2 + 2
    for x, ttft_ms in zip(d[:5], [50, 50, 50, 400, 10]):
        assert ttft_ms <= x["ttft_ms"] < ttft_ms + SLACK_S * 1e3
        assert len(x["itl_ms"]) == x["output_tokens"] - 1
        assert x["tpot_ms"] >= ITL_S * 1e3 * 0.5  # the first chunk may arrive late, not the gaps early
        assert x["e2el_ms"] >= x["ttft_ms"] + sum(x["itl_ms"]) - 1
    assert statistics.mean(g for x in d[:5] for g in x["itl_ms"]) >= ITL_S * 1e3 * 0.5
    assert r["good_requests"] == 4  # the 400 ms TTFT misses the 250 ms SLO
    assert r["request_goodput"] == pytest.approx(4 / r["duration"], rel=1e-3)
    assert r["request_throughput"] == pytest.approx(5 / r["duration"], rel=1e-3)
    assert r["output_throughput"] == pytest.approx(21 / r["duration"], rel=1e-3)
    body = server.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True and body["model"] == "m"


def test_serve_random_rate_concurrency_and_model_lookup(server: FakeOpenAIServer, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    server.max_in_flight = 0
    seen = len(server.bodies)
    r = run_bench(tmp_path, capsys, "--base-url", server.url + "/v1", "--num-prompts", "6", "--input-len", "5",
                  "--output-len", "3", "--vocab-low", "10", "--vocab-high", "40", "--request-rate", "100",
                  "--max-concurrency", "2")
    assert (r["completed"], r["failed"], r["model"]) == (6, 0, "fake-model")
    assert server.max_in_flight <= 2
    bodies = server.bodies[seen:]
    assert len(bodies) == 7  # one warm-up request, capped at 16 tokens, then six
    assert all(len(b["prompt"]) == 5 and all(10 <= t < 40 for t in b["prompt"]) for b in bodies)
    assert "ignore_eos" not in bodies[-1]


def test_serve_chat_with_text_prompts(server: FakeOpenAIServer, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "60 hello there", "max_tokens": 3}] * 2)
    r = run_bench(tmp_path, capsys, "--base-url", server.url, "--model", "m", "--endpoint", "/v1/chat/completions",
                  "--dataset", "jsonl", "--dataset-path", path, "--warmup", "0", "--save-detailed")
    assert (r["completed"], r["total_output_tokens"], r["total_input_tokens"]) == (2, 6, 6)
    assert all(x["ttft_ms"] >= 60 for x in r["detailed"])  # the role-only first chunk is no token
    body = server.bodies[-1]
    assert body["messages"] == [{"role": "user", "content": "60 hello there"}]
    assert body["max_completion_tokens"] == 3


def test_serve_user_errors(server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt_token_ids": [900], "max_tokens": 2}])
    base = ["bench", "serve", "--no-progress", "--base-url", server.url, "--model", "m"]
    assert main([*base, "--dataset", "jsonl", "--dataset-path", path]) == 2  # the warm-up request fails
    assert "warm-up request" in capsys.readouterr().err
    assert main([*base, "--endpoint", "/v1/chat/completions", "--vocab-high", "50", "--num-prompts", "1"]) == 2
    assert "needs text prompts" in capsys.readouterr().err
    assert main([*base, "--num-prompts", "1"]) == 2  # no vocabulary size known
    assert "--vocab-high" in capsys.readouterr().err


def test_server_prefix_counters_are_read_by_either_name_and_summed() -> None:
    from tokenmill.bench.serve_server_stats import parse_counters, summarize_counters

    ours = ('tokenmill:prefix_cache_queries_total{model_name="m"} 100.0\n'
            'tokenmill:prefix_cache_hits_total{model_name="m"} 40.0\n'
            'vllm:prefix_cache_queries_total{model_name="m"} 100.0\n'
            'tokenmill:kv_offload_hits_total{model_name="m",tier="memory"} 8.0\n'
            'tokenmill:kv_offload_hits_total{model_name="m",tier="disk"} 2.0\n'
            'tokenmill:num_preemptions_total{model_name="m"} 3.0\n'
            'tokenmill:num_swapped_total{direction="out",model_name="m"} 2.0\n'
            'tokenmill:num_swapped_total{direction="in",model_name="m"} 1.0\n')
    assert parse_counters(ours) == {"queries": 100.0, "hits": 40.0, "tier_memory": 8.0, "tier_disk": 2.0,
                                    "preemptions": 3.0, "swapped": 2.0}
    vllm = 'vllm:prefix_cache_queries_total{model_name="m"} 50.0\nvllm:prefix_cache_hits_total{model_name="m"} 5.0\n'
    assert parse_counters(vllm) == {"queries": 50.0, "hits": 5.0}
    before = [{"queries": 10.0, "hits": 0.0, "tier_memory": 0.0}, {"queries": 0.0, "hits": 0.0}, None]
    after = [{"queries": 110.0, "hits": 40.0, "tier_memory": 30.0}, {"queries": 100.0, "hits": 20.0}, {"queries": 9.0}]
    got = summarize_counters(before, after)  # the third server was not read before: left out
    assert got["server_metrics_read"] == 2 and got["server_prefix_query_tokens"] == 200
    assert got["server_prefix_cache_hit_rate"] == 0.3 and got["server_kv_offload_hit_tokens"] == {"memory": 30}
    assert got["server_hit_rate_with_tiers"] == 0.45
    assert got["server_preemptions"] is None and got["server_swapped_out"] is None
    assert summarize_counters([None], [None]) == {"server_prefix_cache_hit_rate": None}


def test_turn_stats_split_first_and_returning_turns() -> None:
    from tokenmill.bench.serve_metrics import turn_stats

    def res(ttft: float) -> RequestResult:
        return RequestResult(start_s=0.0, ttft_s=ttft, e2e_s=ttft + 1, output_tokens=2, prompt_len=4)

    assert turn_stats([[res(1.0)], [res(2.0)]]) == {}
    got = turn_stats([[res(1.0), res(0.1), res(0.3)], [res(3.0), res(0.2)]])
    assert got["returning_requests"] == 3 and got["median_returning_ttft_ms"] == 200.0
    assert got["median_first_turn_ttft_ms"] == 2000.0
