"""A CPU check that code would not make a CUDA host wait for the device: `HostSyncs` records every op that does.

On a GPU, reading a tensor's value on the host (`.item()`, `bool(t)`, `int(t)`, `.tolist()`, `.numpy()`, `.cpu()`)
waits for every kernel queued before it, and so do ops whose output's size depends on the data (`nonzero`,
`masked_select`, indexing with a boolean mask, `unique`, `repeat_interleave` without `output_size`): their result's
shape must be read back before the host can go on. On a CPU none of them costs anything, so they pass unnoticed; this
mode sees them at the dispatcher, where every tensor op passes, whatever its device.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default: "reads a value to the host (.item(), bool(), int(), float(), if t:)"}
DATA_SIZED = {  # ops whose output's size is the data's: the host must wait to learn it
    aten.nonzero: "nonzero (or torch.where with one argument)",
    aten.masked_select: "masked_select",
    aten._unique: "unique",
    aten._unique2: "unique",
    aten.unique_dim: "unique",
    aten.unique_consecutive: "unique_consecutive",
}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
BOOLEAN = (torch.bool, torch.uint8)
HOST_COPIES = ("tolist", "numpy", "cpu")  # methods that copy to the host; on a CPU tensor they dispatch nothing


def _reason(func, args: tuple, kwargs: dict) -> str | None:
    if func in READS:
        return READS[func]
    packet = func.overloadpacket
    if packet in DATA_SIZED:
        return DATA_SIZED[packet]
    if packet in INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in BOOLEAN for i in indices):
            return "indexing with a boolean mask"
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None and len(args) < 4:
        return "repeat_interleave without output_size"
    return None


class HostSyncs(TorchDispatchMode):
    """Within it, `seen` lists each op that would make a CUDA host wait: (what it is, the line of code that ran it).

    Tensor methods that copy to the host dispatch nothing on a CPU tensor, so they are wrapped while the mode is on.

    Args:
        on_the_host: the tensors that stay in host memory when training runs on CUDA (reading them waits for
            nothing), as a function called at each read, for tensors made later: torch's Adam keeps its step counts
            on the host (unless fused or capturable), and `FiniteLosses` copies a step's loss into a host buffer.
            Every other tensor is taken to be on the device, in the thread that entered the mode: a thread that
            reads batches ahead (`captioner.data.prefetch`) makes them in host memory, and is not watched.
    """

    def __init__(self, on_the_host: Callable[[], Iterable[torch.Tensor]] = tuple):
        super().__init__()
        self.seen: list[tuple[str, str]] = []
        self._originals: dict[str, object] = {}
        self.on_the_host = on_the_host
        self._thread: int | None = None  # the thread that runs the steps; others build batches in host memory

    def _record(self, what: str) -> None:
        if threading.get_ident() != self._thread:  # a loader's thread (`captioner.data.prefetch`): host tensors only
            return
        frames = [f for f in traceback.extract_stack()[:-2] if "/captioner/" in f.filename.replace("\\", "/")]
        where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.seen.append((what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _reason(func, args, kwargs)
        if reason and func in READS and any(args[0] is tensor for tensor in self.on_the_host()):
            reason = None
        if reason:
            self._record(reason)
        return func(*args, **kwargs)

    def __enter__(self):
        self._thread = threading.get_ident()
        for name in HOST_COPIES:
            original = self._originals[name] = getattr(torch.Tensor, name)

            def copy(tensor, *args, _original=original, _name=name, **kwargs):
                self._record(f".{_name}() copies to the host")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, copy)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)
