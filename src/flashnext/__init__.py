"""flashnext: train and serve Qwen3.8-Flash-Next (`qwen4_exp`) exactly, on packed token streams."""

from flashnext.config import ModelConfig, TextConfig, load_config

__all__ = ["ModelConfig", "TextConfig", "load_config"]
