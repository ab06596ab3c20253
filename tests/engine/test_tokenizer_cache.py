"""tokenizer_cache: a checkpoint whose tokenizer class AutoTokenizer chose loads that class directly
the next time, without AutoTokenizer's imports, and only while the checkpoint, the transformers version
and the check of equality hold."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.engine import tokenizer_cache
from tokenmill.engine.input_processor import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpt2_dir(tmp_path: Path, tokenizer_dir: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fixture's BPE tokenizer under a model-specific class (GPT2Tokenizer), which AutoTokenizer
    resolves; the cache in a directory of its own."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "gpt2"
    shutil.copytree(tokenizer_dir, d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    cfg_path.write_text(json.dumps(cfg))
    return str(d)


def entries(tmp_path: Path) -> dict[str, dict[str, str]]:
    path = tmp_path / "cache" / tokenizer_cache.CACHE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def test_second_load_takes_the_remembered_class(gpt2_dir: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    assert tokenizer_cache.cached_class(gpt2_dir) is None
    first = load_tokenizer(gpt2_dir)
    assert type(first).__name__ == "GPT2Tokenizer"
    assert list(entries(tmp_path).values()) == [{"module": type(first).__module__, "name": "GPT2Tokenizer"}]
    assert tokenizer_cache.cached_class(gpt2_dir) is type(first)
    second = load_tokenizer(gpt2_dir)
    auto = AutoTokenizer.from_pretrained(gpt2_dir, local_files_only=True)
    assert tokenizer_cache.same_tokenizer(second, auto)
    text = "def f(x):\n    return x ** 2  # ünïcödé"
    assert second(text)["input_ids"] == auto(text)["input_ids"]


def test_remembered_class_loads_without_torch(gpt2_dir: str, tmp_path: Path) -> None:
    """The point of the cache: the API process's tokenizer no longer imports torch."""
    load_tokenizer(gpt2_dir)
    code = ("import sys; from tokenmill.engine.input_processor import load_tokenizer; "
            f"t = load_tokenizer({gpt2_dir!r}); print(type(t).__name__, 'torch' in sys.modules)")
    env = dict(os.environ, TOKENMILL_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO / "src"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["GPT2Tokenizer", "False"]


def test_an_edited_checkpoint_resolves_afresh(gpt2_dir: str, tmp_path: Path) -> None:
    load_tokenizer(gpt2_dir)
    assert tokenizer_cache.cached_class(gpt2_dir) is not None
    cfg_path = Path(gpt2_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = 77  # a different size as well as a new modification time
    cfg_path.write_text(json.dumps(cfg))
    assert tokenizer_cache.cached_class(gpt2_dir) is None
    assert type(load_tokenizer(gpt2_dir)).__name__ != "GPT2Tokenizer"


def test_other_transformers_version_misses(gpt2_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    load_tokenizer(gpt2_dir)
    monkeypatch.setattr(tokenizer_cache, "_transformers_version", lambda: "0.0.1")
    assert tokenizer_cache.cached_class(gpt2_dir) is None


def test_unusable_entries_are_ignored(gpt2_dir: str, tmp_path: Path) -> None:
    key = tokenizer_cache.checkpoint_key(gpt2_dir)
    path = tmp_path / "cache" / tokenizer_cache.CACHE_FILE
    path.parent.mkdir(parents=True)
    for entry in ({"module": "os", "name": "PathLike"},  # not transformers
                  {"module": "transformers.no_such_module", "name": "X"},
                  {"module": "transformers", "name": "NoSuchTokenizer"}, "garbage"):
        path.write_text(json.dumps({key: entry}))
        assert tokenizer_cache.cached_class(gpt2_dir) is None
        assert type(load_tokenizer(gpt2_dir)).__name__ == "GPT2Tokenizer"
    path.write_text("{not json")
    assert tokenizer_cache.cached_class(gpt2_dir) is None
    assert type(load_tokenizer(gpt2_dir)).__name__ == "GPT2Tokenizer"
    assert tokenizer_cache.cached_class(gpt2_dir) is not None  # rewritten


def test_not_remembered_when_a_direct_load_differs(gpt2_dir: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_cache, "same_tokenizer", lambda a, b: False)
    load_tokenizer(gpt2_dir)
    assert entries(tmp_path) == {}


def test_same_tokenizer_sees_differences(gpt2_dir: str, tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(gpt2_dir, local_files_only=True)
    b = AutoTokenizer.from_pretrained(gpt2_dir, local_files_only=True)
    assert tokenizer_cache.same_tokenizer(a, b)
    assert not tokenizer_cache.same_tokenizer(a, load_tokenizer(tokenizer_dir))  # another class
    b.chat_template = "{{ messages[0]['content'] }}"
    assert not tokenizer_cache.same_tokenizer(a, b)
    c = AutoTokenizer.from_pretrained(gpt2_dir, local_files_only=True)
    c.add_tokens(["ünïcödé"])
    assert not tokenizer_cache.same_tokenizer(a, c)


def test_the_cache_keeps_a_bounded_number_of_entries(gpt2_dir: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_cache, "MAX_ENTRIES", 2)
    dirs = [gpt2_dir]
    for i in range(2):
        d = tmp_path / f"copy{i}"
        shutil.copytree(gpt2_dir, d)
        dirs.append(str(d))
    for d in dirs:
        load_tokenizer(d)
    assert len(entries(tmp_path)) == 2
    assert tokenizer_cache.cached_class(dirs[0]) is None  # the oldest went
    assert tokenizer_cache.cached_class(dirs[2]) is not None
