"""Verifiable task synthesis: math generators, sandboxed tool environments, the agent loop,
multi-level filters and difficulty calibration.

Public API for other stages:
  verify(task, completion) -> float          # reward for any synth task record (math/*, tool/*, rg/*)
  make_math_task(family, seed, index, level, length) -> dict
  make_tool_task(env, seed, index, level) -> dict | None
  run_episode(task, policy, max_turns) -> trajectory dict;  Policy protocol: chat(messages, tools) -> dict
  run_python(code, Limits(...)) -> ExecResult  # the sandbox
"""

from sparse_rl.synth.verify import verify

__all__ = ["verify"]
