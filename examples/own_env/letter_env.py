"""A complete RL environment in a dozen lines: answer a word that starts with the asked letter.

    cd examples/own_env && flashnext rl --config ../../configs/tiny-rl.toml --env letter_env:LetterEnv
"""

from flashnext.rl.envs import Environment, Prompt, Score


class LetterEnv(Environment):
    name = "letter"

    def draw(self, rng):  # task `index` of a split: drawn from a seeded generator, so runs are reproducible
        return {"letter": rng.choice("bcdfmprst")}

    def prompt(self, task):
        return Prompt(self.encode(f"Q: Say a word that starts with {task['letter']}.\nA:"))

    def score(self, task, completion):  # a reward in [0, 1]
        words = completion.strip().split()
        return Score(float(bool(words) and words[0].lower().startswith(task["letter"])))
