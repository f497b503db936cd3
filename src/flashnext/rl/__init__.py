"""Reinforcement learning: engine rollouts -> environment rewards -> IPO trainer steps -> weight sync.

Beside `train/` and `serve/` and built from both (neither imports this package); `cli/rl.py` is its command line.
- `envs.py`: environments (tasks, prompts, rewards; built-in `reverse`, `arith`, `color`; user `module:Class`);
- `inference.py`: where rollouts are sampled (the engine in this process, or `flashnext serve` over HTTP);
- `rollouts.py`: group advantages, the zero-advantage filter, packing samples into training micro-batches;
- `orchestrator.py`: a step's rollouts and the held-out evaluation; the off-policy pipeline;
- `weights.py`: weight sync (in place in one process; streamed to a server, tables by row shard);
- `config.py`: the run config (`[orchestrator]`, `[env]`, `[inference]` on top of the training run config);
- `loop.py`: the RL workload of the one training loop (`train/loop.py`): the rollout source, the weight-sync
  hook; `rl_trainer` builds the `Trainer` of an RL run.
"""
