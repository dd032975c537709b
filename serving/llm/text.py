"""Text in and out of the LLM engine: the byte-level BPE tokenizer (the `tokenizers` library,
trained locally), carried in a snapshot as a uint8 tensor, and incremental detokenization for
streaming and stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["BOS", "EOS", "TOKENIZER_TENSOR", "TextCodec", "train_tokenizer"]

TOKENIZER_TENSOR = "tokenizer"  # the tokenizer's JSON as uint8, beside the weights
BOS, EOS = "<bos>", "<eos>"


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab_size` tokens (two of them <bos> and <eos>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


class TextCodec:
    """Encode prompts, decode outputs, and find stop strings, for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
        if bos is None or eos is None:
            raise ValueError(f"tokenizer: expected the special tokens {BOS} and {EOS}, found none")
        self.bos: int = bos
        self.eos: int = eos
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TextCodec:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise ValueError(
                f"{TOKENIZER_TENSOR}: expected a 1-D uint8 tensor (the tokenizer's JSON), got "
                f"{tensor.dtype}{list(tensor.shape)}"
            )
        return cls(Tokenizer.from_str(bytes(tensor.tolist()).decode("utf-8")))

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(list(self._tokenizer.to_str().encode("utf-8")), dtype=torch.uint8)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt(self, text: str) -> list[int]:
        """The token ids a request's prompt becomes: <bos> then the text."""
        return [self.bos, *self.encode(text)]

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(tokens), skip_special_tokens=True))

    def stable_text(self, tokens: Sequence[int]) -> str:
        """The decoded text, less a trailing incomplete UTF-8 character (a byte-level token can
        end mid-character): what is safe to stream so far."""
        return self.decode(tokens).rstrip("\ufffd")

    @staticmethod
    def find_stop(text: str, stops: Sequence[str]) -> int | None:
        """Where the first stop string begins in `text`, if any."""
        found = [i for s in stops if s and (i := text.find(s)) >= 0]
        return min(found) if found else None
