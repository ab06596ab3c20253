"""Fold one-file-per-run JSON results into one JSON-Lines file per benchmark kind.

Usage (from the repository root)::

    .venv/bin/python tools/fold_results.py [bench/results]

Each `DATE-DEVICE-KIND-....json` in the folder becomes one line of `KIND.jsonl` there (kinds: see KINDS),
the file's object on one line behind a leading `"result"` key that holds the file name without `.json`,
which is how bench/README.md cites it. Lines are appended in file-name order. Nothing is written unless
every file maps to a kind, parses as a JSON object and has a name no line of its kind already has; each
line is then read back and compared with its file, and only then are the JSON files deleted (stage the
deletions with `git add -A bench/results`). Prints one line per kind: the file and the lines it gained.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from typing import Any

KINDS = [  # (pattern of the file name after its date, the .jsonl file it folds into); first match wins
    (r"cpu-throughput-", "throughput"),
    (r"cpu-vllm-throughput-", "vllm-throughput"),
    (r"cpu-hf-throughput-", "hf-throughput"),
    (r"cpu-latency-", "latency"),
    (r"cpu-llamacpp-latency-", "llamacpp-latency"),
    (r"cpu-serve-", "serve"),  # tokenmill's and vLLM's servers, by tokenmill's client or vLLM's
    (r"cpu-roofline-", "roofline"),
    (r"(h100|h200|gpu)-throughput-", "gpu-throughput"),
]
DATE = r"\d{4}-\d\d-\d\d-"


def kind_of(name: str) -> str | None:
    for pattern, kind in KINDS:
        if re.match(DATE + pattern, name):
            return kind
    return None


def names_in(path: str) -> set[str]:
    if not os.path.exists(path):
        return set()
    with open(path, encoding="utf-8") as f:
        return {json.loads(line).get("result") for line in f if line.strip()}


def plan(folder: str) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """kind -> [(result name, object)] for every JSON file of `folder`; SystemExit on any problem."""
    by_kind: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".json")):
        name, kind = file[: -len(".json")], kind_of(file)
        if kind is None:
            sys.exit(f"fold_results: {file}: no kind matches its name; add a row to KINDS")
        with open(os.path.join(folder, file), encoding="utf-8") as f:
            obj = json.load(f)
        if not isinstance(obj, dict) or "result" in obj:
            sys.exit(f"fold_results: {file}: not a JSON object, or it already has a 'result' key")
        by_kind[kind].append((name, obj))
    for kind, rows in by_kind.items():
        clash = names_in(os.path.join(folder, f"{kind}.jsonl")) & {name for name, _ in rows}
        if clash:
            sys.exit(f"fold_results: {kind}.jsonl already holds {sorted(clash)}")
    return by_kind


def count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def fold(folder: str) -> None:
    by_kind = plan(folder)
    for kind, rows in sorted(by_kind.items()):
        path = os.path.join(folder, f"{kind}.jsonl")
        before = count_lines(path)
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"result": name, **obj}) + "\n" for name, obj in rows)
        with open(path, encoding="utf-8") as f:
            back = {(rec := json.loads(line))["result"]: rec for line in f if line.strip()}
        if count_lines(path) != before + len(rows):
            sys.exit(f"fold_results: {kind}.jsonl did not gain one line per file; nothing deleted")
        for name, obj in rows:  # the same keys in the same order, the same values
            if list(back[name].items()) != [("result", name), *obj.items()]:
                sys.exit(f"fold_results: {name} did not read back as it was written; nothing deleted")
        print(f"{kind}.jsonl: +{len(rows)} lines ({before + len(rows)} in all)")
    for rows in by_kind.values():
        for name, _ in rows:
            os.remove(os.path.join(folder, f"{name}.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", default="bench/results")
    fold(parser.parse_args().folder)


if __name__ == "__main__":
    main()
