"""A DataLoader that reads its next batches in a background thread while the training step runs.

The feature cache is read in the main process (one indexed read of a batch's rows: `CaptionDataset.__getitems__`),
not in worker processes: a worker would copy each batch once more, into shared memory, and could not read it into
pinned memory. Without prefetching, that read runs between two steps, and the device waits for it. Here one thread
reads `prefetch` batches ahead; the reads release the GIL (numpy's indexed copy, torch's `index_select`), so the
step's Python and the read overlap, and a batch is ready when the step asks for it.

The batches are the same, in the same order: the thread runs the same iterator (sampler, fetch, pinning) that the
loader would run in the main process. The first batch is read in the calling thread, so that the sampler's draw of
its shuffling seed from the global generator happens where and when it would without prefetching; after that the
iterator draws from its own generator. The random caption draws of `train_captions: random` and `grouped` touch no
shared generator: each epoch's seed is drawn in the calling thread when its iterator is made, and each image's draws
are a function of that seed and the image (`CaptionDataset.new_epoch`), whoever reads it and however far ahead. A new
epoch first stops the last one's thread and waits for it to leave the batch it is reading: an epoch cut short
(`limit_train_batches`) would otherwise still be reading ahead while the next one reads.

At exit the process waits for its read-ahead threads to finish the batch they are reading (`_stop_all`). A daemon
thread still inside a torch op when Python finalizes would be ended by `pthread_exit` as it takes the GIL back, and
the unwinding through torch's C++ frames aborts the process ("terminate called without an active exception",
exit status 134) after a run that had finished, e.g. `captioner fit` with `limit_train_batches`.
"""

from __future__ import annotations

import atexit
import queue
import random
import threading
import weakref
from collections.abc import Iterator

from torch.utils.data import DataLoader

_END = object()  # the iterator is exhausted
_POLL_S = 0.1  # how often a thread waiting for room in its queue looks whether its reader has gone
_EXIT_WAIT_S = 60.0  # how long the process waits at exit for a thread to finish the batch it is reading

_running: dict[threading.Thread, threading.Event] = {}  # the read-ahead threads alive, with their stop events
_starting = threading.Lock()
_stop_all_registered = False


def _stop_all() -> None:
    """At exit (atexit: after the non-daemon threads are joined, before the interpreter finalizes): stop every
    read-ahead thread and wait for it to leave the batch it is reading (see the module's docstring)."""
    threads = list(_running.items())
    for _, stop in threads:
        stop.set()
    for thread, _ in threads:
        thread.join(_EXIT_WAIT_S)


def _start(thread: threading.Thread, stop: threading.Event) -> None:
    """Starts a read-ahead thread that the process waits for at exit."""
    global _stop_all_registered
    with _starting:
        if not _stop_all_registered:
            atexit.register(_stop_all)
            _stop_all_registered = True
        _running[thread] = stop
    thread.start()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _read_ahead(iterator: Iterator, batches: queue.Queue, stop: threading.Event) -> None:
    """The thread: every batch of `iterator` into `batches`, then `_END` (or the error it raised). Holds no reference
    to the `_Prefetcher`, so that one its reader drops (an epoch cut short by limit_train_batches) is collected, and
    its `stop` ends this thread."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                batches.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    try:
        for batch in iterator:
            if not put(batch):
                return
    except BaseException as error:  # raised again in the reader's thread
        put(_Failure(error))
        return
    else:
        put(_END)
    finally:
        _running.pop(threading.current_thread(), None)


class _Prefetcher:
    """Iterates `iterator` `depth` batches ahead in a daemon thread (see the module's docstring)."""

    def __init__(self, iterator: Iterator, depth: int):
        self._iterator, self._depth = iterator, depth
        self._batches: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = False

    def __iter__(self) -> _Prefetcher:
        return self

    def __len__(self) -> int:
        return len(self._iterator)

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._thread is None:  # the first batch here, then the thread reads ahead
            batch = next(self._iterator)
            args = (self._iterator, self._batches, self._stop)
            self._thread = threading.Thread(target=_read_ahead, args=args, name="captioner-prefetch", daemon=True)
            _start(self._thread, self._stop)
            return batch
        item = self._batches.get()
        if item is _END or isinstance(item, _Failure):
            self._done = True
            self._thread.join()
            if item is _END:
                raise StopIteration
            raise item.error
        return item

    def close(self) -> None:
        """Stop reading ahead, and wait for the thread to leave the batch it is reading: an epoch cut short
        (`limit_train_batches`) ends here, so that nothing of it still reads, or draws captions, when the next epoch
        begins (its draws would then depend on timing)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __del__(self) -> None:
        self.close()


class PrefetchingLoader(DataLoader):
    """A DataLoader (`num_workers=0`) whose iterator reads `prefetch` batches ahead in a background thread; with
    `prefetch=0`, or with worker processes (which prefetch by themselves), a plain DataLoader.

    Lightning makes a copy of it under DDP (to give it a DistributedSampler): the copy prefetches the same way."""

    def __init__(self, *args, prefetch: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefetch = prefetch
        self._reading: weakref.ref | None = None  # the last epoch's prefetcher

    def __iter__(self):
        previous = self._reading() if self._reading is not None else None
        if previous is not None:  # an epoch cut short: it stops reading before this one begins
            previous.close()
        # The seed of this epoch's caption draws, from this thread's generator, before any worker is made
        if getattr(self.dataset, "draws_captions", False):
            self.dataset.new_epoch(random.getrandbits(63))  # `CaptionDataset.new_epoch`
        iterator = super().__iter__()
        if self.prefetch < 1 or self.num_workers > 0:
            return iterator
        prefetcher = _Prefetcher(iterator, self.prefetch)
        self._reading = weakref.ref(prefetcher)
        return prefetcher
