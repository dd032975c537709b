"""The decoder-only transformer family the LLM engine serves: RMSNorm, rotary positions,
grouped-query attention and a SwiGLU MLP, described by a `DecoderConfig` and a flat dict of
named tensors (the safetensors file of a snapshot).

The family covers Hugging Face's Llama, Mistral and Qwen2 (`ipnext.serving.llm.hf` maps their
configs and tensor names onto it): optional q/k/v biases (Qwen2), output weights tied to the
embeddings, Llama 3's rotary scaling, an explicit head size, and a sliding attention window on
all or some layers (Mistral, Qwen2).

`Decoder` is the plain torch module of that family: the trainer fits it, and its `generate`
(one request at a time, the whole sequence recomputed per token) is the reference the engine's
batched, paged path must match token for token. The engine itself never builds a `Decoder`;
it reads the same tensors by name (`layer_names`).
"""

from __future__ import annotations

import math

import torch
from pydantic import Field, model_validator
from torch import nn

from ipnext.names import Frozen

__all__ = [
    "Decoder",
    "DecoderConfig",
    "Llama3Rope",
    "apply_rotary",
    "expected_tensors",
    "inverse_frequencies",
    "layer_names",
    "output_weight",
    "rms_norm",
    "rotary_tables",
]


class Llama3Rope(Frozen):
    """Llama 3.1's rotary scaling (`rope_type: llama3`): wavelengths longer than the original
    context / low_freq_factor are stretched by `factor`, shorter than / high_freq_factor kept,
    and those between blended smoothly."""

    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> Llama3Rope:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor {self.high_freq_factor} must exceed low_freq_factor {self.low_freq_factor}"
            )
        return self


class DecoderConfig(Frozen):
    """The shape of one model of the family (the `config` of its part in model.yaml)."""

    vocab_size: int = Field(gt=0)
    dim: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0)
    ffn_hidden: int = Field(gt=0)
    rope_theta: float = Field(default=10_000.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    max_seq_len: int = Field(default=1024, gt=0)
    # Hugging Face families: all off by default, which is the example family.
    head_size: int | None = Field(default=None, gt=0)  # None: dim / n_heads
    qkv_bias: bool = False  # q, k and v projections carry a bias (Qwen2)
    tied_embeddings: bool = False  # the output projection is the embedding matrix
    rope_scaling: Llama3Rope | None = None
    # Each query sees itself and the sliding_window - 1 keys before it, on the layers named in
    # sliding_layers (None: every layer); no window: the whole context.
    sliding_window: int | None = Field(default=None, gt=0)
    sliding_layers: tuple[int, ...] | None = None

    @model_validator(mode="after")
    def _heads_divide(self) -> DecoderConfig:
        if self.head_size is None and self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary positions")
        outside = [i for i in self.sliding_layers or () if not 0 <= i < self.n_layers]
        if outside:
            raise ValueError(f"sliding_layers: {outside} are not layers of a {self.n_layers}-layer model")
        return self

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.dim // self.n_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it sees the whole context."""
        if self.sliding_window is None or self.sliding_window >= self.max_seq_len:
            return None
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV-cache bytes one token takes over all layers (keys and values)."""
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element


def layer_names(i: int) -> dict[str, str]:
    prefix = f"layers.{i}."
    return {
        "attention_norm": prefix + "attention_norm.weight",
        "wq": prefix + "attention.wq.weight",
        "wk": prefix + "attention.wk.weight",
        "wv": prefix + "attention.wv.weight",
        "bq": prefix + "attention.wq.bias",  # qkv_bias only
        "bk": prefix + "attention.wk.bias",
        "bv": prefix + "attention.wv.bias",
        "wo": prefix + "attention.wo.weight",
        "ffn_norm": prefix + "ffn_norm.weight",
        "w1": prefix + "feed_forward.w1.weight",  # gate
        "w2": prefix + "feed_forward.w2.weight",  # down
        "w3": prefix + "feed_forward.w3.weight",  # up
    }


def expected_tensors(config: DecoderConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of every weight a snapshot of `config` holds (float32)."""
    c, hd = config, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (c.vocab_size, c.dim),
        "norm.weight": (c.dim,),
    }
    if not c.tied_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.dim)
    for i in range(c.n_layers):
        n = layer_names(i)
        shapes |= {
            n["attention_norm"]: (c.dim,),
            n["wq"]: (c.n_heads * hd, c.dim),
            n["wk"]: (c.n_kv_heads * hd, c.dim),
            n["wv"]: (c.n_kv_heads * hd, c.dim),
            n["wo"]: (c.dim, c.n_heads * hd),
            n["ffn_norm"]: (c.dim,),
            n["w1"]: (c.ffn_hidden, c.dim),
            n["w2"]: (c.dim, c.ffn_hidden),
            n["w3"]: (c.ffn_hidden, c.dim),
        }
        if c.qkv_bias:
            shapes |= {
                n["bq"]: (c.n_heads * hd,),
                n["bk"]: (c.n_kv_heads * hd,),
                n["bv"]: (c.n_kv_heads * hd,),
            }
    return {name: (shape, "float32") for name, shape in shapes.items()}


def output_weight(config: DecoderConfig, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The output projection: its own tensor, or the embeddings when tied."""
    return weights["tok_embeddings.weight" if config.tied_embeddings else "output.weight"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def inverse_frequencies(config: DecoderConfig) -> torch.Tensor:
    """The rotary angle per position of each of the head_dim / 2 pairs (float64), Llama 3's
    scaling applied where the config has it."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(
        wavelength > original / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq
    )
    smooth = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    between = (wavelength >= original / scaling.high_freq_factor) & (
        wavelength <= original / scaling.low_freq_factor
    )
    return torch.where(between, blended, stretched)


def rotary_tables(
    config: DecoderConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (len(positions), head_dim / 2), for the rotate-half form of rotary positions."""
    angles = positions.to(torch.float64)[:, None] * inverse_frequencies(config)[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (tokens, heads, head_dim) by each token's angles: pairs (i, i + head_dim/2)."""
    first, second = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([first * c - second * s, first * s + second * c], dim=-1)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        hd = c.head_dim
        self.wq = nn.Linear(c.dim, c.n_heads * hd, bias=c.qkv_bias)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * hd, bias=c.qkv_bias)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * hd, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * hd, c.dim, bias=False)


class _FeedForward(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn_hidden, bias=False)
        self.w2 = nn.Linear(c.ffn_hidden, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_hidden, bias=False)


class _Layer(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.attention_norm = _RMSNorm(c.dim, c.norm_eps)
        self.attention = _Attention(c)
        self.ffn_norm = _RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = _FeedForward(c)


class Decoder(nn.Module):
    """The family as a torch module: training, and the one-request-at-a-time reference."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.n_layers))
        self.norm = _RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        if config.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        for layer in self._typed_layers():  # residual branches start small (scaled by depth)
            nn.init.normal_(layer.attention.wo.weight, std=0.02 / math.sqrt(2 * config.n_layers))
            nn.init.normal_(layer.feed_forward.w2.weight, std=0.02 / math.sqrt(2 * config.n_layers))

    def _typed_layers(self) -> list[_Layer]:
        return [layer for layer in self.layers if isinstance(layer, _Layer)]

    @classmethod
    def from_weights(cls, weights: dict[str, torch.Tensor], config: DecoderConfig) -> Decoder:
        model = cls(config)
        state = {k: v for k, v in weights.items() if k in model.state_dict()}
        if config.tied_embeddings:  # one tensor under both names
            state["output.weight"] = state["tok_embeddings.weight"]
        model.load_state_dict(state, strict=True)
        return model

    def weights(self) -> dict[str, torch.Tensor]:
        """The snapshot's tensors, by the names `expected_tensors` gives (a tied output is not
        stored twice)."""
        return {name: self.state_dict()[name] for name in expected_tensors(self.config)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) of a causal pass over `tokens` (batch, seq)."""
        c = self.config
        batch, seq = tokens.shape
        x = self.tok_embeddings(tokens)
        cos, sin = rotary_tables(c, torch.arange(seq), x.dtype)
        position = torch.arange(seq)
        for index, layer in enumerate(self._typed_layers()):
            h = layer.attention_norm(x)
            q = layer.attention.wq(h).view(batch * seq, c.n_heads, c.head_dim)
            k = layer.attention.wk(h).view(batch * seq, c.n_kv_heads, c.head_dim)
            v = layer.attention.wv(h).view(batch, seq, c.n_kv_heads, c.head_dim)
            q = apply_rotary(q, cos.repeat(batch, 1), sin.repeat(batch, 1))
            k = apply_rotary(k, cos.repeat(batch, 1), sin.repeat(batch, 1))
            q = q.view(batch, seq, c.n_heads, c.head_dim).transpose(1, 2)
            k = k.view(batch, seq, c.n_kv_heads, c.head_dim).transpose(1, 2)
            v = v.transpose(1, 2)
            group = c.n_heads // c.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            window = c.window(index)
            if window is None:
                attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # key j is seen from query i when i - window < j <= i
                gap = position[:, None] - position[None, :]
                visible = (gap >= 0) & (gap < window)
                attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
            x = x + layer.attention.wo(attn.transpose(1, 2).reshape(batch, seq, -1))
            h = layer.ffn_norm(x)
            ff = layer.feed_forward
            x = x + ff.w2(torch.nn.functional.silu(ff.w1(h)) * ff.w3(h))
        logits: torch.Tensor = self.output(self.norm(x))
        return logits

    @torch.no_grad()
    def generate(self, prompt: list[int], max_tokens: int, stop_token: int | None = None) -> list[int]:
        """Greedy decoding, one token at a time, the whole sequence recomputed each time: slow and
        plainly right, the reference for the engine."""
        tokens = list(prompt)
        out: list[int] = []
        for _ in range(max_tokens):
            logits = self(torch.tensor([tokens]))[0, -1]
            token = int(torch.argmax(logits))
            out.append(token)
            tokens.append(token)
            if token == stop_token:
                break
        return out
