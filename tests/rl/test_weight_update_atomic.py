"""Weight updates are all or nothing: a bad piece (unknown name, wrong shape, another dtype), a truncated upload or a
bad piece on one of several uploads leaves the served model bitwise as it was and keeps it serving; the error names
the piece, `end` says the update was aborted. Admin routes answer malformed bodies with an OpenAI-shaped 400."""

from __future__ import annotations

import http.client
import json
import struct
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
import torch
from rl_helpers import text_model

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
from serve_helpers import running_server  # noqa: E402

from flashnext.build import build_model  # noqa: E402
from flashnext.errors import ConfigError, FlashNextError, InputError  # noqa: E402
from flashnext.rl import weights  # noqa: E402
from flashnext.rl.inference import post_json  # noqa: E402
from flashnext.serve.engine import Engine  # noqa: E402
from flashnext.serve.server import build_app  # noqa: E402
from flashnext.serve.weight_update import WeightPiece, copy_pieces, encode_piece  # noqa: E402
from flashnext.tokenizer import load_tokenizer  # noqa: E402

KEY = "admin-secret"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _post(url: str, path: str, body: bytes, key: str | None = KEY, ctype="application/json") -> tuple[int, dict]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Content-Type": ctype, **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def _frames(pieces) -> bytes:
    out = b""
    for p in pieces:
        header, payload = encode_piece(p)
        out += header + bytes(payload)
    return out


@pytest.fixture
def served(tok):
    model = text_model()
    engine = Engine(model, tok, 2, 64, 32)
    with running_server(build_app(engine, "tiny", admin_key=KEY, log_every=1e9)) as url:
        yield url, engine, model


def _begin(url) -> str:
    return post_json(f"{url}/admin/weights/begin", None, KEY, 30)["update_id"]


def _good_pieces(model) -> list[WeightPiece]:
    """New values for the first two parameters (these would change the model if applied)."""
    (n1, p1), (n2, p2) = list(model.named_parameters())[:2]
    return [WeightPiece(n1, torch.full_like(p1, 0.5)), WeightPiece(n2, torch.full_like(p2, -0.5))]


def test_an_engine_with_frozen_graphs_refuses_updates(tok):
    """Weights frozen into the graphs (`serve.frozen`): `load_weights` raises and the admin route answers 409 before
    pausing anything; nothing is copied (no graph is compiled either: the refusal needs none)."""
    model = text_model()
    engine = Engine(model, tok, 2, 64, 32, decode_graph=True, prefill_lengths=[], freeze_weights=True)
    before = _snapshot(model)
    with pytest.raises(ConfigError, match="frozen"):
        engine.load_weights(_good_pieces(model))
    with running_server(build_app(engine, "tiny", admin_key=KEY, log_every=1e9)) as url:
        status, body = _post(url, "/admin/weights/begin", b"")
    assert status == 409 and "frozen" in json.dumps(body)
    assert _unchanged(model, before) and engine.decode_graph.compiles == 0


@pytest.mark.parametrize("bad", ["shape", "dtype", "name"])
def test_a_bad_later_piece_applies_nothing(served, bad):
    url, engine, model = served
    before, version = _snapshot(model), engine.weight_version
    name, p = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    wrong = {
        "shape": WeightPiece(name, torch.zeros(p.shape[0], p.shape[1] + 1)),
        "dtype": WeightPiece(name, p.detach().to(torch.float64)),  # silently cast before: now refused
        "name": WeightPiece("nope.weight", torch.zeros(3)),
    }[bad]
    uid = _begin(url)
    status, reply = _post(url, f"/admin/weights/update?update_id={uid}", _frames([*_good_pieces(model), wrong]),
                          ctype="application/octet-stream")  # fmt: skip
    assert status == 400, reply
    msg = reply["error"]["message"]
    expect = {
        "shape": [name, str(tuple(p.shape)), str((p.shape[0], p.shape[1] + 1))],
        "dtype": [name, "float32", "float64"],
        "name": ["'nope.weight'"],
    }[bad]
    assert all(s in msg for s in expect) and "nothing will be applied" in msg, msg
    status, reply = _post(url, "/admin/weights/end", json.dumps({"update_id": uid, "weight_version": 7}).encode())
    assert status == 409 and "nothing was applied" in reply["error"]["message"], reply
    assert _unchanged(model, before) and engine.weight_version == version and engine.admitting
    # and a good update afterwards goes through
    uid = _begin(url)
    status, reply = _post(url, f"/admin/weights/update?update_id={uid}", _frames(_good_pieces(model)),
                          ctype="application/octet-stream")  # fmt: skip
    assert status == 200 and reply["tensors"] == 2, reply
    assert _unchanged(model, before)  # held until `end`
    status, reply = _post(url, "/admin/weights/end", json.dumps({"update_id": uid, "weight_version": 8}).encode())
    assert status == 200 and engine.weight_version == 8 and reply["tensors"] == 2
    assert (next(model.parameters()) == 0.5).all()


def test_a_truncated_upload_or_a_bad_sibling_upload_applies_nothing(served):
    url, engine, model = served
    before = _snapshot(model)
    uid = _begin(url)
    body = _frames(_good_pieces(model))
    status, reply = _post(url, f"/admin/weights/update?update_id={uid}", body[:-3], ctype="application/octet-stream")
    assert status == 400 and "truncated" in reply["error"]["message"], reply
    assert _post(url, "/admin/weights/end", json.dumps({"update_id": uid}).encode())[0] == 409
    assert _unchanged(model, before) and engine.admitting
    # two uploads of one update (two trainer ranks): the first is fine, the second refused -> nothing of either
    uid = _begin(url)
    assert _post(url, f"/admin/weights/update?update_id={uid}", body, ctype="application/octet-stream")[0] == 200
    bad = _frames([WeightPiece("nope", torch.zeros(2))])
    assert _post(url, f"/admin/weights/update?update_id={uid}", bad, ctype="application/octet-stream")[0] == 400
    status, reply = _post(url, "/admin/weights/end", json.dumps({"update_id": uid}).encode())
    assert status == 409 and "no tensor 'nope'" in reply["error"]["message"]
    assert _unchanged(model, before) and engine.admitting


def test_sync_distributed_raises_and_the_server_keeps_its_weights(served):
    url, engine, model = served
    before = _snapshot(model)
    trainer = text_model(seed=1)
    trainer.register_buffer("extra_buffer", torch.zeros(3))  # the server has no such tensor
    with pytest.raises(FlashNextError, match="weight sync failed.*no tensor 'extra_buffer'"):
        weights.sync_distributed(trainer, weights.HTTPWeightSync(url, KEY), version=3, full=True)
    assert _unchanged(model, before) and engine.weight_version == 0 and engine.admitting


def test_the_sender_converts_to_the_server_dtype(tok):
    """fp32 trainer weights to a bf16 server: the client sends each tensor in the server's dtype (which the server
    requires); the served weights are the trainer's rounded to bf16."""
    trainer = text_model()
    served = build_model(trainer.config, seed=5, dtype=torch.bfloat16)
    engine = Engine(served, tok, 2, 64, 32)
    with running_server(build_app(engine, "tiny", admin_key=KEY, log_every=1e9)) as url:
        weights.sync_distributed(trainer, weights.HTTPWeightSync(url, KEY), version=2)
    theirs = dict(trainer.named_parameters())
    assert all(torch.equal(p, theirs[n].detach().to(torch.bfloat16)) for n, p in served.named_parameters())


def test_local_copy_checks_every_piece_first():
    model = text_model()
    before = _snapshot(model)
    bad = WeightPiece("nope", torch.zeros(2))
    with pytest.raises(InputError, match="no tensor 'nope'"):
        copy_pieces(model, [*_good_pieces(model), bad])
    assert _unchanged(model, before)


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/admin/weights/end", b"{not json", "not JSON"),
        ("/admin/weights/end", b"[1, 2]", "JSON object"),
        ("/admin/weights/end", b'{"update_id": "%s", "weight_version": "abc"}', "weight_version"),
        ("/admin/weights/end", b'{"update_id": "%s", "weight_version": 1.5}', "weight_version"),
        ("/admin/weights/end", b'{"weight_version": 3}', "update_id is required"),
        ("/admin/weights/update", b"", "update_id is required"),
        ("/admin/weights/begin?timeout_s=soon", b"", "timeout_s"),
    ],
)
def test_admin_routes_answer_400_on_bad_bodies(served, path, body, needle):
    url, engine, model = served
    uid = _begin(url)
    status, reply = _post(url, path, body.replace(b"%s", uid.encode()))
    assert status == 400, reply
    assert needle in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error", reply
    assert _post(url, "/admin/weights/end", json.dumps({"update_id": uid}).encode())[0] == 200
    assert engine.admitting


def test_a_payload_frame_header_is_checked_before_its_payload_is_read():
    """The header of a refused piece is enough: the reader never allocates its payload."""
    from flashnext.serve.weight_update import FrameReader

    seen = []

    def check(header):
        seen.append(header["name"])
        raise InputError("refused")

    frame = _frames([WeightPiece("big", torch.zeros(1 << 16))])
    reader = FrameReader(check)
    with pytest.raises(InputError, match="refused"):
        list(reader.feed(frame[: 4 + struct.unpack_from("<I", frame)[0]]))
    assert seen == ["big"] and reader.peak_bytes == 0


def test_an_update_whose_pause_timed_out_applies_nothing(served):
    url, engine, model = served
    before = _snapshot(model)
    uid = post_json(f"{url}/admin/weights/begin?timeout_s=0.3", None, KEY, 30)["update_id"]
    status, _ = _post(url, f"/admin/weights/update?update_id={uid}", _frames(_good_pieces(model)),
                      ctype="application/octet-stream")  # fmt: skip
    assert status == 200
    deadline = time.monotonic() + 30
    while not engine.admitting:  # the engine loop ends the pause by itself
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, reply = _post(url, "/admin/weights/end", json.dumps({"update_id": uid}).encode())
    assert status == 409 and "timed out" in reply["error"]["message"]
    assert _unchanged(model, before) and engine.weight_version == 0
