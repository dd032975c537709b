"""A request-oriented ranking model family: one user tower per request, shared by its candidates."""

__all__ = ["model", "parts", "train"]
