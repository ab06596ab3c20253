"""Kernels live in one place: every C/C++/CUDA source under src/tokenmill is in tokenmill/kernels/, and
no module outside tokenmill.kernels compiles C++ (imports or reaches torch.utils.cpp_extension). Each
checker is also run on a planted violation, so a checker that saw nothing could not pass for a clean tree."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill
from tokenmill.kernels.loader import cpu_sources

PACKAGE = Path(tokenmill.__file__).resolve().parent
KERNELS = PACKAGE / "kernels"
NATIVE_SUFFIXES = {".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh"}
CPP_EXTENSION = "torch.utils.cpp_extension"


def native_sources_outside_kernels(root: Path) -> list[Path]:
    kernels = root / "kernels"
    return sorted(p for p in root.rglob("*")
                  if p.suffix in NATIVE_SUFFIXES and p.is_file() and not p.is_relative_to(kernels))


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of attribute reads on a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def reaches_cpp_extension(source: str) -> bool:
    """Whether Python source imports torch.utils.cpp_extension (any import form, importlib or
    __import__ with a literal name) or reads it as an attribute of torch.utils."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            if any(a.name == CPP_EXTENSION or a.name.startswith(CPP_EXTENSION + ".") for a in node.names):
                return True
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == CPP_EXTENSION or node.module.startswith(CPP_EXTENSION + "."):
                return True
            if node.module == "torch.utils" and any(a.name == "cpp_extension" for a in node.names):
                return True
        elif isinstance(node, ast.Attribute) and node.attr == "cpp_extension":
            return True
        elif isinstance(node, ast.Call) and any(
                isinstance(a, ast.Constant) and isinstance(a.value, str) and "cpp_extension" in a.value
                for a in node.args) and _dotted(node.func) in {"importlib.import_module", "import_module",
                                                                "__import__"}:
            return True
    return False


def modules_compiling_outside_kernels(root: Path) -> list[Path]:
    kernels = root / "kernels"
    return sorted(p for p in root.rglob("*.py")
                  if not p.is_relative_to(kernels) and reaches_cpp_extension(p.read_text(encoding="utf-8")))


def test_no_native_source_outside_kernels() -> None:
    assert native_sources_outside_kernels(PACKAGE) == []


def test_no_module_outside_kernels_compiles_cpp() -> None:
    assert modules_compiling_outside_kernels(PACKAGE) == []


def test_the_loader_is_where_cpp_is_compiled_and_builds_every_kernel_source() -> None:
    # the scan does see the real import, in the one module allowed to have it
    assert reaches_cpp_extension((KERNELS / "loader.py").read_text(encoding="utf-8"))
    found = sorted(KERNELS.rglob("*.cpp"))
    assert found and sorted(Path(p).resolve() for p in cpu_sources()) == found  # none left out of the build
    assert {p.parent.name for p in found} == {"attention", "linear", "elementwise", "sampling", "fused_decode",
                                               "roofline"}


def test_the_checks_catch_a_planted_violation(tmp_path: Path) -> None:
    (tmp_path / "kernels" / "cpu").mkdir(parents=True)
    (tmp_path / "kernels" / "cpu" / "ok.cpp").write_text("")
    (tmp_path / "kernels" / "loader.py").write_text("from torch.utils.cpp_extension import load\n")
    (tmp_path / "attention" / "csrc").mkdir(parents=True)
    (tmp_path / "attention" / "csrc" / "stray.cu").write_text("")
    (tmp_path / "attention" / "stray.h").write_text("")
    (tmp_path / "attention" / "builds.py").write_text("import torch.utils.cpp_extension as ext\n")
    (tmp_path / "clean.py").write_text('"""mentions cpp_extension only in prose"""\nimport torch.utils\n')
    assert native_sources_outside_kernels(tmp_path) == [tmp_path / "attention" / "csrc" / "stray.cu",
                                                        tmp_path / "attention" / "stray.h"]
    assert modules_compiling_outside_kernels(tmp_path) == [tmp_path / "attention" / "builds.py"]


def test_every_import_form_is_caught() -> None:
    for source in ["import torch.utils.cpp_extension",
                   "import torch.utils.cpp_extension as ext",
                   "from torch.utils.cpp_extension import load, load_inline",
                   "from torch.utils import cpp_extension",
                   "import torch\ntorch.utils.cpp_extension.load(name='x', sources=[])",
                   "import importlib\nimportlib.import_module('torch.utils.cpp_extension')",
                   "m = __import__('torch.utils.cpp_extension')"]:
        assert reaches_cpp_extension(source), source
    for source in ["import torch.utils.data", "from torch.utils import checkpoint", "x = 'cpp_extension'",
                   "from .cpp_extension import load"]:
        assert not reaches_cpp_extension(source), source
