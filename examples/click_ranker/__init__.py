"""The demo ranker: a sparse embedding part and a dense MLP part, trained on synthetic clicks."""

__all__ = ["parts", "train"]
