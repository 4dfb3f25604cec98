"""Tiny configs of every family in posenc's table (``posenc.hf.families.FAMILIES``), with each
family's distinctive parts on: windows shorter than the tests' sequences, NoPE layers, experts, MLA.
Used by tests/hf/test_families.py and benchmarks/hf_families.py (which scales the sizes up).
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
WINDOW = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(n_routed_experts=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
           first_k_dense_replace=1, n_group=1, topk_group=1, num_key_value_heads=4, head_dim=None, **MOE)
TWO_TYPES = ["sliding_attention", "full_attention"] * 2

#: model_type -> the config keys beyond COMMON that make a tiny model of the family with its
#: distinctive parts on (windows shorter than the test's sequences, NoPE layers, experts, MLA).
TESTED: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "mixtral": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "ministral": dict(sliding_window=WINDOW, layer_types=TWO_TYPES),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=32, **MOE),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen3_moe": dict(num_experts=4, sliding_window=WINDOW, **MOE),
    "qwen3_next": dict(num_experts=4, shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, **MOE),
    "gemma": {},
    "gemma2": dict(sliding_window=WINDOW),
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=TWO_TYPES),
    "phi": {},
    "phi3": dict(sliding_window=WINDOW),
    "olmo": {},
    "olmo2": {},
    "olmo3": dict(sliding_window=WINDOW),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "smollm3": {},
    "granite": dict(attention_multiplier=0.3),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.3),
    "gpt_neox": {},
    "starcoder2": dict(sliding_window=WINDOW),
    "stablelm": {},
    "cohere": {},
    "cohere2": dict(sliding_window=WINDOW),
    "deepseek_v2": dict(MLA),
    "deepseek_v3": dict(MLA),
    "glm4": {},
    "glm4_moe": dict(n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1, **MOE),
    "ministral3": dict(sliding_window=WINDOW),
    "gpt_oss": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64, attention_chunk_size=WINDOW,
                        floor_scale=4, attn_scale=0.5),
    "modernbert-decoder": dict(local_attention=2 * WINDOW, layer_types=TWO_TYPES),  # its sliding_window: local_attention // 2
}


def config_kwargs(model_type: str, **sizes: Any) -> dict[str, Any]:
    """``AutoConfig.for_model(model_type, **config_kwargs(model_type))``'s keys: COMMON, the
    family's own, then ``sizes`` (hidden_size, head_dim, sliding_window, ...) over both; a key whose
    value is None is left out (the family's default)."""
    own = TESTED[model_type]
    kwargs = {**COMMON, **own}
    for key, value in sizes.items():
        if own.get(key, 0) is None:  # the family's default stands (MLA's head dims)
            continue
        kwargs[key] = value
    if "qk_rope_head_dim" in own:  # MLA: every query head has its key head (latent keys expanded)
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if "sliding_window" in sizes:
        for key in ("sliding_window", "attention_chunk_size"):
            if key in kwargs:
                kwargs[key] = sizes["sliding_window"]
    return {k: v for k, v in kwargs.items() if v is not None}


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    """(batch, length) token ids in [3, VOCAB) (above the special ids), from ``seed``: the ids the hf
    tests feed every model."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``model(ids, **kwargs).logits`` without gradients."""
    with torch.no_grad():
        return model(ids, **kwargs).logits


def perturbed(config: Any) -> torch.nn.Module:
    """The causal LM of ``config`` (seed 0), in eval mode, every weight moved off its init value by
    N(0, 0.05) noise, so norm weights are not 1, biases and sinks not 0, and a test that reads a
    weight the wrong way sees it."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model
