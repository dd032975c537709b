"""One small trained LLM for the engine tests (trained once per session, in seconds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ipnext.examples.llm.train import DEFAULT_CONFIG, PART, train
from ipnext.serving.llm.model import Decoder, DecoderConfig
from ipnext.serving.llm.text import TOKENIZER_TENSOR, TextCodec
from ipnext.snapshots import load_weights


@dataclass
class TrainedLM:
    folder: Path
    weights: dict[str, torch.Tensor]
    config: DecoderConfig
    codec: TextCodec
    reference: Decoder  # the one-request-at-a-time loop


@pytest.fixture(scope="session")
def lm(tmp_path_factory: pytest.TempPathFactory) -> TrainedLM:
    report = train(tmp_path_factory.mktemp("llm"), "tiny-lm", "v1", steps=80)
    weights = load_weights(report.folder / f"{PART}.safetensors")
    codec = TextCodec.from_tensor(weights[TOKENIZER_TENSOR])
    reference = Decoder.from_weights(weights, DEFAULT_CONFIG).eval()
    return TrainedLM(report.folder, weights, DEFAULT_CONFIG, codec, reference)
