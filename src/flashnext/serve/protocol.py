"""OpenAI API request bodies (the subset served), their checks, and OpenAI-style error bodies.

Nothing a client sends is silently dropped when it would change the answer: OpenAI parameters this server does
not implement (`best_of`, `suffix`, legacy `functions`, `tools` on /v1/completions) are
refused with a 400 naming them unless they hold their neutral default, and so is an unknown chat content part.
Unknown extra fields (`user`, `metadata`, ...) are ignored: they do not change generation.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flashnext.serve.sampling import FieldError, SamplingParams, check_text
from flashnext.serve.structured import StructuredFields, request_constraint

BadRequest = FieldError  # an invalid field: the 400's message names field and value, `field` is its `param`

IMAGE_SENTINEL = "\ue000"  # stands for one image in the rendered chat template (a private-use character)


def show(value: Any, limit: int = 60) -> str:
    """A short repr of a client's value for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Body(StructuredFields):  # + structured_outputs, guided_*, tool_choice (`serve.structured`)
    model_config = ConfigDict(extra="ignore")

    model: str
    """Must name the served model."""
    max_tokens: int | None = None
    """Tokens to generate (>= 1); default 16 (completions) or up to the context length (chat)."""
    temperature: float = 1.0
    """0 = greedy. NaN / inf pass the schema so that the refusal names the field and the value."""
    top_p: float = 1.0
    top_k: int = 0
    """Extension (vLLM-style): keep the k most likely tokens; 0 = all."""
    seed: int | None = None
    """An int64; with n > 1, choice i samples with `choice_seed(seed, i)`."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extension: ids that end generation."""
    ignore_eos: bool = False
    """Extension: generate past EOS."""
    num_speculative_tokens: int | None = None
    """Extension: MTP draft tokens per step for this request (0 = off; default the server's --speculative-tokens)."""
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    """`{"include_usage": true}`: every streamed chunk carries `"usage": null` and a last chunk with no choices
    carries the usage (as OpenAI streams it); only with `stream: true`."""
    n: int = 1
    """Choices of the prompt; they share its prefill."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    """Token id (a JSON key, so a string) -> bias in [-100, 100]; penalties and controls: `serve.logit_controls`."""
    repetition_penalty: float = 1.0
    """Extension (vLLM): > 0; divides positive and multiplies negative logits of prompt and output tokens."""
    min_tokens: int = 0
    """Extension (vLLM): EOS and stop ids are blocked until this many tokens are generated."""
    min_p: float = 0.0
    """Extension (vLLM): drop tokens less likely than min_p times the most likely one."""
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """`BadRequest` for an OpenAI parameter this server would otherwise ignore."""
        unsupported = {
            "tools": bool(self.tools),  # chat requests serve them (`ChatRequest._unsupported`)
            "functions": bool(self.functions),
            **self._unsupported(),
        }
        for name, bad in unsupported.items():
            if bad:
                raise BadRequest(f"{name}={show(getattr(self, name))} is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))

    def _unsupported(self) -> dict[str, bool]:
        return {}

    def sampling(
        self, max_tokens: int, logprobs: int | None, stop_ids: list[int], prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The request's `SamplingParams`, validated (`FieldError` naming the field and value)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids) + stop_ids,
            ignore_eos=self.ignore_eos,
            num_speculative_tokens=self.num_speculative_tokens,
            logprobs=logprobs,
            n=self.n,
            prompt_logprobs=prompt_logprobs,
            **controls_fields(self),
        )
        params.validate()
        params.structured = request_constraint(self)  # response_format, structured_outputs, guided_*, tool_choice
        return params


def controls_fields(body) -> dict:
    """The penalties and logit controls of a body for `SamplingParams` (`logit_bias` keys as int token ids;
    `BadRequest` naming `logit_bias` for a key that is not one)."""
    bias = None
    if body.logit_bias is not None:
        bias = {}
        for key, value in body.logit_bias.items():
            try:
                bias[int(key)] = value
            except (TypeError, ValueError):
                msg = f"logit_bias keys must be token ids (integers), got {show(key)}"
                raise BadRequest(msg, "logit_bias") from None
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p")
    return {"logit_bias": bias, **{name: getattr(body, name) for name in names}}


class CompletionRequest(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    """Text or token ids, or a batch (a list of texts or of id lists): prompt i's choices are indices
    i*n .. i*n + n - 1 of the answer, as OpenAI numbers them."""
    logprobs: int | None = None
    """Include the sampled token's log-prob and the top n (0..20); with `echo`, the prompt tokens' too."""
    echo: bool = False
    """Return the prompt before the completion (text, and with `logprobs` its tokens' log-probs: the first
    `null`), as OpenAI's legacy completions; `max_tokens: 0` then only scores the prompt (lm-eval's
    loglikelihood requests)."""
    best_of: int | None = None
    suffix: str | None = None

    def _unsupported(self) -> dict[str, bool]:
        return {"best_of": self.best_of not in (None, 1, self.n), "suffix": bool(self.suffix)}

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (one, or each of a batch); `BadRequest` for an empty batch."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise BadRequest("prompt is empty", "prompt")
        return list(prompt)

    def completion_sampling(self) -> SamplingParams:
        """The request's `SamplingParams`: `max_tokens` default 16, 0 only with `echo` (score the prompt only);
        with `echo` the prompt's log-probs are asked too (its top n when `logprobs` > 0)."""
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens must be an integer >= 1, got 0 (0 is allowed with echo: true)", "max_tokens")
        prompt_logprobs = (self.logprobs or 0) if self.echo else None
        return self.sampling(max_tokens, self.logprobs, [], prompt_logprobs=prompt_logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = ""
    tool_calls: list[Any] | None = None
    """An assistant turn's calls (OpenAI objects, `function.arguments` a JSON string): `serve/chat_render.py`."""
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    """An assistant turn's reasoning (`reasoning_content` too, for older clients): passed as the template reads it."""
    reasoning_content: str | None = None


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    """auto | none | required | {"type": "function", "function": {"name": ...}} (checked in `serve/chat_render.py`)."""
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra chat template variables (`enable_thinking`, `preserve_thinking`, `reasoning_effort`, ...)."""
    reasoning_effort: str | None = None
    """OpenAI's: none / minimal (thinking off), low, medium, high (the template's xhigh), xhigh, max."""

    def _unsupported(self) -> dict[str, bool]:
        return {"tools": False}  # chat renders tools and parses calls (serve/chat_render.py, serve/chat_parse.py)

    def completion_limit(self) -> int | None:
        """`max_completion_tokens`, else `max_tokens` (None: up to the context); `BadRequest` if < 1."""
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None:
                if value < 1:
                    raise BadRequest(f"{name} must be an integer >= 1, got {value}", name)
                return value
        return None

    def logprobs_setting(self) -> int | None:
        """`SamplingParams.logprobs`: None, or the top n (0 = the sampled token's only)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest(f"top_logprobs={self.top_logprobs} needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self, urls: list[str]) -> list[dict[str, str]]:
        """Messages for the chat template: every content as one string (image parts as `IMAGE_SENTINEL`, their
        URLs appended to `urls`). `BadRequest` naming the part for a malformed or unsupported one."""
        out = []
        for i, m in enumerate(self.messages):
            check_text(m.role, f"messages[{i}].role")
            out.append({"role": m.role, "content": _content_text(m.content, urls, f"messages[{i}].content")})
        return out


def _content_text(content, urls: list[str], where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        check_text(content, where)
        return content
    out = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"{at}.text must be a string, got {show(text)}", f"{at}.text")
            check_text(text, f"{at}.text")
            out.append(text)
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise BadRequest(f"{at}: an image_url part needs image_url.url (a data: URL)", f"{at}.image_url")
            urls.append(url)
            out.append(IMAGE_SENTINEL)
        else:
            raise BadRequest(
                f"{at}: content part type {show(kind)} is not supported (supported: 'text', 'image_url')", f"{at}.type"
            )
    return "".join(out)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
