"""The engine's sampler: a token for each due row, its log-probs, and the request's stop conditions.

`Sampler.sample` draws one token per logits row with each request's params and generator (`serve.sampling.sample`;
a row that cannot be sampled comes back as `FAILED` with its reason); `Sampler.emit` appends tokens and their
log-probs to a request until one stops it and returns why ("stop", "length"; "error" with a message when
processing a token failed: that request's problem alone). Finishing and notifying the request is the engine's.
"""

from __future__ import annotations

import logging
import time

import torch

from flashnext.serve.logit_controls import LogitControls, reported_logprobs
from flashnext.serve.request import Request
from flashnext.serve.sampling import sample

__all__ = ["Sampler"]

log = logging.getLogger("flashnext.serve")


class Sampler:
    """Sample the due rows of a step and record their tokens; `tokenizer` (optional) detokenizes for stop
    strings, `eos_id` ends a request unless it ignores EOS, `max_model_len` bounds prompt + generation."""

    def __init__(self, tokenizer, eos_id: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.max_model_len = max_model_len
        self.controls = LogitControls(eos_id)  # penalties, logit_bias, min_tokens (the speculator's too)

    def sample(self, logits: torch.Tensor, reqs: list[Request]):
        """Row i of `logits` sampled for `reqs[i]` (after its penalties and logit controls): (tokens on the host,
        `FAILED` for a row that could not be sampled; the chosen tokens' log-probs or None when no request asked;
        the top-n log-probs (`torch.topk`) or None; {row: why it failed})."""
        want = any(r.params.logprobs is not None for r in reqs)
        errors: dict[int, str] = {}
        params = [r.params for r in reqs]
        ctl = self.controls.apply(logits, reqs)
        tokens, logprobs = sample(ctl, params, [r.generator for r in reqs], with_logprobs=want and ctl is logits,
                                  errors=errors)  # fmt: skip
        if want and ctl is not logits:
            logprobs = reported_logprobs(logits, ctl, params)
        chosen = logprobs.gather(1, tokens.clamp_min(0)[:, None]).squeeze(1).tolist() if want else None
        tokens_host = tokens.tolist()
        top_n = max((r.params.logprobs or 0) for r in reqs)
        top = torch.topk(logprobs, top_n, dim=-1) if top_n else None
        return tokens_host, chosen, top, errors

    def emit(
        self, req: Request, tokens: list[int], chosen: list[float] | None, top, rows: list[int]
    ) -> tuple[str | None, str | None]:
        """Record `tokens` in order (log-probs `chosen[j]`, top-n row `rows[j]` of `top`) until one stops the
        request: (its finish reason, an error message) or (None, None) when it goes on."""
        now = time.perf_counter()
        for j, tok in enumerate(tokens):
            try:
                reason = self.record(req, tok, chosen[j] if chosen is not None else None, top, rows[j], now)
            except Exception as e:  # e.g. the tokenizer failing on this request's text: its problem alone
                log.exception("request %s failed after sampling", req.request_id)
                return "error", f"processing the sampled token failed: {type(e).__name__}: {e}"
            if reason is not None:
                return reason, None
        return None, None

    def record(self, req: Request, tok: int, chosen: float | None, top, i: int, now: float) -> str | None:
        """Append a sampled token (and its log-probs, top-n from row `i` of `top`) to `req`; its stop reason or
        None."""
        req.output_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        if req.params.logprobs is not None:
            req.logprobs.append(chosen)
            if req.params.logprobs:
                n = req.params.logprobs
                req.top_logprobs.append(list(zip(top.indices[i, :n].tolist(), top.values[i, :n].tolist(), strict=True)))
        return self.stop_reason(req, tok)

    def stop_reason(self, req: Request, tok: int) -> str | None:
        """Why `req` stops after its last token `tok` (stop token or string, EOS, its length), or None."""
        p = req.params
        stop_id = tok in p.stop_token_ids or (tok == self.eos_id and not p.ignore_eos)
        if self.tokenizer is not None:
            ids = req.output_ids[:-1] if stop_id else req.output_ids
            req.text = self.tokenizer.decode(ids)
            for s in p.stop:
                at = req.text.find(s)
                if at >= 0:
                    req.text = req.text[:at]
                    return "stop"
        if stop_id:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None
