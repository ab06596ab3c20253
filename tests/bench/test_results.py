"""How every bench records its result: printed, written (--output-json) or appended (--output-jsonl)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.bench import roofline
from tokenmill.bench.cli import KINDS
from tokenmill.bench.results import ResultSink
from tokenmill.entrypoints.cli import build_parser, main

TINY = ["bench", "roofline", "--threads", "1", "--gib", "0.004", "--n", "32", "--reps", "1"]
PROVENANCE = ("commit", "command", "machine", "timestamp")


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))


def printed(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_two_appends_make_two_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "roofline.jsonl"  # neither the folder nor the file exists yet
    assert main([*TINY, "--output-jsonl", str(out), "--result-name", "first"]) == 0
    first = printed(capsys)
    assert main([*TINY, "--output-jsonl", str(out), "--result-name", "second", "--output-json",
                 str(tmp_path / "second.json")]) == 0
    second = printed(capsys)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert records == [first, second]
    assert [r["result"] for r in records] == ["first", "second"]
    assert list(records[0])[0] == "result"  # the name leads the line, for grep
    for r in records:
        assert set(PROVENANCE) <= set(r) and r["machine"]["cores"] and r["timestamp"]  # commit: None off git
        assert r["command"].startswith("tokenmill") and r["bench"] == "roofline" and r["mem_read_GBps"] > 0
    assert json.loads((tmp_path / "second.json").read_text(encoding="utf-8")) == second  # both outputs at once


def test_no_result_name_no_result_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.jsonl"
    assert main([*TINY, "--output-jsonl", str(out)]) == 0
    (line,) = out.read_text(encoding="utf-8").splitlines()
    assert "result" not in json.loads(line) and json.loads(line) == printed(capsys)


@pytest.mark.parametrize("flag", ["--output-jsonl", "--output-json"])
@pytest.mark.parametrize("where", ["under-a-file", "a-directory"])
def test_unwritable_output_is_one_error_line_before_the_run(
        flag: str, where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "plain").write_text("not a folder\n")
    path = tmp_path / "plain" / "r.jsonl" if where == "under-a-file" else tmp_path

    def no_measuring(*args: Any, **kwargs: Any) -> dict[str, float]:
        raise AssertionError("the bench ran although its output file cannot be written")

    monkeypatch.setattr(roofline, "measure", no_measuring)
    assert main([*TINY, flag, str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    reason = "is not a directory" if where == "under-a-file" else "is a directory"
    assert line.startswith(f"tokenmill: error: {flag} {path}: ") and line.endswith(reason)


def test_a_write_that_fails_late_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("")
    sink = ResultSink(jsonl_path=str(tmp_path / "plain" / "r.jsonl"))
    with pytest.raises(ValueError, match=r"^--output-jsonl .*r\.jsonl: cannot write it"):
        sink.write({"bench": "x"})


REQUIRED = {"throughput": ["--model", "m"], "latency": ["--model", "m"], "serve": [], "roofline": [], "embed": []}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_bench_takes_the_output_options(kind: str) -> None:
    args = build_parser().parse_args(["bench", kind, *REQUIRED[kind], "--output-json", "a.json",
                                      "--output-jsonl", "b.jsonl", "--result-name", "n"])
    assert ResultSink.from_args(args) == ResultSink("a.json", "b.jsonl", "n")
