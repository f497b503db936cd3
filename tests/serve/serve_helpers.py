"""A small random model (every parameter perturbed, so PLE conv and norms matter), step helpers, a test server."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import torch
import uvicorn

from flashnext.config import parse_config, tiny_config
from flashnext.model.state import make_step
from flashnext.model.text import FlashNextForCausalLM
from flashnext.serve import prepare_for_inference

VS, VE, IMG = 512, 513, 514  # outside the bundled tokenizer's 512 ids, so text never encodes to them
TINY_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
)  # fmt: skip


def tiny_composite():
    """The tiny default text config (QSA with 8 indexer heads) + a 1-block vision tower, every weight perturbed."""
    from flashnext.model.multimodal import FlashNextForConditionalGeneration

    text = {**tiny_config().to_dict(), "vocab_size": 516}
    cfg = parse_config(dict(model_type="qwen4_exp", text_config=text, vision_config=dict(TINY_VISION),
                            image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE))  # fmt: skip
    m = FlashNextForConditionalGeneration(cfg).eval()
    m.init_weights(seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return m


def small_model(cfg_dict: dict, seed: int = 0) -> FlashNextForCausalLM:
    """Prepared for serving; its forward without state is still the plain path (the twins' reference)."""
    model = FlashNextForCausalLM(parse_config(cfg_dict).text).eval()
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return prepare_for_inference(model)


def run_step(model, cache, entries: list[tuple[int, int, list[int]]]) -> torch.Tensor:
    """entries: (slot, cached_len, new token ids) -> logits of the live entries' last tokens."""
    cu = [0]
    for _, _, ids in entries:
        cu.append(cu[-1] + len(ids))
    step = make_step(cu, [e[0] for e in entries], [e[1] for e in entries], cache.scratch_slot)
    ids = torch.tensor([t for e in entries for t in e[2]], dtype=torch.long)
    return model.forward_step(ids, step, cache)


def slot_state(cache, slot: int) -> list[torch.Tensor]:
    return [b[slot].clone() for b in cache.buffers()]


@contextlib.contextmanager
def running_server(app, timeout: float = 30.0):
    """Serve `app` with uvicorn on a free 127.0.0.1 port in a daemon thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


class StepFault:
    """Fault injection into one model instance's `forward_step` (restored on `remove()` / leaving the `with`).

    An entry of a step is hit when its new tokens contain `marker` (`where="anywhere"`) or when it is the first
    chunk of a prompt that starts with `marker` (`where="start"`: generated tokens never trigger it). With `mode`
    "raise" a step with a hit raises (for the first `times` hits, or always); with "nan" the hit entries' logits
    rows are NaN. `when` (ids, step) -> bool, if given, replaces the marker test for "raise". `delay` seconds of
    sleep per step slow the engine down (so concurrent requests overlap in time).
    """

    def __init__(self, model, marker: int | None = None, mode: str = "raise", where: str = "anywhere",
                 times: int | None = None, when=None, delay: float = 0.0):  # fmt: skip
        self.model, self.marker, self.mode, self.where = model, marker, mode, where
        self.times, self.when, self.delay = times, when, delay
        self.faults = 0
        self.inner = model.forward_step
        model.forward_step = self

    def remove(self) -> None:
        del self.model.forward_step

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def hits(self, ids: torch.Tensor, step) -> list[int]:
        cu, out = step.seg.cu_host, []
        for j in range(len(cu) - 1):
            chunk = ids[cu[j] : cu[j + 1]]
            if self.where == "start":
                hit = step.cached_host[j] == 0 and len(chunk) > 0 and int(chunk[0]) == self.marker
            else:
                hit = bool((chunk == self.marker).any())
            if hit:
                out.append(j)
        return out

    def __call__(self, ids, step, cache, inputs_embeds=None, **kw):
        if self.delay:
            time.sleep(self.delay)
        hit = self.when(ids, step) if self.when is not None else bool(self.hits(ids, step))
        if self.mode == "raise" and hit and (self.times is None or self.faults < self.times):
            self.faults += 1
            raise RuntimeError(f"injected fault (marker {self.marker})")
        if kw:  # a speculative step (rows, residual): "nan" rows would need its row layout
            assert self.mode == "raise", "StepFault(mode='nan') does not support speculative steps"
            return self.inner(ids, step, cache, inputs_embeds=inputs_embeds, **kw)
        logits = self.inner(ids, step, cache, inputs_embeds=inputs_embeds)
        if self.mode == "nan" and hit:
            logits = logits.clone()
            logits[self.hits(ids, step)] = float("nan")
        return logits


class GatedTokenizer:
    """A tokenizer whose `encode` of a text containing `gate` waits until `release` is set (signalling `entered`):
    a stand-in for tokenizing a huge prompt that takes as long as the test wants. Counts `encode` calls."""

    def __init__(self, tok, gate: str = "\u2603"):
        self.tok, self.gate = tok, gate
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        if self.gate in text:
            self.entered.set()
            assert self.release.wait(60), "the test never released the tokenizer"
        return self.tok.encode(text)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kw):
        text = self.tok.apply_chat_template(messages, add_generation_prompt, tokenize=False, **kw)
        return self.encode(text) if tokenize else text


def sse_events(lines) -> list:
    """The JSON objects of a server-sent event stream's `data:` lines, and "[DONE]" as a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
