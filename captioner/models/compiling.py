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
import threading
from collections.abc import Callable, Iterator

import torch

# Each shape a compiled function meets is a graph of its own (a search's first words and its later ones per number of
# images, beam size and words per call; the training step's caption buckets): more than Dynamo's default of 8, after
# which it would run the function uncompiled (with a warning). The limit is raised around the compiled calls only,
# and restored after (torch.compiler has no public knob for it).
RECOMPILE_LIMIT = 64


_limit_lock = threading.Lock()
_limit_holders = 0  # the calls inside `recompile_limit` now, in every thread (where the setting is the process's)
_limit_before: int | None = None  # the process's setting before the first of them raised it


def _limit_name() -> str:
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"  # < 2.6


@functools.cache
def _limit_is_per_thread() -> bool:
    """Whether a thread's setting of Dynamo's config is its own (newer torch keeps it in a ContextVar) or the
    process's (older torch): asked once, of a thread that reads what this one set."""
    config, name, seen = torch._dynamo.config, _limit_name(), []
    with _limit_lock:
        before = getattr(config, name)
        setattr(config, name, before + 1)
        reader = threading.Thread(target=lambda: seen.append(getattr(config, name)))
        reader.start()
        reader.join()
        setattr(config, name, before)
    return seen != [before + 1]


@contextlib.contextmanager
def recompile_limit(limit: int = RECOMPILE_LIMIT) -> Iterator[None]:
    """A context in which Dynamo compiles a function up to `limit` times, its setting put back after. Compiled calls
    may run in several threads at once (the server's model thread beside a caller's). Where the setting is each
    thread's own, each call raises and puts back its thread's; where it is the process's, the first call to enter
    raises it and the last to leave puts it back, under a lock, so that no call compiles under a limit that another
    thread put back."""
    global _limit_holders, _limit_before
    config, name = torch._dynamo.config, _limit_name()
    if _limit_is_per_thread():
        before = getattr(config, name)
        setattr(config, name, max(before, limit))
        try:
            yield
        finally:
            setattr(config, name, before)
        return
    with _limit_lock:
        if _limit_holders == 0:
            _limit_before = getattr(config, name)
            setattr(config, name, max(_limit_before, limit))
        _limit_holders += 1
    try:
        yield
    finally:
        with _limit_lock:
            _limit_holders -= 1
            if _limit_holders == 0:
                setattr(config, name, _limit_before)


def copy_out(value):
    """`value` with each tensor in it (in tuples, NamedTuples, lists and dicts) replaced by a copy; any other object
    that holds tensors is refused, since its tensors would stay in the graph's memory."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        items = [copy_out(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [copy_out(item) for item in value]
    if isinstance(value, dict):
        return type(value)((key, copy_out(item)) for key, item in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"copy_out: a compiled function's output of type {type(value).__name__} is not copied out")


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
