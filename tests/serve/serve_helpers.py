"""A small random model (every parameter perturbed, so PLE conv and norms matter), step helpers, a test server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import torch
import uvicorn

from flashnext.config import parse_config
from flashnext.model.state import make_step
from flashnext.model.text import FlashNextForCausalLM
from flashnext.serve import prepare_for_inference


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
