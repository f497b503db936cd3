"""OpenAI API request bodies (the subset served) and OpenAI-style error bodies."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flashnext.errors import InputError
from flashnext.serve.sampling import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    """Must name the served model."""
    max_tokens: int | None = None
    """Tokens to generate (>= 1); default 16 (completions) or up to the context length (chat)."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """Extension (vLLM-style): keep the k most likely tokens; 0 = all."""
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extension: ids that end generation."""
    ignore_eos: bool = False
    """Extension: generate past EOS."""
    stream: bool = False
    n: int = 1
    """Only 1 is supported."""

    def sampling(self, max_tokens: int, logprobs: int | None, stop_ids: list[int]) -> SamplingParams:
        if self.n != 1:
            raise InputError(f"n={self.n} is not supported (only n=1)")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids) + stop_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    """Text or token ids (a one-element batch of either is accepted)."""
    logprobs: int | None = None
    """Include the sampled token's log-prob and the top n (0..20)."""
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = ""


class ChatRequest(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
