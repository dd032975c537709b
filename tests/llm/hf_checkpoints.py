"""Tiny random Hugging Face checkpoints, written by `transformers` itself, for the engine's
parity tests and the checkpoint snapshot tests: weights and config by `save_pretrained`, and
a small byte-level BPE tokenizer (`tokenizer.json`, BOS added by its post-processor, as Llama's
is) with a chat template in `tokenizer_config.json`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
        write_tokenizer(folder)
    return folder


CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today?",
    "a model serves tokens one step at a time",
    "ünïcödé text and numbers 12345",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """tokenizer.json (BPE trained on a few lines, within SHAPE's vocabulary; <s> then the text)
    and tokenizer_config.json (special tokens, the chat template)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE["vocab_size"] - 8,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    generation = json.loads((folder / "generation_config.json").read_text())
    generation |= {"bos_token_id": bos, "eos_token_id": tokenizer.token_to_id("</s>")}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
