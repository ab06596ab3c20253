"""Builds a model from a checkpoint directory.

The model is built with uninitialised storage in the target dtype, and each safetensors tensor
is read straight from the file into its parameter (or its slice of a fused parameter). No second copy of the weights and no mmap of whole files: peak RSS
stays near the size of the weights, plus one tensor when a dtype cast is needed.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.arch import ArchConfig, model_class

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


def _read_into(f: Any, offset: int, nbytes: int, dest: torch.Tensor, src_dtype: torch.dtype,
               shape: list[int], path: str) -> None:
    if list(dest.shape) != shape:
        raise ValueError(f"{path}: tensor shape {shape} does not match the model's {list(dest.shape)}")
    f.seek(offset)
    direct = dest.dtype == src_dtype and dest.device.type == "cpu" and dest.is_contiguous()
    buf = dest.view(torch.uint8) if direct else torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(buf.reshape(-1).numpy())  # type: ignore[arg-type]
    if f.readinto(view) != nbytes:
        raise ValueError(f"{path} is truncated")
    if not direct:
        dest.copy_(buf.view(src_dtype).view(shape))


def _fused_slice(param: torch.Tensor, cfg: ArchConfig, shard: str) -> torch.Tensor:
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    ranges = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv),
              "gate_proj": (0, i), "up_proj": (i, 2 * i)}
    start, end = ranges[shard]
    return param[start:end]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_dir: str, cfg: ArchConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    cls = model_class(cfg.architecture)
    # Layers skip random init, so this allocates uninitialised storage in the target dtype and
    # touches nothing; the checkpoint then fills it. (Building on the meta device and calling
    # to_empty imports torch's symbolic-shape machinery: seconds and ~100 MB at start-up.)
    with torch.device(device), _default_dtype(dtype):
        model = cls(cfg, dtype)
    model.requires_grad_(False)
    params = dict(model.named_parameters())
    expected = {(n, s) for n, s in _expected_shards(model, cfg)}
    loaded: set[tuple[str, str | None]] = set()
    with torch.no_grad():
        for path in checkpoint_files(model_dir):
            with open(path, "rb") as f:
                header, data_start = read_header(f, path)
                for name, info in header.items():
                    ours, shard = model.checkpoint_name_map(name)
                    if ours not in params or (ours == "lm_head.weight" and cfg.tie_word_embeddings):
                        continue
                    dest = params[ours] if shard is None else _fused_slice(params[ours], cfg, shard)
                    begin, end = info["data_offsets"]
                    _read_into(f, data_start + begin, end - begin, dest, _ST_DTYPES[info["dtype"]],
                               info["shape"], path)
                    loaded.add((ours, shard))
    missing = expected - loaded
    if missing:
        names = sorted(f"{n}[{s}]" if s else n for n, s in missing)
        raise ValueError(f"checkpoint in {model_dir!r} is missing weights: {names[:8]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    _init_buffers(model, cfg, dtype, device)
    return model.eval()


def _expected_shards(model: nn.Module, cfg: ArchConfig) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for name, _ in model.named_parameters():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".qkv_proj." in name:
            out += [(name, s) for s in ("q_proj", "k_proj", "v_proj")]
        elif ".gate_up_proj." in name:
            out += [(name, s) for s in ("gate_proj", "up_proj")]
        else:
            out.append((name, None))
    return out


def _init_buffers(model: nn.Module, cfg: ArchConfig, dtype: torch.dtype, device: torch.device) -> None:
    from tokenmill.layers.rotary import RotaryEmbedding

    # the tables are computed on the CPU (see rotary.inv_frequencies), then moved
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope, dtype).to(device)
