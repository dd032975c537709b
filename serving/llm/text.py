"""Text in and out of the LLM engine: a `tokenizers` tokenizer (a checkpoint's `tokenizer.json`,
or the example's byte-level BPE trained locally), prompts and chat prompts made of it, and
incremental detokenization for streaming and stop strings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["BOS", "EOS", "ChatRenderer", "TextCodec", "train_tokenizer"]

BOS, EOS = "<bos>", "<eos>"


class ChatRenderer(Protocol):
    """What turns a conversation into a prompt's text: a checkpoint's chat template
    (`chat.ChatTemplate`, which builds codecs on this module, so this module names only the shape)."""

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str: ...


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
    # As Llama's tokenizer does: encoding with special tokens puts <bos> first.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


class TextCodec:
    """Encode prompts, decode outputs, and find stop strings, for one tokenizer.

    Two kinds: the example family's own tokenizer (`TextCodec(tokenizer)`: its <bos> and <eos>,
    a prompt is <bos> then the text), and a Hugging Face checkpoint's `tokenizer.json`
    (`from_checkpoint`: a completion prompt is encoded as the tokenizer's post-processor says,
    which adds the BOS where the model was trained with one; its eos ids are the checkpoint's)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos: int | None = None,
        eos: Sequence[int] | None = None,
        special_tokens_in_prompt: bool = False,
        chat: ChatRenderer | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        if eos is None:  # the example family's tokenizer
            bos, end = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
            if bos is None or end is None:
                raise ValueError(f"tokenizer: expected the special tokens {BOS} and {EOS}, found none")
            eos = [end]
        self.bos: int | None = bos
        self.eos_ids: tuple[int, ...] = tuple(eos)
        self.eos: int | None = self.eos_ids[0] if self.eos_ids else None
        self._specials_in_prompt = special_tokens_in_prompt
        self.chat = chat
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt(self, text: str) -> list[int]:
        """The token ids a completion's prompt becomes: <bos> then the text (example family), or
        what the checkpoint's tokenizer makes of it with its special tokens."""
        if self._specials_in_prompt:
            return list(self._tokenizer.encode(text, add_special_tokens=True).ids)
        return [self.bos, *self.encode(text)] if self.bos is not None else self.encode(text)

    def chat_prompt(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """The token ids of a conversation: the checkpoint's chat template rendered (it writes the
        special tokens itself, so the text is encoded without adding any). ValueError when the
        model has no chat template."""
        if self.chat is None:
            raise ValueError(
                "messages: this model has no chat template (tokenizer_config.json chat_template, or "
                "chat_template.jinja); send a completion (prompt) instead"
            )
        return self.encode(self.chat.render(messages, add_generation_prompt))

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
