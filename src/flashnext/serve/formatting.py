"""OpenAI response objects for one request and its n choices: full responses, streamed chunks, error bodies.

A choice that ended with "error" or "abort" did not stop: it is never reported with a finish reason. Instead the
whole response is an error (`failure`: 500 for a failed generation, 503 for an aborted one), or, on a stream
already under way, an error event (`data: {"error": {...}}`) followed by `[DONE]`.
"""

from __future__ import annotations

import json
import time

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
    """OpenAI response objects (full, streamed chunks, errors) for one request's choices (`Request`s)."""

    def __init__(self, rid: str, model: str, tok, choices: list, chat: bool):
        self.rid, self.model, self.tok, self.choices, self.chat = rid, model, tok, choices, chat
        self.created = int(time.time())

    def _token_str(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None else str(tid)

    def _logprobs(self, index: int, lo: int, hi: int):
        r = self.choices[index]
        if r.params.logprobs is None:
            return None
        ids, lps = r.output_ids[lo:hi], r.logprobs[lo:hi]
        tops = r.top_logprobs[lo:hi] if r.params.logprobs else [[] for _ in ids]
        if self.chat:
            return {"content": [self._chat_logprob(t, lp, top) for t, lp, top in zip(ids, lps, tops, strict=True)]}
        return {
            "tokens": [self._token_str(t) for t in ids],
            "token_ids": list(ids),
            "token_logprobs": list(lps),
            "top_logprobs": [{self._token_str(a): b for a, b in top} for top in tops] if r.params.logprobs else None,
            "text_offset": [],
        }

    def _chat_logprob(self, tid: int, logprob: float, top) -> dict:
        s = self._token_str(tid)
        alternatives = [
            {"token": self._token_str(a), "logprob": b, "bytes": list(self._token_str(a).encode())} for a, b in top
        ]
        return {"token": s, "logprob": logprob, "bytes": list(s.encode()), "top_logprobs": alternatives}

    def usage(self) -> dict:
        """Prompt tokens once (the choices share the prompt), completion tokens of every choice."""
        p = len(self.choices[0].prompt_ids)
        c = sum(len(r.output_ids) for r in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def final(self, texts: list[str]) -> dict:
        """The non-streamed response; `texts[i]` is choice i's final text."""
        choices = []
        for i, (r, text) in enumerate(zip(self.choices, texts, strict=True)):
            n = len(r.output_ids)
            if self.chat:
                body = {"message": {"role": "assistant", "content": text}}
            else:
                body = {"text": text, "token_ids": list(r.output_ids)}
            choices.append({"index": i, **body, "logprobs": self._logprobs(i, 0, n), "finish_reason": r.finish_reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.rid, "object": obj, "created": self.created, "model": self.model,
            "choices": choices, "usage": self.usage(),
        }  # fmt: skip

    def chunk(self, index: int, delta, reason: str | None, logprobs=None, usage: bool = False) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
            obj = "text_completion"
        out = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if usage:
            out["usage"] = self.usage()
        return out

    def delta(self, index: int, text: str, lo: int, hi: int, reason: str | None, last: bool) -> dict:
        """A streamed chunk of choice `index`: new text, tokens lo..hi; `last` (every choice done) adds usage."""
        out = self.chunk(index, {"content": text} if self.chat else text, reason, self._logprobs(index, lo, hi), last)
        if not self.chat:
            out["choices"][0]["token_ids"] = list(self.choices[index].output_ids[lo:hi])  # extension: this chunk's
        return out

    def failure(self, req) -> tuple[int, dict]:
        """(HTTP status, error body) for a choice that ended with "error" (500) or "abort" (503)."""
        who = f"request {self.rid}" if len(self.choices) == 1 else f"choice {req.index} of request {self.rid}"
        done = f" after {len(req.output_ids)} tokens" if req.output_ids else ""
        if req.finish_reason == "error":
            return 500, error_body(f"{who} failed{done}: {req.error}", "server_error", code="generation_failed")
        return 503, error_body(f"{who} was aborted{done}: {req.error}", "server_error", code="aborted")
