"""Tiny random-init transformers models, saved as Hugging Face directories, for parity tests.

transformers initialises biases to zero and norms to one; we perturb every
parameter so that biases, norm scales and q/k norms are all really exercised.
"""

from __future__ import annotations

import os

import torch
import transformers

_COMMON = dict(vocab_size=160, max_position_embeddings=256)
_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, **_COMMON)

# name -> (config class, model class, config kwargs)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(_LLAMA_LIKE)),
    "llama-tied-bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                        dict(_LLAMA_LIKE, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama31": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                dict(_LLAMA_LIKE, rope_theta=500000.0,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(_LLAMA_LIKE, num_key_value_heads=1, sliding_window=12)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(_LLAMA_LIKE, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(_LLAMA_LIKE, head_dim=32, num_key_value_heads=4)),
    # Head sizes that are not powers of two (Phi-2 and StableLM ship 80, Phi-3-mini 96).
    "llama-hd80": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(_LLAMA_LIKE, head_dim=80)),
    "qwen3-hd96": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                   dict(_LLAMA_LIKE, head_dim=96, num_key_value_heads=1)),
    # Qwen2's window layers: layers from max_window_layers on slide.
    "qwen2-window": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     dict(_LLAMA_LIKE, use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=160)),
}

# Mixtures of experts (cbjax/models/moe.py): top-2 of 8 (Mixtral, OLMoE), a shared expert and a
# dense layer (Qwen2-MoE's mlp_only_layers), many experts with top-k renormalized (Qwen3-MoE).
MOE_FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(_LLAMA_LIKE, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(_LLAMA_LIKE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                       shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(_LLAMA_LIKE, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, head_dim=32,
                       norm_topk_prob=True)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(_LLAMA_LIKE, num_experts=8, num_experts_per_tok=2, pad_token_id=0)),
}
FAMILIES.update(MOE_FAMILIES)


def make_hf_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**kwargs, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def save_hf_model(model: torch.nn.Module, path: str, **save_kwargs) -> str:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, **save_kwargs)
    return path


def hf_logits(model: torch.nn.Module, tokens) -> "torch.Tensor":
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Continuous batching refills slots as requests end.",
           "Paged attention keeps the KV cache in fixed-size pages.", "Hello, world! How are you today?",
           "Static batching waits; dynamic batching waits a little; continuous batching never waits."]


def save_byte_level_tokenizer(path: str, vocab_size: int = 300) -> "transformers.PreTrainedTokenizerFast":
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML-like special tokens
    and a chat template: any text encodes, and nothing is downloaded. Returns it; the model
    that goes with it needs `len(tokenizer)` vocabulary rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                         "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def save_chat_model(path: str, family: str = "llama", seed: int = 0, **overrides) -> str:
    """A tiny random model with the tokenizer above, as a Hugging Face directory (`overrides`:
    config fields, e.g. a longer `max_position_embeddings`)."""
    tokenizer = save_byte_level_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = make_hf_model(family, seed=seed, vocab_size=len(tokenizer), eos_token_id=eos,
                          bos_token_id=tokenizer.bos_token_id, **overrides)
    return save_hf_model(model, path)
