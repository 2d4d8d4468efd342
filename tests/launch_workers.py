"""The launcher's own tests' worker (tests/test_launcher.py): a module that imports nothing beyond torch, so that a
spawned worker's start costs the interpreter, torch and the launcher, not the suite's helpers."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def launch_facts(rank: int, world_size: int, name: str) -> dict:
    """What a worker sees of its start: the environment variable ``name``, its pid, its intra-op threads, and
    one all-reduce across the group."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"value": os.environ.get(name), "pid": os.getpid(), "sum": total.item(), "threads": torch.get_num_threads()}
