"""Tiny random Hugging Face checkpoints, written by `transformers` itself, for the engine's
parity tests and the checkpoint snapshot tests: weights and config by `save_pretrained`, and
a small byte-level BPE tokenizer (`tokenizer.json`, BOS added by its post-processor, as Llama's
is) with a chat template in `tokenizer_config.json`."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from ipnext.examples.llm.random_checkpoint import write_tokenizer

transformers.utils.logging.disable_progress_bar()

NEW_TOKENS = 16
SHAPE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # confident logits: no near-ties for greedy decoding to split on
    "bos_token_id": 1,
    "eos_token_id": None,  # generate stops at eos; the engine runs with ignore_eos
}
FAMILIES = {
    # Llama 3's rotary scaling, with an original context short enough that it moves the angles;
    # an explicit head_dim that is not hidden_size / heads; untied output.
    "llama3": (
        transformers.LlamaConfig,
        {
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    # q/k/v biases, tied embeddings.
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    # A sliding window shorter than every prompt.
    "mistral-window": (transformers.MistralConfig, {"sliding_window": 8}),
}


def write_checkpoint(
    folder: Path, family: str, dtype: torch.dtype = torch.float32, tokenizer: bool = True, **save: object
) -> Path:
    """A random checkpoint of `family`, as transformers saves it; biases made non-zero (transformers
    initialises them to zero, which would hide a missing one); with `tokenizer`, its tokenizer
    files and chat template too."""
    config_class, extra = FAMILIES[family]
    torch.manual_seed(len(family))
    model = transformers.AutoModelForCausalLM.from_config(config_class(**SHAPE, **extra))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    model.to(dtype).save_pretrained(folder, safe_serialization=True, **save)
    if tokenizer:
        write_tokenizer(folder, SHAPE["vocab_size"] - 8)
    return folder
