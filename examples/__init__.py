"""Demo models people copy from: each has its parts, a trainer that writes real snapshots,
and a model.yaml."""

__all__ = ["click_ranker", "demo", "llm", "request_ranker"]
