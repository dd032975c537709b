"""One small trained LLM for the engine tests (trained once per session, in seconds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ipnext.examples.llm.train import train
from ipnext.serving.llm.chat import checkpoint_codec
from ipnext.serving.llm.hf import folder_files, from_files
from ipnext.serving.llm.model import Decoder, DecoderConfig
from ipnext.serving.llm.text import TextCodec


@dataclass
class TrainedLM:
    folder: Path
    files: dict[str, bytes]  # the checkpoint's files, as a part gets them pinned
    weights: dict[str, torch.Tensor]
    config: DecoderConfig
    codec: TextCodec
    reference: Decoder  # the one-request-at-a-time loop


@pytest.fixture(scope="session")
def lm(tmp_path_factory: pytest.TempPathFactory) -> TrainedLM:
    report = train(tmp_path_factory.mktemp("llm"), "tiny-lm", "v1", steps=80)
    files = folder_files(report.folder)  # the checkpoint the trainer wrote, as a part gets it
    checkpoint = from_files(files)
    codec = checkpoint_codec(files, checkpoint)
    reference = Decoder.from_weights(checkpoint.weights, checkpoint.config).eval()
    return TrainedLM(report.folder, files, checkpoint.weights, checkpoint.config, codec, reference)
