"""torch.compile for the model's functions (the training step, the searches' words, the encoder's forward), and the
one rule that keeps it right under CUDA graphs.

With `mode="reduce-overhead"` on CUDA, each compiled graph is captured as a CUDA graph and replayed into memory of a
pool that all compiled functions share (a CUDA-graph tree). Each call of a compiled function begins a new
generation, and the memory of the earlier call's outputs is reused: an output kept past the next call, or fed back
as its input (a search's state, word after word), is overwritten, and reading it raises "accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run". So every compiled function here is called through
`compile_function`, which returns copies of its outputs. A CPU cannot show the rule (Inductor there returns fresh
tensors at every call); tests/cuda_graphs.py emulates it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

# Each shape a compiled function meets is a graph of its own (a search's first words and its later ones per number of
# images, beam size and words per call; the training step's caption buckets): more than Dynamo's default of 8, after
# which it would run the function uncompiled (with a warning). The limit is raised around the compiled calls only,
# and restored after (torch.compiler has no public knob for it).
RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def recompile_limit(limit: int = RECOMPILE_LIMIT) -> Iterator[None]:
    """A context in which Dynamo compiles a function up to `limit` times: its config's value set, and restored after
    (6 us a call here; Dynamo's `config.patch` takes 25)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    before = getattr(config, name)
    setattr(config, name, max(before, limit))
    try:
        yield
    finally:
        setattr(config, name, before)


def copy_out(value):
    """`value` with each tensor in it (in tuples, NamedTuples and lists) replaced by a copy."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        items = [copy_out(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [copy_out(item) for item in value]
    return value


def compile_function(fn: Callable, **options) -> Callable:
    """`fn` compiled by `torch.compile(**options)`, run with Dynamo's recompile limit raised (RECOMPILE_LIMIT), its
    outputs returned as copies, out of a CUDA graph's memory (the module's docstring). The copies are what a call
    costs beyond the graph: a few small tensors (a state, a loss, the annotations), one launch each."""
    compiled = torch.compile(fn, **options)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with recompile_limit():
            outputs = compiled(*args, **kwargs)
        return copy_out(outputs)

    return run
