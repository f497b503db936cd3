"""The multi-turn calculator environment through the engine: a tool call, the result rendered by the template, the
answer; the trainer's sequence holds exactly the ids the engine sampled (a deliberately non-canonical tokenisation of
the call survives), the environment's ids out of the loss."""

from __future__ import annotations

import re

import pytest

from flashnext.rl.envs import load_environment
from flashnext.rl.inference import LocalInference, SamplingSpec
from flashnext.rl.orchestrator import Orchestrator
from flashnext.rl.rollouts import pack_samples
from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving


class Scripted:
    """Test hook on the engine's sampler: turn 1 calls the calculator (its text tokenised one character at a time,
    which the tokenizer itself would never produce), turn 2 answers; both end with <|im_end|>."""

    def __init__(self, engine):
        self.tok, self.sample = engine.tokenizer, engine.sampler.sample
        self.end = self.tok.encode("<|im_end|>")[0]
        self.ids, self.turns = {}, []
        engine.sampler.sample = self

    def script(self, prompt: str, index: int = 0) -> list[int]:
        a, op, b = re.search(r"What is (\d+) (\S) (\d+)\?", prompt).groups()
        b = str(int(b) + index % 2)  # odd choices call with a wrong argument: their answer is wrong
        if "<tool_response>" in prompt:
            result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt)[-1]
            return self.tok.encode(f"\n</think>\n\nThe answer is {result}.") + [self.end]
        call = (
            f"\n</think>\n\n<tool_call>\n<function=calculator>\n<parameter=a>\n{a}\n</parameter>\n"
            f"<parameter=op>\n{op}\n</parameter>\n<parameter=b>\n{b}\n</parameter>\n</function>\n</tool_call>"
        )
        head = "\n</think>\n\n<tool_call>"
        return [i for ch in head for i in self.tok.encode(ch)] + self.tok.encode(call[len(head) :]) + [self.end]

    def __call__(self, logits, reqs):
        tokens, chosen, top, errors = self.sample(logits, reqs)
        for i, req in enumerate(reqs):
            if id(req) not in self.ids:  # the request held with its script: a freed one's id could be reused
                prompt = self.tok.decode(req.prompt_ids, skip_special_tokens=False)
                self.ids[id(req)] = (req, self.script(prompt, req.index))
                self.turns.append(self.ids[id(req)][1])
            script = self.ids[id(req)][1]
            tokens[i] = script[min(len(req.output_ids), len(script) - 1)]
            if chosen is not None:
                chosen[i] = -1.0  # a recognisable log-prob for the sampled (scripted) tokens
        return tokens, chosen, top, errors


def test_respond_renders_the_tool_result_as_the_template_does():
    """Fast: the environment's ids after a calling turn, and none after an answer or past max_turns."""
    _, tok, _ = load_for_serving(None)
    env = load_environment("calc", {})
    env.setup(tok, None)
    task = {"a": 6, "op": "*", "b": 7}
    call = (
        "\n</think>\n\n<tool_call>\n<function=calculator>\n<parameter=a>\n6\n</parameter>\n<parameter=op>\n*\n"
        "</parameter>\n<parameter=b>\n7\n</parameter>\n</function>\n</tool_call><|im_end|>"
    )
    reply = env.respond(task, [call])
    assert tok.decode(reply, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert env.respond(task, ["\n</think>\n\n42<|im_end|>"]) is None
    assert env.respond(task, [call, call]) is None  # max_turns = 2
    assert env.score(task, call + "<tool_response>\n42\n</tool_response>\n</think>\n\nIt is 42.").reward == 1.0
    assert env.score(task, "\n</think>\n\nIt is 41.").reward == 0.0


@pytest.fixture(scope="module")
def run():
    model, tok, _ = load_for_serving(None)
    engine = Engine(model, tok, max_slots=4, max_model_len=1024, max_num_batched_tokens=256)
    script = Scripted(engine)
    env = load_environment("calc", {})
    env.setup(tok, model.config)
    spec = SamplingSpec(max_tokens=200, temperature=1.0, stop_token_ids=[tok.eos_token_id], routed_experts=False)
    orch = Orchestrator(env, LocalInference(engine), spec, batch_size=1, group_size=1, drop_zero=False)
    return tok, env, script, orch.rollouts(step=1, policy_step=0)


@pytest.mark.slow  # ~1 min on a loaded 2-core box: a ~600-token tools prompt, prefilled twice, and two turns
def test_episode_ids_are_the_sampled_ones(run):
    tok, env, script, batch = run
    assert len(batch.samples) == 1 and len(script.turns) == 2  # one choice, two turns
    for s in batch.samples:
        first, second = script.turns
        text = tok.decode(first, skip_special_tokens=False)
        assert tok.encode(text) != first  # the call's ids are not the tokenizer's own: a re-tokenisation would differ
        reply = s.completion_ids[len(first) : len(s.completion_ids) - len(second)]
        assert s.completion_ids == first + reply + second
        assert s.loss_mask == [1] * len(first) + [0] * len(reply) + [1] * len(second)
        result = env.tool_result(s.task, "calculator", {"a": s.task["a"], "op": s.task["op"], "b": s.task["b"]})
        assert tok.decode(reply, skip_special_tokens=False) == (
            f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
        )  # the tool result as the template renders it, and the next generation prompt
        assert s.logprobs == [-1.0] * len(first) + [0.0] * len(reply) + [-1.0] * len(second)
        assert s.reward == 1.0 and s.metrics["tool_calls"] == 1.0 and s.finish_reason == "stop"


@pytest.mark.slow
def test_environment_ids_are_out_of_the_loss(run):
    _, _, _, batch = run
    s = batch.samples[0]
    (b,) = pack_samples([s], token_budget=10_000)
    P = len(s.prompt_ids)
    assert b.input_ids.tolist() == s.prompt_ids + s.completion_ids
    labels = b.labels.tolist()[P:]
    assert labels == [t if m else -100 for t, m in zip(s.completion_ids, s.loss_mask, strict=True)]
    assert all((a == 0) == (m == 0) for a, m in zip(b.advantages.tolist()[P:], s.loss_mask, strict=True)) or \
        s.advantage == 0  # fmt: skip


@pytest.mark.slow  # ~1-2 min: two RL steps of calc episodes through a server
def test_flashnext_rl_runs_calc_episodes_through_a_server(tmp_path, monkeypatch):
    """`flashnext rl`'s trainer with `env.name = "calc"` and `--inference-url`: the episodes' turns go through the
    token-in route, the scripted calls reach the environment's calculator, and the steps train."""
    import test_rl_remote as remote  # (it puts tests/serve on sys.path)
    import torch
    from serve_helpers import running_server

    from flashnext.build import from_pretrained
    from flashnext.rl.config import load_rl_config
    from flashnext.rl.loop import RLTrainer
    from flashnext.serve.server import build_app
    from flashnext.tokenizer import load_tokenizer

    torch.set_num_threads(2)
    ckpt = remote._checkpoint(tmp_path / "ckpt")
    engine = Engine(from_pretrained(ckpt), load_tokenizer(), 4, 1024, 256)
    Scripted(engine)
    monkeypatch.setenv("FLASHNEXT_ADMIN_KEY", remote.KEY)
    more = {"env.name": "calc", "env.max_tokens": 200, "orchestrator.batch_size": 1, "orchestrator.group_size": 2,
            "orchestrator.eval_tasks": 1}  # fmt: skip
    with running_server(build_app(engine, "ckpt", admin_key=remote.KEY, log_every=1e9)) as url:
        trainer = RLTrainer(load_rl_config(None, remote._args(tmp_path, ckpt, url, **more)), say=lambda *a: None)
        history = trainer.run()
    steps = [m for m in history if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["reward/tool_calls"] == 1.0 and m["reward/mean"] == 0.5 for m in steps)  # choice 1 of 2 is right
    assert engine.weight_version == 2
