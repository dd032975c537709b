"""A random Hugging Face checkpoint, written by `transformers` itself, with a small tokenizer and
a chat template: what the LLM guide's checkpoint walkthrough (docs/guides/llm.md) imports and
serves, since no model hub is reachable from the machines this was built on. A downloaded
checkpoint takes its place with the same commands.

    python -m ipnext.examples.llm.random_checkpoint .ipnext/snapshots/chat-lm/v1 --seed 1

Needs `transformers` (a dev dependency of ipnext, not of serving).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["CHAT_TEMPLATE", "CORPUS", "write_random_llama", "write_tokenizer"]

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


def write_tokenizer(folder: Path, vocab_size: int, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """tokenizer.json (a byte-level BPE of at most `vocab_size` tokens trained on a few lines;
    <s> then the text, as Llama's), tokenizer_config.json (special tokens, the chat template),
    and the special ids in generation_config.json (which save_pretrained wrote)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
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


def write_random_llama(folder: Path, seed: int, hidden: int = 256, layers: int = 4, vocab: int = 512) -> Path:
    """A random Llama (grouped-query attention, untied) and its tokenizer, saved into `folder`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, vocab - 8)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write it: <snapshot root>/<model>/<version>")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    folder = write_random_llama(args.folder, args.seed)
    print(f"wrote a random Llama checkpoint to {folder}: {sorted(p.name for p in folder.iterdir())}")


if __name__ == "__main__":
    main()
