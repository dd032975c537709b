"""Hugging Face checkpoints through the engine, against `transformers` itself.

Tiny random checkpoints of each served family are written by transformers in the test
(`save_pretrained`, safetensors) and read back by `ipnext.serving.llm.hf`. The engine, batching
several prompts over a small paged cache with chunked prefill, must produce exactly the greedy
tokens of `generate`, and its logits must lie within LOGIT_TOLERANCE of transformers' forward
pass, in float32. The Mistral case's window (8) is shorter than every prompt, so the window is
really exercised, in prefill chunks and in decode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from ipnext.errors import CheckpointError
from ipnext.serving.llm.engine import EngineConfig, LLMEngine, SamplingParams
from ipnext.serving.llm.hf import decoder_config, load_checkpoint
from ipnext.serving.llm.model import Decoder
from tests.llm.hf_checkpoints import FAMILIES, NEW_TOKENS, SHAPE, write_checkpoint

# Float32 throughout: the engine's paged path and transformers' eager path sum in different
# orders, so logits agree to about 1e-6; this bound leaves room and still catches any wrong
# tensor, mask or rotary angle (those move logits by 1e-2 or more).
LOGIT_TOLERANCE = 1e-4


def reference_model(folder: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model


def prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    lengths = [11, 23, 9, 30]
    return [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in lengths]


def engine_greedy(folder: Path, batch: list[list[int]]) -> list[list[int]]:
    """Every prompt through one engine at once: blocks of 4 tokens, prefill in chunks of 8."""
    checkpoint = load_checkpoint(folder)
    config = EngineConfig(
        block_size=4, kv_cache_bytes=1 << 22, max_num_seqs=4, max_batched_tokens=8, backend="torch"
    )
    engine = LLMEngine(checkpoint.weights, checkpoint.config, config)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    seqs = [engine.add(p, params) for p in batch]
    while engine.has_work():
        engine.step()
    assert max(engine.stats.batch_sizes) > 1
    return [s.output for s in seqs]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_decodes_exactly_what_transformers_generates(family: str, tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / family, family, tokenizer=False)
    model = reference_model(folder)
    batch = prompts(SHAPE["vocab_size"], seed=len(family))
    expected = []
    for prompt in batch:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
        expected.append(out[0, len(prompt) :].tolist())
    got = engine_greedy(folder, batch)
    assert got == expected
    print(f"{family}: {len(batch)} prompts x {NEW_TOKENS} greedy tokens equal to transformers' generate")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_within_the_tolerance(family: str, tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / family, family, tokenizer=False)
    model = reference_model(folder)
    checkpoint = load_checkpoint(folder)
    tokens = prompts(SHAPE["vocab_size"], seed=7)[3]  # 30 tokens: past the Mistral window
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0]
    # ipnext's plain module (the trainer's and the engine's reference) at every position ...
    ours = Decoder.from_weights(checkpoint.weights, checkpoint.config).eval()
    with torch.no_grad():
        full = ours(torch.tensor([tokens]))[0]
    # ... and the engine's paged path at the last one, prefilled in chunks over its cache.
    engine = LLMEngine(
        checkpoint.weights,
        checkpoint.config,
        EngineConfig(block_size=4, kv_cache_bytes=1 << 22, max_batched_tokens=8, backend="torch"),
    )
    engine.add(tokens, SamplingParams(max_tokens=1))
    last = None
    while engine.has_work():  # chunks of 8: the last step samples
        last = _sampled_logits(engine)
    assert last is not None
    full_error = float((full - expected).abs().max())
    last_error = float((last - expected[-1]).abs().max())
    print(f"{family}: max |logit error| {full_error:.2e} (module, all positions), {last_error:.2e} (engine)")
    assert full_error < LOGIT_TOLERANCE and last_error < LOGIT_TOLERANCE


def _sampled_logits(engine: LLMEngine) -> torch.Tensor | None:
    """Run one engine step; the logits its runner returned for the sampled row, if any (the
    engine itself hands out tokens only)."""
    captured: list[torch.Tensor] = []
    step = engine.runner.step

    def spy(chunks: list) -> torch.Tensor:  # type: ignore[type-arg]
        out = step(chunks)
        captured.append(out)
        return out

    engine.runner.step = spy  # type: ignore[method-assign]
    try:
        engine.step()
    finally:
        del engine.runner.step
    return captured[-1][0] if captured and len(captured[-1]) else None


def test_bf16_and_sharded_checkpoints_load_and_decode_the_same(tmp_path: Path) -> None:
    """A bfloat16 checkpoint split in shards (an index and several files) is read as stored and
    computed in float32: the same tokens as transformers running those weights in float32."""
    folder = write_checkpoint(
        tmp_path / "bf16", "llama3", torch.bfloat16, max_shard_size="40KB", tokenizer=False
    )
    assert (folder / "model.safetensors.index.json").is_file()
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    checkpoint = load_checkpoint(folder)
    assert checkpoint.stored_dtype == "BF16"
    assert all(w.dtype == torch.bfloat16 for w in checkpoint.weights.values())
    model = reference_model(folder)  # bf16 weights, upcast to float32
    batch = prompts(SHAPE["vocab_size"], seed=3)[:2]
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in batch
    ]
    assert engine_greedy(folder, batch) == expected


# transformers 4.x wrote the same model this way: rope_theta and rope_scaling at the top level
# ("type" rather than "rope_type" in older files), torch_dtype; Qwen2's window by max_window_layers.
V4_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.46.0",
}


def test_a_v4_layout_config_reads_as_the_v5_layout_does(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "v5", "llama3", tokenizer=False)
    v5 = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in v5 and "rope_theta" not in v5  # what transformers 5 writes
    assert decoder_config(V4_LLAMA) == decoder_config(v5)
    qwen_v4 = {
        "architectures": ["Qwen2ForCausalLM"],
        **{k: V4_LLAMA[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")},
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 2,
        "rope_theta": 10000.0,
    }
    family, config = decoder_config(qwen_v4)
    assert family == "qwen2" and config.qkv_bias and config.sliding_layers == (2, 3)
    assert [config.window(i) for i in range(4)] == [None, None, 16, 16]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_a_config_the_engine_cannot_serve_is_refused_naming_what_and_what_is_served(
    change: dict[str, object], named: str
) -> None:
    with pytest.raises(CheckpointError, match=named) as refused:
        decoder_config({**V4_LLAMA, **change})
    if named == "GPT2LMHeadModel":
        assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in str(refused.value)


def test_pickled_weights_are_never_loaded(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "ckpt", "qwen2", tokenizer=False)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickled weights are never loaded"):
        load_checkpoint(folder)


def test_weights_that_do_not_fit_the_config_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "ckpt", "mistral-window", tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight has shape"
    ):
        load_checkpoint(folder)
