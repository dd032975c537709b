"""Train the demo LLM: a small decoder of the engine's family on a corpus generated here, with a
byte-level BPE tokenizer trained on the same corpus, written as a Hugging Face Llama checkpoint
that is a one-part snapshot folder.

    python -m ipnext.examples.llm.train --root .ipnext/snapshots --model tiny-lm --version v1

The corpus is made of short templated documents (facts about made-up animals, sums, counting),
seeded, so every run with the same seed writes the same weights. The folder is what any Hugging
Face checkpoint is (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with
a chat template, generation_config.json), and its manifest is what `ipnext snapshot import-hf`
writes: one path for every LLM, trained here or downloaded.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ipnext import Manifest, import_checkpoint
from ipnext.serving.llm.hf import save_checkpoint
from ipnext.serving.llm.model import Decoder, DecoderConfig
from ipnext.serving.llm.text import BOS, EOS, TextCodec, train_tokenizer

__all__ = ["CHAT_TEMPLATE", "DEFAULT_CONFIG", "LLMTrainReport", "corpus", "train"]

DEFAULT_CONFIG = DecoderConfig(
    vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=1024
)
PART = "lm"
# The model is not trained on conversations; the template is the plainest one, so a chat request
# reaches it as text it has seen: each turn on a line, the answer begun after "assistant:".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

_NAMES = ["ada", "bo", "cyd", "dax", "eli", "fen", "gus", "hal", "ivy", "jon", "kai", "lu"]
_ANIMALS = ["fox", "owl", "cat", "yak", "elk", "bat", "eel", "ant", "hen", "ram"]
_COLORS = ["red", "blue", "green", "gold", "grey", "pink", "teal", "black"]
_PLACES = ["river", "hill", "barn", "wood", "lake", "field", "cave", "shore"]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _document(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        name, animal, color, place = (rng.choice(x) for x in (_NAMES, _ANIMALS, _COLORS, _PLACES))
        return (
            f"{name} is a {color} {animal}. {name} lives by the {place}. "
            f"every day the {color} {animal} walks to the {place} and back."
        )
    if kind == 1:
        a, b = rng.randrange(6), rng.randrange(5)
        return f"{_NUMBERS[a]} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}. {a} + {b} = {a + b}."
    start = rng.randrange(5)
    return "counting: " + " ".join(_NUMBERS[start : start + rng.randrange(3, 7)]) + "."


def corpus(seed: int, documents: int) -> list[str]:
    rng = random.Random(seed)
    return [_document(rng) for _ in range(documents)]


@dataclass
class LLMTrainReport:
    manifest: Manifest
    folder: Path
    loss: float
    first_loss: float
    seconds: float


def train(
    root: Path,
    model: str,
    version: str,
    *,
    seed: int = 1,
    steps: int = 150,
    batch: int = 16,
    seq_len: int = 96,
    config: DecoderConfig = DEFAULT_CONFIG,
    parts: tuple[str, ...] = (PART,),
) -> LLMTrainReport:
    """Fit the model for `steps` steps of `batch` windows of `seq_len` tokens; write the snapshot
    with the weights under each of `parts` (two for a disaggregated prefill/decode pair)."""
    started = time.perf_counter()
    torch.manual_seed(seed)
    texts = corpus(seed=0, documents=3000)  # one world: every version learns the same language
    tokenizer = train_tokenizer(texts, config.vocab_size)
    codec = TextCodec(tokenizer)
    assert codec.bos is not None and codec.eos is not None
    stream: list[int] = []
    for text in texts:
        stream += [codec.bos, *codec.encode(text), codec.eos]
    data = torch.tensor(stream, dtype=torch.long)
    net = Decoder(config)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    first_loss = loss_value = float("nan")
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=generator)
        windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        logits = net(windows[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, config.vocab_size), windows[:, 1:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        for group in opt.param_groups:  # linear warmup, then cosine decay
            group["lr"] = (
                3e-3
                * min(1.0, (step + 1) / 20)
                * 0.5
                * (1 + torch.cos(torch.tensor(step / steps * 3.14159)).item())
            )
        opt.step()
        loss_value = float(loss.detach())
        if step == 0:
            first_loss = loss_value
    folder = root / model / version
    save_checkpoint(
        folder,
        config,
        net.weights(),
        tokenizer_json=tokenizer.to_str(),
        bos=(BOS, codec.bos),
        eos=(EOS, codec.eos),
        chat_template=CHAT_TEMPLATE,
    )
    _, manifest, _ = import_checkpoint(folder, model, parts, version)  # the manifest last
    return LLMTrainReport(manifest, folder, loss_value, first_loss, time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="snapshot root (one of snapshot_roots)")
    parser.add_argument("--model", default="tiny-lm")
    parser.add_argument("--version", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=[PART],
        help="part names to write the weights under (prefill decode: disaggregated)",
    )
    args = parser.parse_args()
    report = train(
        args.root, args.model, args.version, seed=args.seed, steps=args.steps, parts=tuple(args.parts)
    )
    print(
        f"trained {args.model} {args.version} in {report.seconds:.1f}s: loss {report.first_loss:.3f} -> "
        f"{report.loss:.3f} -> {report.folder}"
    )


if __name__ == "__main__":
    main()
