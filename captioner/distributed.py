"""What training shares between processes (DDP) and across a resume: the gather of records, the random generators."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist


def distributed() -> bool:
    """Whether this process is one of several (DDP)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(records: list) -> list:
    """Every rank's `records`, concatenated in rank order (under DDP; otherwise `records` itself)."""
    if not distributed():
        return records
    everyone: list[list | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    return [record for part in everyone for record in part]


def rng_states() -> dict:
    """The random generators that training draws from: Python's (a random caption per image) and torch's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_states(states: dict) -> None:
    random.setstate((states["python"][0], tuple(states["python"][1]), states["python"][2]))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
