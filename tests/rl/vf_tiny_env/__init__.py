"""A tiny verifiers (0.4.0) taskset for flashnext's tests: `Q: Say <word>.` -> the word. Installed-package style:
verifiers finds it as the taskset id `vf-tiny-env` (module `vf_tiny_env`, its Taskset exported in `__all__`).

Three weighted rewards (verifiers sums them: 0.5 * exact + 0.25 * mentions + 0.25 * short; `short` gives an untrained
model's completions different rewards, so its groups train) and one metric; the system prompt and the `num_tasks`
knob (`env.args`) exercise the config path."""

import verifiers.v1 as vf

WORDS = "red sun cat hat map cup box pen sea sky tree bird fish star moon rain road door book milk".split()


class SayData(vf.TaskData):
    answer: str


class SayTask(vf.Task[SayData]):
    @vf.reward(weight=0.5)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.rstrip(".") == self.data.answer)

    @vf.reward(weight=0.25)
    async def mentions(self, task: SayData, trace: vf.Trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.reward(weight=0.25)
    async def short(self, trace: vf.Trace) -> float:
        return max(0.0, 1.0 - len(trace.last_reply) / 40)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SayConfig(vf.TasksetConfig):
    num_tasks: int = 60
    """How many tasks (word i % 20 of task i)."""


class SayTaskset(vf.Taskset[SayTask, SayConfig]):
    def load(self) -> list[SayTask]:
        words = [WORDS[i % len(WORDS)] for i in range(self.config.num_tasks)]
        data = [SayData(id=f"say-{i}", prompt=f"Say {w}.", system_prompt="One word.", answer=w)
                for i, w in enumerate(words)]  # fmt: skip
        return [SayTask(d, self.config.task) for d in data]


__all__ = ["SayTaskset"]
