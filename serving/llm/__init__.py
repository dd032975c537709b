"""The LLM engine generative parts run: the decoder family (`model`), the paged KV cache with
its prefix cache (`cache`), continuous batching and sampling (`engine`), the batched forward
step (`runner`), text in and out (`text`), the asyncio service (`service`), its metrics
(`metrics`) and the part itself (`part.LLMPart`)."""

__all__ = [
    "cache",
    "chat",
    "engine",
    "hf",
    "metrics",
    "model",
    "part",
    "runner",
    "service",
    "text",
    "threads",
    "vllm_metrics",
]
