"""`tokenmill quantize MODEL --method int8|int4|w8a8 [--group-size G] [--calibration FILE] --out DIR`."""

from __future__ import annotations

import argparse
import os
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("quantize", help="write a compressed-tensors quantized copy of a float checkpoint",
                              description="Quantize a float checkpoint's linear layers and write a "
                                          "compressed-tensors checkpoint (tokenmill, vLLM and transformers "
                                          "load it). Round-to-nearest, or with --calibration GPTQ (int8, "
                                          "int4) or SmoothQuant (w8a8).")
    p.add_argument("model", help="the float checkpoint's directory")
    # quantize.METHODS: not imported here, since that module imports torch and every `tokenmill` command
    # builds this parser
    p.add_argument("--method", required=True, choices=("int8", "int4", "w8a8"),
                   help="int8: W8A16 per output channel; int4: W4A16 group-wise; w8a8: int8 weights and "
                        "dynamic per-token int8 activations")
    p.add_argument("--group-size", type=int, default=128, help="int4: input columns per scale (default: 128)")
    p.add_argument("--calibration", default=None,
                   help="a text file: calibrate with it (GPTQ for int8/int4, SmoothQuant for w8a8)")
    p.add_argument("--calibration-tokens", type=int, default=8192,
                   help="the most calibration tokens used (default: 8192)")
    p.add_argument("--out", required=True, help="the directory to write the quantized checkpoint to")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.quantize import QuantizeOptions, quantize_checkpoint

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ValueError(f"{args.model!r} has no config.json")
    if args.calibration_tokens < 2:
        raise ValueError(f"--calibration-tokens must be >= 2, got {args.calibration_tokens}")
    opts = QuantizeOptions(args.method, args.group_size, args.calibration, args.calibration_tokens)
    qconfig = quantize_checkpoint(args.model, args.out, opts)
    group = qconfig["config_groups"]["group_0"]["weights"]
    print(f"wrote {args.out}: {qconfig['format']}, {group['num_bits']}-bit weights ({group['strategy']}"
          f"{', group ' + str(group['group_size']) if group['group_size'] else ''})"
          f"{', calibrated' if args.calibration else ', round-to-nearest'}")
    return 0
