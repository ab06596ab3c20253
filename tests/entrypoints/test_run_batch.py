"""`tokenmill run-batch`'s bad input: one clear line (its batch run and resume are in test_serve_batch.py,
beside a server to compare its answers with)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.entrypoints.cli import main


def test_run_batch_missing_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--model", "m"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("tokenmill: error: cannot read the input file")
    assert len(err.strip().splitlines()) == 1


def test_run_batch_refuses_a_bad_lines_in_flight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    code = main(["run-batch", "-i", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", "m", "--lines-in-flight",
                 "0"])
    assert code == 2 and "--lines-in-flight must be >= 1" in capsys.readouterr().err
