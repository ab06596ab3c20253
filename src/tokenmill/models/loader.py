"""Builds a model from a checkpoint directory.

The loader only walks the safetensors files (single, sharded, or listed in an index) and hands each
tensor to the model's `load_weights`, which places it (layers own their weight loaders: fused shards,
quantized layouts). The model is built with uninitialised storage in the target dtype on its device;
each tensor is a view of its memory-mapped file, copied into its parameter straight from the page cache
(no buffer in between), and its pages are dropped from the process before the next tensor is read, so
peak RSS stays near the size of the weights plus the largest tensor. Then every linear layer's method
post-processes its weights (e.g. packs them for oneDNN, or rearranges bf16 ones into panels in place).
A layer whose method repacks its weight (oneDNN's packing, or rounding it to integers) is processed as soon as the
layer is loaded: a whole weight is packed from the checkpoint's mapped tensor itself, a fused one (q/k/v, gate/up)
from a `WeightStaging` buffer its shards are copied into and which the next layer of that shape reuses, so the
unpacked weights are never all in memory and no memory is faulted in for them.

A tensor-parallel rank keeps each file's views valid while it reads the file (`keep_views=True`): the layers'
loaders narrow a view to the rank's slice before copying, so only that slice is read from disk and no
rank holds a whole tensor it shards. A pipeline stage reads them the same way: the tensors of the layers
other stages hold find no parameter here and are never read.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.arch import ArchConfig, model_class
from tokenmill.distributed import PipelineParallel, TensorParallel
from tokenmill.layers.linear import LinearBase, LinearMethod, UnquantizedLinearMethod, WeightStaging
from tokenmill.models.interface import ModelOptions

_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot read {index}: {e}") from None
        files = sorted({os.path.join(model_dir, name) for name in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"checkpoint shards listed in the index are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir!r} has no *.safetensors weights (other formats are not supported)")
    return files


def read_header(f: Any, path: str) -> tuple[dict[str, Any], int]:
    raw = f.read(8)
    size = os.fstat(f.fileno()).st_size
    if len(raw) != 8:
        raise ValueError(f"{path} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8:
        raise ValueError(f"{path} is corrupt: header length {n} exceeds the file size")
    try:
        header = json.loads(f.read(n))
    except ValueError:
        raise ValueError(f"{path} is corrupt: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is corrupt: its header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            ok = (info["dtype"] in _ST_DTYPES and 0 <= begin <= end and data_start + end <= size
                  and end - begin == math.prod(info["shape"]) * _ST_DTYPES[info["dtype"]].itemsize)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{path} is corrupt or truncated at tensor {name!r}")
    return header, data_start


def iterate_checkpoint(model_dir: str, keep_views: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, file by file, as a view of the memory-mapped file (copy-on-write). A
    tensor is valid until the next one is asked for: its pages are then dropped from this process (they stay
    in the page cache), so resident memory never holds more than one tensor of the file. With `keep_views` every
    view stays valid while the iteration is at its file (a tensor-parallel rank's loaders narrow a view before
    they copy, and only the slice they read is ever resident)."""
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as f:
            header, data_start = read_header(f, path)
            yield from _mapped_tensors(f, header, data_start, release=not keep_views)


def _mapped_tensors(f: Any, header: dict[str, Any], data_start: int,
                    release: bool) -> Iterator[tuple[str, torch.Tensor]]:
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        return
    # copy-on-write: a loader that wrote into a tensor it was handed would write into pages of its own
    view = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if end == begin:
            yield name, torch.empty(info["shape"], dtype=_ST_DTYPES[info["dtype"]])
            continue
        raw = torch.frombuffer(view, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
        dtype = _ST_DTYPES[info["dtype"]]
        if (data_start + begin) % dtype.itemsize:  # a header not padded to alignment: a copy views as dtype
            raw = raw.clone()
        yield name, raw.view(dtype).view(info["shape"])
        if release and hasattr(mmap, "MADV_DONTNEED"):  # (pages this tensor shares with the next refault)
            first = (data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
            view.madvise(mmap.MADV_DONTNEED, first, data_start + end - first)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                linear_method: LinearMethod | None = None, tp: TensorParallel | None = None,
                pp: PipelineParallel | None = None) -> nn.Module:
    """The registered model class for cfg, its parameters allocated on device and not initialised."""
    cls = model_class(cfg.architecture)
    # Layers skip random init, so this allocates uninitialised storage in the target dtype and touches
    # nothing; the checkpoint then fills it. (Building on the meta device and calling to_empty imports
    # torch's symbolic-shape machinery at start-up.)
    with torch.device(device), _default_dtype(dtype):
        method = linear_method or UnquantizedLinearMethod()
        model: nn.Module = cls(cfg, ModelOptions(dtype, method, getattr(method, "lm_head_method", None),
                                                 tp or TensorParallel(), pp or PipelineParallel()))
    return model.requires_grad_(False)


def load_model(model_dir: str, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
               linear_method: LinearMethod | None = None, tp: TensorParallel | None = None,
               pp: PipelineParallel | None = None) -> nn.Module:
    model = build_model(cfg, dtype, device, linear_method, tp, pp)
    sharded = (tp is not None and tp.size > 1) or (pp is not None and pp.size > 1)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LinearBase)]
    staging = WeightStaging()
    for _, layer in layers:
        layer.staging = staging
    try:
        with torch.no_grad():
            loaded = model.load_weights(iterate_checkpoint(model_dir, keep_views=sharded))  # type: ignore[operator]
            missing = missing_weights(model, loaded)
            if missing:
                raise ValueError(f"checkpoint in {model_dir!r} is missing weights: {missing[:8]}")
            for name, layer in layers:
                try:
                    layer.process()
                except ValueError as e:
                    raise ValueError(f"checkpoint in {model_dir!r}, layer {name}: {e}") from None
    finally:
        for _, layer in layers:
            layer.staging = None
    return model.eval()


def missing_weights(model: nn.Module, loaded: set[str]) -> list[str]:
    """Parameters the checkpoint did not fill: a linear layer's by its own record (shard by shard),
    every other parameter by the names load_weights reported."""
    missing: list[str] = []
    owned: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, LinearBase):
            owned.update(n for n, _ in module.named_parameters(prefix=prefix, recurse=False))
            missing += [f"{prefix}.{n}" for n in module.missing_weights()]
    missing += [n for n, _ in model.named_parameters() if n not in owned and n not in loaded]
    return sorted(missing)
