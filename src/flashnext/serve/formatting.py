"""OpenAI response objects for one request and its n choices: full responses, streamed chunks, error bodies.

A choice that ended with "error" or "abort" did not stop: it is never reported with a finish reason. Instead the
whole response is an error (`failure`: 500 for a failed generation, 503 for an aborted one), or, on a stream
already under way, an error event (`data: {"error": {...}}`) followed by `[DONE]`.
"""

from __future__ import annotations

import json
import time

from flashnext.serve.chat_parse import StreamState, message
from flashnext.serve.protocol import error_body

FAILED_REASONS = ("error", "abort")


def event(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def holdback(text: str, stops: list[str]) -> int:
    """Characters to keep back while streaming: a possible stop-string prefix, or a partial UTF-8 character."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class Formatter:
    """OpenAI response objects (full, streamed chunks, errors) for one request's choices (`Request`s).

    `echo` (completions): each choice's text starts with its prompt (decoded from its ids), and with logprobs its
    first `logprobs` entries are the prompt's (`Request.prompt_logprobs`; the first token's is null), as OpenAI's
    legacy completions return them. `text_offset` gives each token's start in the choice's returned text (for
    a stream, the text returned so far).
    """

    def __init__(self, rid: str, model: str, tok, choices: list, chat: bool, echo: bool = False,
                 include_usage: bool = False):  # fmt: skip
        self.rid, self.model, self.tok, self.choices, self.chat = rid, model, tok, choices, chat
        self.echo = echo and not chat
        self.include_usage = include_usage  # streamed: "usage": null on each chunk, then `usage_chunk()`
        self.created = int(time.time())
        self.echoed: set[int] = set()  # streamed choices whose prompt went out
        self.parser = None  # a chat answer's OutputParser (reasoning, tool calls); None: the text is the content
        self.streams: dict[int, StreamState] = {}  # streamed chat choices: what was sent, the text so far
        self.streamed: dict[int, str] = {}

    def _token_str(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None else str(tid)

    def _top(self, top) -> dict[str, float]:
        """Top alternatives keyed by their text, best first; two ids that decode to one text keep the better."""
        out: dict[str, float] = {}
        for tid, lp in top:
            out.setdefault(self._token_str(tid), lp)
        return out

    def prompt_text(self, index: int) -> str:
        """Choice `index`'s prompt as echoed (empty without a tokenizer)."""
        r = self.choices[index]
        return self.tok.decode(r.prompt_ids) if self.tok is not None else ""

    def _offsets(self, ids: list[int], base: int) -> list[int]:
        """Where each of `ids` starts in their decoded text (as `Engine` decodes it), plus `base`."""
        if self.tok is None:
            return []
        pieces = [self.tok.decode([t]) for t in ids]
        if "".join(pieces) != self.tok.decode(ids):  # a token split a character: measure decoded prefixes, where
            # the pieces of a split character (read as U+FFFD until it is whole) start where the character does
            return [base + len(self.tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
        out, at = [], base
        for p in pieces:
            out.append(at)
            at += len(p)
        return out

    def _logprobs(self, index: int, lo: int, hi: int, with_prompt: bool = False):
        """Choice `index`'s log-probs of tokens lo..hi (OpenAI's shape), after its prompt's when `with_prompt`."""
        r = self.choices[index]
        if r.params.logprobs is None:
            return None
        ids, lps = r.output_ids[lo:hi], r.logprobs[lo:hi]
        tops = r.top_logprobs[lo:hi] if r.params.logprobs else [[] for _ in ids]
        if self.chat:
            return {"content": [self._chat_logprob(t, lp, top) for t, lp, top in zip(ids, lps, tops, strict=True)]}
        base, head = 0, {"tokens": [], "token_ids": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if with_prompt:
            prompt = r.prompt_ids
            base = len(self.prompt_text(index))
            head["tokens"] = [self._token_str(t) for t in prompt]
            head["token_ids"] = list(prompt)
            head["token_logprobs"] = list(r.prompt_logprobs)
            head["top_logprobs"] = [None] + [self._top(t) for t in r.prompt_top_logprobs[1:]]
            head["text_offset"] = self._offsets(prompt, 0)
        elif self.echo:
            base = len(self.prompt_text(index))
        return {
            "tokens": head["tokens"] + [self._token_str(t) for t in ids],
            "token_ids": head["token_ids"] + list(ids),
            "token_logprobs": head["token_logprobs"] + list(lps),
            "top_logprobs": head["top_logprobs"] + [self._top(top) for top in tops] if r.params.logprobs else None,
            "text_offset": head["text_offset"] + self._offsets(r.output_ids[:hi], base)[lo:],
        }

    def _chat_logprob(self, tid: int, logprob: float, top) -> dict:
        s = self._token_str(tid)
        alternatives = [
            {"token": self._token_str(a), "logprob": b, "bytes": list(self._token_str(a).encode())} for a, b in top
        ]
        return {"token": s, "logprob": logprob, "bytes": list(s.encode()), "top_logprobs": alternatives}

    def usage(self) -> dict:
        """Prompt tokens once per prompt (its choices share it), completion tokens of every choice."""
        p = sum(len(r.prompt_ids) for r in self.choices if r.index == 0)
        c = sum(len(r.output_ids) for r in self.choices)
        cached = sum(r.num_cached_prompt for r in self.choices if r.index == 0)  # resumed from the prefix cache
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip

    def final(self, texts: list[str]) -> dict:
        """The non-streamed response; `texts[i]` is choice i's final text."""
        choices = []
        for i, (r, text) in enumerate(zip(self.choices, texts, strict=True)):
            n = len(r.output_ids)
            reason = r.finish_reason
            if self.chat and self.parser is not None:
                msg, calls = message(self.parser, text)
                body = {"message": msg}
                reason = "tool_calls" if calls and reason == "stop" else reason
            elif self.chat:
                body = {"message": {"role": "assistant", "content": text}}
            else:
                body = {"text": self.prompt_text(i) + text if self.echo else text, "token_ids": list(r.output_ids)}
            lps = self._logprobs(i, 0, n, with_prompt=self.echo)
            choices.append({"index": i, **body, "logprobs": lps, "finish_reason": reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.rid, "object": obj, "created": self.created, "model": self.model,
            "choices": choices, "usage": self.usage(),
        }  # fmt: skip

    def _chunk_head(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, index: int, delta, reason: str | None, logprobs=None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        out = {**self._chunk_head(), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict:
        """The stream's last chunk with `stream_options.include_usage`: no choices, the request's usage."""
        return {**self._chunk_head(), "choices": [], "usage": self.usage()}

    def delta(self, index: int, text: str, lo: int, hi: int, reason: str | None) -> dict:
        """A streamed chunk of choice `index`: new text, tokens lo..hi. With `echo`, a choice's first chunk starts
        with its prompt (text and log-probs)."""
        first = self.echo and index not in self.echoed
        if first:
            self.echoed.add(index)
            text = self.prompt_text(index) + text
        lps = self._logprobs(index, lo, hi, with_prompt=first)
        out = self.chunk(index, {"content": text} if self.chat else text, reason, lps)
        if not self.chat:
            out["choices"][0]["token_ids"] = list(self.choices[index].output_ids[lo:hi])  # extension: this chunk's
        return out

    def deltas(self, index: int, text: str, lo: int, hi: int, reason: str | None) -> list[dict]:
        """The streamed chunks of choice `index` for new text (tokens lo..hi): one `delta` chunk, or for a parsed
        chat answer one chunk per field that grew (reasoning, content, a call's start, its argument text), the
        log-probs on the first and the finish reason (tool_calls when calls were parsed) on the last."""
        if not (self.chat and self.parser is not None):
            return [self.delta(index, text, lo, hi, reason)]
        state = self.streams.setdefault(index, StreamState(self.parser))
        self.streamed[index] = self.streamed.get(index, "") + text
        pieces = state.deltas(self.streamed[index], final=reason is not None) or [{}]
        if reason == "stop" and state.has_calls:
            reason = "tool_calls"
        lps = self._logprobs(index, lo, hi)
        last = len(pieces) - 1
        return [self.chunk(index, d, reason if k == last else None, lps if k == 0 else None)
                for k, d in enumerate(pieces)]  # fmt: skip

    def failure(self, req) -> tuple[int, dict]:
        """(HTTP status, error body) for a choice that ended with "error" (500) or "abort" (503)."""
        who = f"request {self.rid}" if len(self.choices) == 1 else f"choice {req.index} of request {self.rid}"
        done = f" after {len(req.output_ids)} tokens" if req.output_ids else ""
        if req.finish_reason == "error":
            return 500, error_body(f"{who} failed{done}: {req.error}", "server_error", code="generation_failed")
        return 503, error_body(f"{who} was aborted{done}: {req.error}", "server_error", code="aborted")
