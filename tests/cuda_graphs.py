"""A stand-in for what a CUDA graph does to a compiled function's outputs, for CPU tests.

On CUDA, `torch.compile(mode="reduce-overhead")` replays each graph into memory of a pool that every compiled function
shares (a CUDA-graph tree). Each call of a compiled function begins a new generation: the memory of the earlier
call's outputs is handed to the new call, and the earlier outputs are overwritten (reading one raises "accessing
tensor output of CUDAGraphs that has been overwritten by a subsequent run"). A CPU cannot show this: Inductor there
returns fresh tensors at every call. So a test replaces `torch.compile` with `CudaGraphStandIn.compile`, which keeps
Dynamo's tracing (backend "eager" by default: the traced graph runs as is, nothing is generated or compiled) and adds
the pool's rules, whatever `mode` the code asked for:

- when a compiled call begins, the outputs of the call before it (of any function compiled here) are overwritten:
  floats with NaN, integers with their bits inverted, booleans negated;
- an input that shares memory with the earlier call's outputs raises `StaleOutput`: on CUDA that memory is the new
  call's, and the input would be garbage.

An output that is an input, a view of one, or a module's parameter or buffer is not pool memory and is left alone,
as a CUDA-graph tree leaves it. The backward pass of a compiled call is a graph of the tree too, and its outputs are
pool memory: a parameter whose `.grad` was empty when the call began gets the backward's gradient as its `.grad`, and
that gradient is overwritten when the next compiled call begins (a known PyTorch limitation: gradients accumulated
over several batches would be lost, which `compile_options` works around).

With `graphs_only`, only a function compiled with `mode="reduce-overhead"` (what a CUDA run asks for) is given these
rules; another is compiled as asked, on the stand-in's backend.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

REAL_COMPILE = torch.compile


class StaleOutput(RuntimeError):
    """An input of a compiled call is an output of the call before it, which a CUDA-graph replay overwrites."""


def tensors_in(value, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(where, tensor) for each tensor in nested tuples (NamedTuples included), lists and dicts, and each parameter
    and buffer of a module among them."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from tensors_in(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensors_in(item, f"{path}[{key!r}]")
    elif isinstance(value, nn.Module):
        for name, tensor in [*value.named_parameters(), *value.named_buffers()]:
            yield f"{path}.{name}", tensor


def memory(tensor: torch.Tensor) -> int | None:
    """Which memory a tensor lives in (its storage's address; None when it has none). Every output of the call before
    is held until the next call begins, so its address is not reused by another tensor in between."""
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def overwrite(tensor: torch.Tensor) -> None:
    """The whole storage of `tensor` garbled, as a replay that reuses its memory leaves it."""
    storage = tensor.untyped_storage()
    with torch.inference_mode() if tensor.is_inference() else torch.no_grad():
        whole = tensor.new_empty(0).set_(storage, 0, (storage.nbytes() // tensor.element_size(),))
        if whole.dtype == torch.bool:
            whole.logical_not_()
        elif whole.is_floating_point() or whole.is_complex():
            whole.fill_(float("nan"))
        else:
            whole.bitwise_not_()


class CudaGraphStandIn:
    """`compile` is torch.compile with a CUDA-graph tree's output lifetimes (the module docstring). `calls` counts the
    compiled calls, `overwritten` the outputs garbled so far: a test can check that the stand-in was in the path."""

    def __init__(self, backend: str | Callable = "eager", graphs_only: bool = False):
        self.backend, self.graphs_only = backend, graphs_only
        self.previous: list[torch.Tensor] = []  # the last call's outputs in pool memory (held: see `memory`)
        self.previous_name = ""
        self.calls = 0
        self.overwritten = 0
        self.gradients = 0  # gradients given to parameters from pool memory so far
        self._hooks: list = []  # the last call's parameters' gradient hooks

    def compile(self, fn: Callable | None = None, **options) -> Callable:
        if fn is None:  # used as a decorator with options: @torch.compile(...)
            return functools.partial(self.compile, **options)
        graphs = options.get("mode") == "reduce-overhead" or not self.graphs_only
        options = {key: value for key, value in options.items() if key not in ("mode", "options")}
        compiled = REAL_COMPILE(fn, **{**options, "backend": self.backend})
        if not graphs:
            return compiled
        name = getattr(fn, "__qualname__", repr(fn))

        @functools.wraps(fn)
        def replay(*args, **kwargs):
            return self._call(name, compiled, fn, args, kwargs)

        return replay

    def _call(self, name: str, compiled: Callable, fn: Callable, args: tuple, kwargs: dict):
        stale = {memory(t): t for t in self.previous}
        inputs = [
            *tensors_in(args, "args"),
            *tensors_in(kwargs, "kwargs"),
            *tensors_in(getattr(fn, "__self__", None), "self"),
        ]
        for where, tensor in inputs:
            if memory(tensor) in stale:
                raise StaleOutput(
                    f"{name}'s input {where} {tuple(tensor.shape)} is an output of the call before it"
                    f" ({self.previous_name}), which this call's replay overwrites on CUDA: copy it out first"
                )
        for tensor in {memory(t): t for t in self.previous}.values():
            overwrite(tensor)
            self.overwritten += 1
        self.previous = []
        for hook in self._hooks:
            hook.remove()
        self._hooks = [
            tensor.register_post_accumulate_grad_hook(self._gradient_in_pool)
            for _, tensor in inputs
            if isinstance(tensor, nn.Parameter) and tensor.requires_grad and tensor.grad is None
        ]
        self.calls += 1
        outputs = compiled(*args, **kwargs)
        not_pool = {memory(t) for _, t in inputs}
        self.previous = [t for _, t in tensors_in(outputs) if memory(t) is not None and memory(t) not in not_pool]
        self.previous_name = name
        return outputs

    def _gradient_in_pool(self, parameter: nn.Parameter) -> None:
        """The backward of a call gave `parameter`, whose .grad was empty, its gradient: pool memory, which the next
        compiled call overwrites."""
        self.previous.append(parameter.grad)
        self.gradients += 1


@contextlib.contextmanager
def cuda_graph_stand_in(backend: str | Callable = "eager", graphs_only: bool = False) -> Iterator[CudaGraphStandIn]:
    """Within it, every `torch.compile` (the project's, whatever its options; with `graphs_only`, those that ask for
    CUDA graphs) compiles through a new stand-in."""
    stand_in = CudaGraphStandIn(backend, graphs_only)
    torch.compiler.reset()
    torch.compile = stand_in.compile
    try:
        yield stand_in
    finally:
        torch.compile = REAL_COMPILE
        torch.compiler.reset()
