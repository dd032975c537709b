"""Hugging Face checkpoints for the LLM engine: a checkpoint folder's `config.json` read into the
family's `DecoderConfig`, and its tensors renamed to the family's names.

Served families (by `architectures`, or `model_type` when that is missing): Llama 2 and 3
(`LlamaForCausalLM`, Llama 3's `rope_type: llama3` scaling, tied or untied embeddings),
Mistral (`MistralForCausalLM`, a sliding window on every layer) and Qwen2 (`Qwen2ForCausalLM`,
q/k/v biases, a sliding window on the layers `layer_types` or `max_window_layers` name). Both
config layouts transformers writes are read: v4 (`rope_theta` and `rope_scaling` at the top,
`torch_dtype`) and v5 (`rope_parameters`, `dtype`). Anything else is refused with a
`CheckpointError` naming the file, the field, what it holds and what is served.

A checkpoint's weights may be float32, float16 or bfloat16 (F32, F16, BF16 in the safetensors
header); the engine computes in its own dtype (`EngineConfig.dtype`) whatever they are stored in.
Only safetensors are read: a folder with nothing but `pytorch_model.bin` is refused, never
unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ipnext.errors import CheckpointError
from ipnext.serving.llm.model import DecoderConfig, Llama3Rope, layer_names

__all__ = [
    "ARCHITECTURES",
    "CHECKPOINT_DTYPES",
    "HFCheckpoint",
    "decoder_config",
    "expected_hf_tensors",
    "folder_files",
    "from_files",
    "from_hf_names",
    "hf_names",
    "load_checkpoint",
    "read_json",
    "save_checkpoint",
    "weight_files",
]

# architectures[0] -> the family; model_type is the fallback for a config without architectures.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
CHECKPOINT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ROPE_TYPES = ("default", "llama3")
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
# Tensors some exporters add that carry nothing the engine uses (the rotary table is computed).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class HFCheckpoint:
    """What the engine needs from a checkpoint folder."""

    family: str  # "llama", "mistral", "qwen2"
    config: DecoderConfig
    weights: dict[str, torch.Tensor]  # by the family's names, in the stored dtype
    eos_token_ids: tuple[int, ...]  # config.json's, or generation_config.json's where it has them
    bos_token_id: int | None
    stored_dtype: str  # "F32", "F16" or "BF16"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a checkpoint file; anything else is a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.name}: not found in {path.parent.name}/", field=path.name) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path.name}: not readable JSON ({err})", field=path.name) from None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{path.name}: expected a JSON object, got {type(value).__name__}", field=path.name
        )
    return value


def _json(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    """A JSON object among a checkpoint's files; anything else is a CheckpointError naming it."""
    if name not in files:
        raise CheckpointError(f"{name}: the checkpoint has none", field=name)
    try:
        value = json.loads(files[name])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{name}: not readable JSON ({err})", field=name) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{name}: expected a JSON object, got {type(value).__name__}", field=name)
    return value


def _family(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures")
    supported = ", ".join(ARCHITECTURES)
    if isinstance(architectures, list) and architectures:
        name = architectures[0]
        if name not in ARCHITECTURES:
            raise CheckpointError(
                f"{CONFIG_FILE}: architectures {architectures} is not served; ipnext serves {supported}",
                field="architectures",
                value=architectures,
            )
        return ARCHITECTURES[name]
    model_type = raw.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise CheckpointError(
        f"{CONFIG_FILE}: no architectures, and model_type {model_type!r} is not served; ipnext serves "
        f"{supported}",
        field="architectures",
    )


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(
            f"{CONFIG_FILE}: {key} must be a positive integer, got {value!r}", field=key, value=value
        )
    return value


def _rope(raw: dict[str, Any]) -> tuple[float, Llama3Rope | None]:
    """rope_theta and the scaling, from v5's rope_parameters or v4's rope_theta and rope_scaling."""
    params = raw.get("rope_parameters")
    scaling: Any
    if isinstance(params, dict) and "rope_theta" in params:  # v5; per-layer-type dicts are not served
        theta, scaling, where = params["rope_theta"], params, "rope_parameters"
    else:
        theta, scaling, where = raw.get("rope_theta", 10_000.0), raw.get("rope_scaling"), "rope_scaling"
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise CheckpointError(
            f"{CONFIG_FILE}: rope_theta must be a positive number, got {theta!r}", field="rope_theta"
        )
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{CONFIG_FILE}: {where} must be an object, got {scaling!r}", field=where)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(
            f"{CONFIG_FILE}: {where}.rope_type {kind!r} is not served; ipnext serves {', '.join(ROPE_TYPES)}",
            field=f"{where}.rope_type",
            value=kind,
        )
    factor = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise CheckpointError(
            f"{CONFIG_FILE}: partial_rotary_factor {factor} is not served "
            "(rotary positions on the whole head only)",
            field="partial_rotary_factor",
        )
    if kind == "default":
        return float(theta), None
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in scaling]
    if missing:
        raise CheckpointError(
            f"{CONFIG_FILE}: {where} of rope_type llama3 lacks {missing}", field=f"{where}.{missing[0]}"
        )
    try:
        return float(theta), Llama3Rope.model_validate({f: scaling[f] for f in fields})
    except ValueError as err:
        raise CheckpointError(f"{CONFIG_FILE}: {where}: {err}", field=where) from None


def _sliding(raw: dict[str, Any], family: str, n_layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """The window and the layers it applies to (None: all), as transformers reads them."""
    window = raw.get("sliding_window")
    if family == "llama" or window is None:
        return None, None
    window = _int(raw, "sliding_window")
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list):
        if len(layer_types) != n_layers:
            raise CheckpointError(
                f"{CONFIG_FILE}: layer_types names {len(layer_types)} layers, the model has {n_layers}",
                field="layer_types",
            )
        unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise CheckpointError(
                f"{CONFIG_FILE}: layer_types {unknown} are not served (full_attention, sliding_attention)",
                field="layer_types",
            )
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        return (window, sliding) if sliding else (None, None)
    if family == "qwen2":  # v4: layers from max_window_layers on slide, when use_sliding_window
        if not raw.get("use_sliding_window", False):
            return None, None
        first = raw.get("max_window_layers", n_layers)
        sliding = tuple(range(first, n_layers))
        return (window, sliding) if sliding else (None, None)
    return window, None  # mistral: every layer


def decoder_config(raw: dict[str, Any], max_seq_len: int | None = None) -> tuple[str, DecoderConfig]:
    """The family and the engine's config of a checkpoint's `config.json` (parsed). `max_seq_len`
    is the context ipnext serves, at most the checkpoint's `max_position_embeddings` (its default)."""
    family = _family(raw)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(
            f"{CONFIG_FILE}: hidden_act {act!r} is not served (silu only)", field="hidden_act"
        )
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{CONFIG_FILE}: mlp_bias true is not served", field="mlp_bias")
    if family == "llama" and raw.get("attention_bias"):
        raise CheckpointError(
            f"{CONFIG_FILE}: attention_bias true (Llama's bias on q, k, v and o) is not served",
            field="attention_bias",
        )
    n_layers = _int(raw, "num_hidden_layers")
    heads = _int(raw, "num_attention_heads")
    positions = _int(raw, "max_position_embeddings", 2048)
    if max_seq_len is not None and max_seq_len > positions:
        raise CheckpointError(
            f"config.max_seq_len {max_seq_len} exceeds the checkpoint's max_position_embeddings {positions}",
            field="max_seq_len",
            fix=f"serve a context of at most {positions} tokens",
        )
    theta, scaling = _rope(raw)
    window, sliding_layers = _sliding(raw, family, n_layers)
    eps = raw.get("rms_norm_eps", 1e-6)
    head_dim = raw.get("head_dim")
    try:
        config = DecoderConfig(
            vocab_size=_int(raw, "vocab_size"),
            dim=_int(raw, "hidden_size"),
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=_int(raw, "num_key_value_heads", heads),
            ffn_hidden=_int(raw, "intermediate_size"),
            rope_theta=theta,
            norm_eps=eps,
            max_seq_len=max_seq_len or positions,
            head_size=head_dim if head_dim is not None else None,
            qkv_bias=family == "qwen2",
            tied_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            sliding_window=window,
            sliding_layers=sliding_layers,
        )
    except ValueError as err:
        raise CheckpointError(f"{CONFIG_FILE}: {err}", field="config.json") from None
    return family, config


def hf_names(config: DecoderConfig) -> dict[str, str]:
    """The family's tensor name -> the checkpoint's, for every tensor `config` needs."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not config.tied_embeddings:
        names["output.weight"] = "lm_head.weight"
    hf_layer = {
        "attention_norm": "input_layernorm.weight",
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "bq": "self_attn.q_proj.bias",
        "bk": "self_attn.k_proj.bias",
        "bv": "self_attn.v_proj.bias",
        "wo": "self_attn.o_proj.weight",
        "ffn_norm": "post_attention_layernorm.weight",
        "w1": "mlp.gate_proj.weight",
        "w2": "mlp.down_proj.weight",
        "w3": "mlp.up_proj.weight",
    }
    for i in range(config.n_layers):
        for key, ours in layer_names(i).items():
            if key in ("bq", "bk", "bv") and not config.qkv_bias:
                continue
            names[ours] = f"model.layers.{i}.{hf_layer[key]}"
    return names


def expected_hf_tensors(
    config: DecoderConfig, weights: Mapping[str, torch.Tensor]
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint name -> (shape, dtype) of every tensor of a checkpoint of `config`, each in the
    dtype it was loaded in (`weights`, by the family's names): what validation checks the
    safetensors headers against."""
    from ipnext.serving.llm.model import expected_tensors

    shapes = expected_tensors(config)
    return {
        hf: (shapes[ours][0], str(weights[ours].dtype).removeprefix("torch."))
        for ours, hf in hf_names(config).items()
    }


def from_hf_names(
    tensors: dict[str, torch.Tensor], config: DecoderConfig, source: str = "the checkpoint"
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the family's names, each checked for its shape; one missing,
    misshapen or unknown is a CheckpointError naming it (a tied checkpoint may still carry
    lm_head.weight: transformers ignores it, and so does the engine)."""
    from ipnext.serving.llm.model import expected_tensors

    names = hf_names(config)
    shapes = expected_tensors(config)
    missing = sorted(hf for hf in names.values() if hf not in tensors)
    if missing:
        raise CheckpointError(
            f"{source}: missing {len(missing)} tensor(s) config.json implies, e.g. {missing[:3]}",
            field=missing[0],
        )
    known = set(names.values()) | ({"lm_head.weight"} if config.tied_embeddings else set())
    unknown = sorted(n for n in tensors if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise CheckpointError(
            f"{source}: {len(unknown)} tensor(s) config.json does not account for, e.g. {unknown[:3]}",
            field=unknown[0],
            fix="check that config.json belongs to these weights",
        )
    renamed = {}
    for ours, hf in names.items():
        tensor = tensors[hf]
        if tuple(tensor.shape) != shapes[ours][0]:
            raise CheckpointError(
                f"{source}: {hf} has shape {list(tensor.shape)}, config.json implies {list(shapes[ours][0])}",
                field=hf,
            )
        if tensor.dtype not in CHECKPOINT_DTYPES.values():
            raise CheckpointError(
                f"{source}: {hf} is {tensor.dtype}; served weights are F32, F16 or BF16", field=hf
            )
        renamed[ours] = tensor
    return renamed


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a checkpoint folder, in order: `model.safetensors`, or the shards
    `model.safetensors.index.json` names. A folder with pickled weights only is refused."""
    if (folder / INDEX_FILE).is_file():
        index = read_json(folder / INDEX_FILE)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{INDEX_FILE}: no weight_map", field="weight_map")
        files = sorted(set(weight_map.values()))
        bad = [
            f
            for f in files
            if not isinstance(f, str) or "/" in f or "\\" in f or not f.endswith(".safetensors")
        ]
        if bad:
            raise CheckpointError(
                f"{INDEX_FILE}: weight_map names {bad[:3]}: shards must be .safetensors files beside it",
                field="weight_map",
            )
        return files
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    raise CheckpointError(
        f"{folder.name}/: no {SINGLE_FILE} or {INDEX_FILE}"
        + (f" (found {pickled[:3]}: pickled weights are never loaded)" if pickled else ""),
        field=SINGLE_FILE,
        fix="save the checkpoint with safetensors (save_pretrained(..., safe_serialization=True))",
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return ()


def folder_files(folder: Path) -> dict[str, bytes]:
    """A checkpoint folder's files as a part receives them pinned (`CheckpointFiles`): every
    `.json`, `.jinja` and `.safetensors` file, by name (tests, benchmarks, tools)."""
    weight_files(folder)  # refuses a folder of pickles, naming them
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.suffix in (".json", ".jinja", ".safetensors") and p.name != "manifest.json"
    }


def load_checkpoint(folder: Path, max_seq_len: int | None = None) -> HFCheckpoint:
    """Read a checkpoint folder (`from_files` on `folder_files`)."""
    return from_files(folder_files(folder), max_seq_len, folder.name)


def from_files(
    files: Mapping[str, bytes], max_seq_len: int | None = None, source: str = "the checkpoint"
) -> HFCheckpoint:
    """A checkpoint from its files' bytes (a pinned snapshot's `CheckpointFiles`, or a folder's):
    its config, its (possibly sharded) safetensors weights renamed to the family's names, and
    its end-of-sequence ids."""
    from safetensors.torch import load

    raw = _json(files, CONFIG_FILE)
    family, config = decoder_config(raw, max_seq_len)
    if INDEX_FILE in files:
        weight_map = _json(files, INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{INDEX_FILE}: no weight_map", field="weight_map")
        shards = sorted({str(f) for f in weight_map.values()})
    elif SINGLE_FILE in files:
        shards = [SINGLE_FILE]
    else:
        raise CheckpointError(f"{source}: no {SINGLE_FILE} or {INDEX_FILE}", field=SINGLE_FILE)
    tensors: dict[str, torch.Tensor] = {}
    for name in shards:
        if name not in files:
            raise CheckpointError(f"{INDEX_FILE}: names {name}, which {source} does not hold", field=name)
        tensors.update(load(files[name]))
    weights = from_hf_names(tensors, config, source=source)
    dtypes = {d for d, t in CHECKPOINT_DTYPES.items() for w in weights.values() if w.dtype == t}
    generation = _json(files, GENERATION_FILE) if GENERATION_FILE in files else {}
    eos = _eos_ids(generation.get("eos_token_id")) or _eos_ids(raw.get("eos_token_id"))
    bos = generation.get("bos_token_id", raw.get("bos_token_id"))
    return HFCheckpoint(
        family=family,
        config=config,
        weights=weights,
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        stored_dtype=dtypes.pop() if len(dtypes) == 1 else "mixed",
    )


def save_checkpoint(
    folder: Path,
    config: DecoderConfig,
    weights: Mapping[str, torch.Tensor],
    *,
    tokenizer_json: str,
    bos: tuple[str, int],
    eos: tuple[str, int],
    chat_template: str | None = None,
) -> list[str]:
    """Write a model of the family as a Hugging Face Llama checkpoint (transformers' v5 layout),
    the way the example trainer hands its model over: config.json, model.safetensors (the
    family's tensors under Llama's names), tokenizer.json, tokenizer_config.json (special tokens,
    chat template) and generation_config.json. `bos` and `eos` are (token, id). Returns the
    files written. Only what Llama expresses is written: no biases, no sliding window."""
    from safetensors.torch import save_file

    if config.qkv_bias or config.sliding_window is not None:
        raise ValueError("save_checkpoint writes Llama checkpoints: no q/k/v biases, no sliding window")
    folder.mkdir(parents=True, exist_ok=True)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope |= {"rope_type": "llama3", **config.rope_scaling.model_dump()}
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tied_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos[1],
        "eos_token_id": eos[1],
        "dtype": "float32",
    }
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos[0],
        "eos_token": eos[0],
        "model_max_length": config.max_seq_len,
    }
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    texts = {
        CONFIG_FILE: hf_config,
        "tokenizer_config.json": tokenizer_config,
        GENERATION_FILE: {"bos_token_id": bos[1], "eos_token_id": eos[1]},
    }
    for name, value in texts.items():
        (folder / name).write_text(json.dumps(value, indent=2) + "\n")
    (folder / "tokenizer.json").write_text(tokenizer_json)
    tensors = {hf: weights[ours].detach().contiguous() for ours, hf in hf_names(config).items()}
    save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    return sorted([*texts, "tokenizer.json", SINGLE_FILE])
