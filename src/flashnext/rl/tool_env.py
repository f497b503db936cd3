"""Multi-turn tool environments: the model calls a tool, the environment answers as the chat template renders a
tool result, the model goes on; the reward looks at the whole exchange.

A `ToolEnvironment` adds `respond(task, turns)` to an `Environment`: given the model's turns so far (decoded), the
token ids to append before the model's next turn (the tool result and the next generation prompt), or None when the
episode ends. The orchestrator (`rl/orchestrator.py`) then samples the next turn from prompt + every sampled id +
the environment's ids, so the trainer sees exactly the ids the engine sampled (a parsed tool call is never
re-tokenised), with the environment's ids in the sequence but out of the loss (`Sample.loss_mask`).

Built in: `calc` (`CalcEnv`): "What is a op b?" with a `calculator(a, op, b)` tool offered in the system turn; the
model's XML call is parsed (`serve/chat_parse.py`), the result comes back as a `<tool_response>` user turn
rendered by the tokenizer's own template, and the reward is 1 for the exact number in the final answer's content
(metric `tool_calls`: the calls made).
"""

from __future__ import annotations

import re
from typing import Any

from flashnext.rl.environment import EnvError, Environment, Prompt, Score, _call, _where
from flashnext.serve.chat_parse import OutputParser

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Compute a op b.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "op": {"type": "string", "enum": ["+", "-", "*"]},
                           "b": {"type": "integer"}},
            "required": ["a", "op", "b"],
        },
    },
}  # fmt: skip
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
END_OF_TURN = "<|im_end|>"


class ToolEnvironment(Environment):
    """An `Environment` whose episodes have several model turns (at most `max_turns`); a turn ends at the chat
    template's end of turn (`turn_stop_ids`), and `respond` says what comes back."""

    max_turns = 2
    tools: list[dict] = []

    def turn_stop_ids(self) -> list[int]:
        """Ids that end a model turn (besides EOS): the template's `<|im_end|>`."""
        return self.encode(END_OF_TURN)[-1:]

    def messages(self, task: dict[str, Any]) -> list[dict]:
        raise NotImplementedError

    def tool_result(self, task: dict[str, Any], name: str, arguments: dict) -> str:
        raise NotImplementedError

    def prompt(self, task):
        ids = self.tokenizer.apply_chat_template(self.messages(task), tools=self.tools, add_generation_prompt=True)
        return Prompt(list(ids))

    def parse_turn(self, text: str):
        return OutputParser(True, True, "xml", self.tools).parse(text, final=True)

    def conversation(self, task: dict[str, Any], turns: list[str]) -> list[dict]:
        """The chat messages of the episode: the task's, then each model turn (parsed) and its tool results."""
        messages = list(self.messages(task))
        for text in turns:
            p = self.parse_turn(text.removesuffix(END_OF_TURN))
            calls = [{"type": "function", "function": {"name": c.name, "arguments": _loads(c.arguments)}}
                     for c in p.calls]  # fmt: skip
            messages.append({"role": "assistant", "content": p.content, "reasoning_content": p.reasoning,
                             **({"tool_calls": calls} if calls else {})})  # fmt: skip
            for call in calls:
                fn = call["function"]
                messages.append({"role": "tool", "content": self.tool_result(task, fn["name"], fn["arguments"])})
        return messages

    def respond(self, task: dict[str, Any], turns: list[str]) -> list[int] | None:
        """The ids after the model's last turn (which ended with `<|im_end|>`): the template's rendering of its
        tool results and the next generation prompt, or None when the last turn called no tool."""
        if len(turns) >= self.max_turns or not self.parse_turn(turns[-1].removesuffix(END_OF_TURN)).calls:
            return None
        history = self.conversation(task, turns)
        last = max(i for i, m in enumerate(history) if m["role"] == "assistant")
        before = self.tokenizer.apply_chat_template(history[: last + 1], tools=self.tools, tokenize=False)
        after = self.tokenizer.apply_chat_template(history, tools=self.tools, add_generation_prompt=True,
                                                   tokenize=False)  # fmt: skip
        if not (after.startswith(before) and before.endswith(END_OF_TURN + "\n")):
            raise ValueError("the chat template does not render the tool results after the assistant turn")
        return self.encode("\n" + after[len(before) :])  # the sampled turn ended with <|im_end|>: "\n" follows


def respond(env: ToolEnvironment, split: str, index: int, task: dict[str, Any], turns: list[str]) -> list[int] | None:
    """`env.respond(task, turns)`, checked: an exception, or a result that is not None or a list of ids, raises
    `EnvError` naming the environment and the task."""
    ids = _call(env, split, index, "respond", task, turns)
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise EnvError(f"{_where(env, split, index)}: respond() returned {type(ids).__name__}, not a list of ids")
    return ids


def _loads(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class CalcEnv(ToolEnvironment):
    """ "What is a op b?" with a calculator tool; reward 1 for the exact number in the final answer."""

    name = "calc"
    tools = [CALCULATOR]

    def __init__(self, max_value: int = 50, **kw):
        kw.setdefault("max_tokens", 192)  # a call in the tiny vocabulary is ~130 tokens
        super().__init__(**kw)
        self.max_value = max_value

    def draw(self, rng):
        return {"a": rng.randint(0, self.max_value), "op": rng.choice(sorted(OPS)), "b": rng.randint(0, self.max_value)}

    def messages(self, task):
        return [{"role": "user", "content": f"What is {task['a']} {task['op']} {task['b']}? Use the calculator."}]

    def tool_result(self, task, name, arguments):
        a, op, b = arguments.get("a"), arguments.get("op"), arguments.get("b")
        if name != "calculator" or op not in OPS or not all(isinstance(x, int) for x in (a, b)):
            return "error: calculator(a: integer, op: + - *, b: integer)"
        return str(OPS[op](a, b))

    def score(self, task, completion):
        final = completion.rsplit("</tool_response>", 1)[-1]
        content = final.rsplit("</think>", 1)[-1]
        found = re.findall(r"-?\d+", content)
        want = OPS[task["op"]](task["a"], task["b"])
        return Score(float(bool(found) and int(found[-1]) == want), {"tool_calls": completion.count("<tool_call>")})
