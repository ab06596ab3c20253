"""Loading reads weights straight into their parameters: peak RSS grows by about the checkpoint's
size, never by two copies (issue #2: at most ~1.5x)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

PROBE = """
import json, sys, psutil, torch
from tokenmill.arch import load_arch_config
from tokenmill.models.loader import load_model
from tokenmill.layers.linear import packed_linear
cfg = load_arch_config(sys.argv[1])
warm = packed_linear(torch.ones(64, 64, dtype=torch.bfloat16), None)  # one-time oneDNN set-up
warm(torch.ones(1, 64, dtype=torch.bfloat16))
before = psutil.Process().memory_info().rss
model = load_model(sys.argv[1], cfg, torch.bfloat16, torch.device("cpu"))  # packs the linear layers too
# VmHWM, not ru_maxrss: the latter keeps the forking parent's size across exec
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"before": before, "peak": peak}))
"""


def test_peak_rss_near_checkpoint_size(tmp_path: os.PathLike[str]) -> None:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    size = os.path.getsize(os.path.join(tmp_path, "model.safetensors"))
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    assert rss["peak"] - rss["before"] <= 1.5 * size, (rss, size)
