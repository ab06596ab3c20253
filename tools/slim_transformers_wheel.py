"""Rewrites a transformers wheel with only the model packages tokenmill's GPU check needs: the families of
tests/fixtures.py's MODEL_SPECS, `auto`, and every model package those import. The lent GPU machine takes the
working tree and its wheels under one size limit, and a whole transformers wheel is 13 MB, 11 of them
model packages the check never imports. Usage (tools/gpu_wheels.sh runs it):

    python3 tools/slim_transformers_wheel.py .whl/transformers-X-py3-none-any.whl

The wheel is rewritten in place (its RECORD without the dropped files)."""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3",
            "phi3", "deepseek_v2", "deepseek_v3", "bert", "auto")
MODELS = "transformers/models/"
IMPORT = re.compile(r"from\s+(?:\.\.|transformers\.models\.|\.\.\.models\.)([a-z0-9_]+)")


def model_of(name: str) -> str | None:
    return name[len(MODELS):].split("/")[0] if name.startswith(MODELS) and name.count("/") > 2 else None


def needed(sources: dict[str, str]) -> set[str]:
    """The model packages FAMILIES import, transitively (`from ..other` and `transformers.models.other`)."""
    keep: set[str] = set()
    todo = list(FAMILIES)
    while todo:
        m = todo.pop()
        if m in keep:
            continue
        keep.add(m)
        for name, text in sources.items():
            if model_of(name) == m:
                todo += [d for d in IMPORT.findall(text) if d not in keep]
    return keep


def main(path: str) -> int:
    wheel = Path(path)
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        data = {i.filename: z.read(i) for i in infos}
    sources = {n: b.decode("utf-8", "replace") for n, b in data.items() if n.endswith(".py") and model_of(n)}
    keep = needed(sources) & {model_of(n) for n in data if model_of(n)}
    dropped = {n for n in data if (m := model_of(n)) is not None and m not in keep}
    record = next(n for n in data if n.endswith(".dist-info/RECORD"))
    lines = data[record].decode().splitlines()
    data[record] = ("\n".join(x for x in lines if x.split(",")[0] not in dropped) + "\n").encode()
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for i in infos:
            if i.filename not in dropped:
                z.writestr(i, data[i.filename], compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    print(f"{wheel.name}: kept {len(keep)} model packages ({', '.join(sorted(keep))}), dropped {len(dropped)} files;"
          f" {wheel.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
