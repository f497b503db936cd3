"""Serving image prompts with a tiny random composite model: the engine's greedy tokens equal greedy decoding by
the full forward (recomputed each step), also with the prompt chunked across its images and mixed with a text
request; the server answers `image_url` chat parts through the `openai` client and rejects what it cannot serve."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest
import torch
from serve_helpers import IMG, TINY_VISION, VE, VS, running_server, tiny_composite

from flashnext.batch import make_segments
from flashnext.errors import InputError
from flashnext.model.multimodal import get_rope_index
from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.sampling import SamplingParams
from flashnext.serve.server import build_app
from flashnext.tokenizer import load_tokenizer

VISION = TINY_VISION
P = 3 * 2 * 4 * 4
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_composite()


def _span(n: int) -> list[int]:
    return [VS, *[IMG] * n, VE]


def _full_logits(model, prompt: list[int], generated: list[int], pixel_values, grid) -> torch.Tensor:
    """The composite forward's pieces over the whole sequence: logits of its last token. Only the prompt's
    placeholders are images (a random model may generate the placeholder id; it is then a text token, as in a
    cached decode)."""
    if grid is None:
        return model(torch.tensor(prompt + generated)).logits[-1]
    ids = torch.tensor(prompt + generated)
    embeds = torch.cat(
        [model.embed(torch.tensor(prompt), pixel_values, grid), model.embed(ids[len(prompt) :], None, None)]
    )
    types = (ids == IMG).long()
    types[len(prompt) :] = 0
    positions, _ = get_rope_index(ids, [0, len(ids)], types, grid, VISION["spatial_merge_size"])
    seg = make_segments(torch.tensor([0, len(ids)], dtype=torch.int32), len(ids), positions)
    hidden, _, _ = model.model.language_model(ids, seg, inputs_embeds=embeds)
    return model.lm_head(hidden)[-1]


def _full_greedy(model, ids: list[int], pixel_values=None, grid=None, n: int = 8, logprobs: list | None = None):
    """Greedy decoding with the full forward over the whole sequence at every step (chosen log-probs appended
    to `logprobs` when given)."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = _full_logits(model, list(ids), out, pixel_values, grid)
            tok = int(logits.argmax())
            if logprobs is not None:
                logprobs.append(float(torch.log_softmax(logits.float(), -1)[tok]))
            out.append(tok)
    return out


@pytest.mark.parametrize("budget", [64, 7], ids=["one-chunk", "chunked-across-images"])
def test_engine_image_prompt_equals_full_forward(model, budget):
    grid = torch.tensor([[1, 4, 6], [1, 2, 4]])  # 6 and 2 merged tokens; non-square grids
    pixel_values = torch.randn(int(grid.prod(-1).sum()), P, generator=torch.Generator().manual_seed(2))
    prompt = [5, 17, 99, 3, 42, *_span(6), 7, 8, 9, *_span(2), 300, 11, 4, 250]
    text = [6, 60, 61, 62, 63, 64, 65]
    with torch.no_grad():  # the hand-assembled full forward is the model's forward
        assert torch.equal(
            _full_logits(model, prompt, [], pixel_values, grid),
            model(torch.tensor(prompt), pixel_values=pixel_values, image_grid_thw=grid).logits[-1],
        )
    want_lp = []
    want = _full_greedy(model, prompt, pixel_values, grid, logprobs=want_lp)
    want_text = _full_greedy(model, text)

    engine = Engine(model, max_slots=3, max_model_len=64, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=8, logprobs=0, **GREEDY)
    img = engine.add_request(prompt, params, pixel_values=pixel_values, image_grid_thw=grid)
    txt = engine.add_request(text, SamplingParams(max_tokens=8, **GREEDY))
    while not (img.finished and txt.finished):
        engine.step()
    assert img.output_ids == want
    # log-probs too: they move if any query selects other QSA blocks (e.g. block keys rotated at the wrong position)
    torch.testing.assert_close(torch.tensor(img.logprobs), torch.tensor(want_lp), rtol=0, atol=1e-4)
    assert txt.output_ids == want_text
    assert img.images is None and img.prompt_embeds is None  # nothing of the tower kept
    assert engine.cache.free_slots == engine.cache.max_slots


def test_engine_rejects_bad_image_requests(model):
    engine = Engine(model, max_slots=2, max_model_len=64)
    grid = torch.tensor([[1, 4, 6]])
    pv = torch.zeros(24, P)
    with pytest.raises(InputError, match="placeholders"):
        engine.add_request([5, *_span(5), 6], pixel_values=pv, image_grid_thw=grid)
    with pytest.raises(InputError, match="patches"):
        engine.add_request([5, *_span(6), 6], pixel_values=pv[:20], image_grid_thw=grid)
    text_model, _, _ = load_for_serving(None)
    with pytest.raises(InputError, match="text-only"):
        Engine(text_model, max_slots=1, max_model_len=32).add_request([5, 6], pixel_values=pv, image_grid_thw=grid)


def _png_data_url(w: int, h: int, seed: int) -> str:
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    arr = (torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_messages(url: str) -> list[dict]:
    parts = [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "this picture?"},
    ]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def image_server(model):
    engine = Engine(model, load_tokenizer(), max_slots=4, max_model_len=160, max_num_batched_tokens=64)
    with running_server(build_app(engine, "tiny-vl")) as base:
        yield base, engine


def test_server_answers_image_chat(image_server, model):
    from flashnext.vision_inputs import image_span, process_images

    base, engine = image_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    url = _png_data_url(24, 16, seed=0)  # non-square; the processor resizes it up to its min_pixels
    out = client.chat.completions.create(
        model="tiny-vl", messages=_image_messages(url), max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6

    # the same prompt built by hand and decoded by the full forward
    tok = load_tokenizer()
    images = process_images([url], model.model_config.vision_config)
    head, tail = tok.apply_chat_template(
        [{"role": "user", "content": "What is in\x00this picture?"}], add_generation_prompt=True, tokenize=False
    ).split("\x00")
    ids = tok.encode(head) + image_span(images.num_tokens[0], IMG, VS, VE) + tok.encode(tail)
    assert out.usage.prompt_tokens == len(ids)
    want = _full_greedy(model, ids, images.pixel_values, images.image_grid_thw, n=6)
    # thinking is on (the template's generation prompt opens a think block): the whole answer is its reasoning
    assert out.choices[0].message.model_extra["reasoning"] == tok.decode(want).strip()


def test_server_rejects_remote_urls_and_images_to_text_models(image_server):
    base, _ = image_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="remote image URLs are not supported"):
        client.chat.completions.create(
            model="tiny-vl", messages=_image_messages("https://example.com/cat.png"), max_tokens=2
        )
    model, tok, name = load_for_serving(None)
    with running_server(build_app(Engine(model, tok, max_slots=1, max_model_len=64), name)) as text_base:
        text_client = openai.OpenAI(base_url=f"{text_base}/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="text-only") as err:
            text_client.chat.completions.create(
                model=name, messages=_image_messages(_png_data_url(8, 8, seed=1)), max_tokens=2
            )
    assert json.loads(err.value.response.text)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("budget", [64, 7], ids=["one-chunk", "chunked-across-images"])
def test_image_prompt_with_speculative_decoding_equals_full_forward(model, budget):
    """The composite model's MTP head drafts for an image prompt (its cells rotate at the MRoPE positions): greedy
    tokens equal the full forward's, drafts were proposed and verified, and the state is freed."""
    assert model.mtp is not None  # the tiny config declares one MTP layer
    grid = torch.tensor([[1, 4, 6], [1, 2, 4]])
    pixel_values = torch.randn(int(grid.prod(-1).sum()), P, generator=torch.Generator().manual_seed(2))
    prompt = [5, 17, 99, 3, 42, *_span(6), 7, 8, 9, *_span(2), 300, 11, 4, 250]
    want = _full_greedy(model, prompt, pixel_values, grid, n=10)
    engine = Engine(model, max_slots=2, max_model_len=64, max_num_batched_tokens=budget)
    req = engine.add_request(
        prompt, SamplingParams(max_tokens=10, num_speculative_tokens=2, **GREEDY), pixel_values=pixel_values,
        image_grid_thw=grid,
    )  # fmt: skip
    while not req.finished:
        engine.step()
    assert req.output_ids == want
    assert engine.stats.spec_drafted > 0
    assert engine.cache.free_slots == engine.cache.max_slots


def test_image_prompt_draft_logits_equal_the_training_forward(model, monkeypatch):
    """The draft head's first proposal for an image prompt (prompt cells + the sampled token's cell, served with
    MRoPE positions and the QSA cache of cells) equals the training forward's `mtp_logits` at that cell."""
    grid = torch.tensor([[1, 4, 6]])
    pixel_values = torch.randn(int(grid.prod(-1).sum()), P, generator=torch.Generator().manual_seed(3))
    prompt = [5, 17, 99, *_span(6), 7, 8, 9, 300, 11]
    seen = []
    real = type(model).draft_step

    def spy(self, residual, next_ids, step, cache):
        logits, r_next = real(self, residual, next_ids, step, cache)
        seen.append(logits.clone())
        return logits, r_next

    monkeypatch.setattr(type(model), "draft_step", spy)
    engine = Engine(model, max_slots=1, max_model_len=64)
    req = engine.add_request(
        prompt, SamplingParams(max_tokens=4, num_speculative_tokens=1, **GREEDY), pixel_values=pixel_values,
        image_grid_thw=grid,
    )  # fmt: skip
    engine.step()  # the prefill samples the first token and proposes one draft
    ids = torch.tensor(prompt + req.output_ids[:1])
    types = (ids == IMG).long()
    types[len(prompt) :] = 0
    with torch.no_grad():
        out = model(ids, pixel_values=pixel_values, image_grid_thw=grid, mm_token_type_ids=types, return_mtp=True)
    # fp32; the serving path's fused projections and cached QSA differ from the training path by rounding only
    torch.testing.assert_close(seen[0][-1], out.mtp_logits[len(prompt) - 1], rtol=0, atol=1e-4)
    assert req.drafts == [int(out.mtp_logits[len(prompt) - 1].argmax())] or req.finished
