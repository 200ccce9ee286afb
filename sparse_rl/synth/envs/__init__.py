"""Sandboxed tool environments: a confined file system, SQLite, a calendar API, Python execution,
and `combo` (file system + SQLite in one episode)."""

from sparse_rl.synth.envs.base import Env, ToolError
from sparse_rl.synth.envs.calendar import CalendarEnv
from sparse_rl.synth.envs.code import CodeEnv
from sparse_rl.synth.envs.combo import ComboEnv
from sparse_rl.synth.envs.fs import FsEnv
from sparse_rl.synth.envs.sql import SqlEnv

ENVS: dict[str, type[Env]] = {"fs": FsEnv, "sql": SqlEnv, "calendar": CalendarEnv, "code": CodeEnv,
                              "combo": ComboEnv}

__all__ = ["ENVS", "Env", "ToolError", "FsEnv", "SqlEnv", "CalendarEnv", "CodeEnv", "ComboEnv"]
