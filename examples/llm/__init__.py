"""The LLM example: a small decoder trained on a toy corpus, its tokenizer, and random Hugging Face
checkpoints for the parity and load tests."""

__all__ = ["random_checkpoint", "train"]
