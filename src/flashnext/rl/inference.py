"""Where rollouts are sampled: the engine in this process, or a `flashnext serve` over HTTP (token in, tokens out).

Both clients take the same `GenRequest`s (prompt ids and images, n choices sharing one prefill, a seed) and return
per request its `Choice`s: token ids, the engine's temperature-processed log-prob of each token, the routed experts
of every token it ran (uint16, for router replay) and the weight version that sampled it.

The HTTP client speaks the server's token-in route `POST /inference/v1/generate` (see `serve/token_routes.py`),
one request per prompt, many in flight at once so the server batches them.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from flashnext.errors import FlashNextError
from flashnext.rl.envs import Prompt
from flashnext.serve.rl_routes import decode_tensor
from flashnext.serve.sampling import SamplingParams


@dataclass
class GenRequest:
    """One prompt to sample `n` completions of, with its own seed (choice i uses `choice_seed(seed, i)`)."""

    prompt: Prompt
    n: int
    seed: int


@dataclass
class SamplingSpec:
    """How every rollout of a step is sampled (from the run config)."""

    max_tokens: int
    temperature: float
    stop_token_ids: list[int]
    routed_experts: bool = True

    def params(self, n: int, seed: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, seed=seed, n=n, logprobs=0,
            logprobs_mode="processed", stop_token_ids=list(self.stop_token_ids),
            return_routed_experts=self.routed_experts,
        )  # fmt: skip


@dataclass
class Choice:
    """One sampled completion (`finish_reason` "error"/"abort": failed, `error` says why)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed: torch.Tensor | None = None
    weight_version: int = 0
    error: str | None = None
    loss_mask: list[int] | None = None  # multi-turn (rl/tool_env.py): 0 on the environment's ids between turns


class LocalInference:
    """Rollouts from an `Engine` in this process; `generate` steps the engine until its requests finish (the
    caller must be the only one stepping it)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, requests: list[GenRequest], spec: SamplingSpec) -> list[list[Choice]]:
        eng = self.engine
        parents = [
            eng.add_request(r.prompt.ids, spec.params(r.n, r.seed), pixel_values=r.prompt.pixel_values,
                            image_grid_thw=r.prompt.image_grid_thw)
            for r in requests
        ]  # fmt: skip
        while not all(c.finished for p in parents for c in p.choices):
            eng.step()
        out = []
        for p in parents:
            comps = [c.completion(False) for c in p.choices]
            out.append([
                Choice(c.token_ids, c.logprobs or [], c.finish_reason, c.routed_experts, c.weight_version, c.error)
                for c in comps
            ])  # fmt: skip
        return out


class RemoteInference:
    """Rollouts from a `flashnext serve` at `url` (e.g. `http://127.0.0.1:8000`) through its token-in route.

    Args:
        url: the server's base URL (without `/v1`).
        api_key: its `--api-key`, if it has one.
        timeout: seconds one request may take.
        concurrency: requests in flight at once (the server batches them).
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0, concurrency: int = 64):
        self.url, self.api_key, self.timeout, self.concurrency = url.rstrip("/"), api_key, timeout, concurrency

    def generate(self, requests: list[GenRequest], spec: SamplingSpec) -> list[list[Choice]]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(requests)))) as pool:
            return list(pool.map(lambda r: self._one(r, spec), requests))

    def _one(self, r: GenRequest, spec: SamplingSpec) -> list[Choice]:
        if r.prompt.pixel_values is not None:
            raise FlashNextError("image prompts are sampled in one process only (the token-in route takes ids)")
        p = spec.params(r.n, r.seed)
        body = {
            "token_ids": list(r.prompt.ids),
            "sampling_params": {
                "max_tokens": p.max_tokens, "temperature": p.temperature, "seed": p.seed, "n": p.n,
                "stop_token_ids": p.stop_token_ids, "logprobs_mode": p.logprobs_mode,
                "return_routed_experts": p.return_routed_experts,
            },
        }  # fmt: skip
        reply = post_json(f"{self.url}/inference/v1/generate", body, self.api_key, self.timeout)
        version = int(reply.get("weight_version", 0))
        return [
            Choice(
                c["token_ids"],
                c["logprobs"],
                c["finish_reason"],
                decode_tensor(c["routed_experts"]) if c.get("routed_experts") else None,
                version,
                c.get("error"),
            )  # fmt: skip
            for c in sorted(reply["choices"], key=lambda c: c["index"])
        ]


def post_json(url: str, body: dict | None, key: str | None, timeout: float) -> dict:
    """POST a JSON body (None: empty) and return the JSON reply; `FlashNextError` with the server's message."""
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        raise FlashNextError(f"POST {url}: HTTP {e.code}: {detail}") from None
    except urllib.error.URLError as e:
        raise FlashNextError(f"POST {url}: cannot reach the inference server ({e.reason})") from None
    except ValueError as e:  # not a URL urllib can open (`inference.url` is checked when the config loads)
        raise FlashNextError(f"POST {url}: {e}") from None
