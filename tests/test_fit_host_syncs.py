"""A real `captioner fit` of the fixed-shape (compiled) step, as on a GPU, makes the host wait for the device only at
its logging steps: Lightning's loop, the module's hooks, the finite-loss check, the progress bar, the loaders and the
loggers between them read nothing of the device at any other step (`tests.host_syncs.HostSyncs` sees every such read
on the CPU). A read planted in a callback is seen at the steps it runs."""

from __future__ import annotations

import collections
import contextlib
import io
import re

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from captioner.cli import run_lightning_cli
from tests.conftest import REPO
from tests.host_syncs import HostSyncs

LOG_EVERY = 10  # --trainer.log_every_n_steps: three logging steps in the 30 below
STEPS = 30
WATCHED = range(2, STEPS - 1)  # each from its start to the next step's start; the first two compile the step
PLANTED = (21, 22)  # steps at which `PlantedRead` reads the loss, as a progress bar reading it each step would
LOGGED_VALUES = 4  # train/loss, nll_per_word, doubly_stochastic and attention_entropy, converted for the loggers


class StepReads(Callback):
    """The host reads of the device that HostSyncs sees in each training step, from its start to the next one's.

    Reads of what stays in host memory on CUDA are not waits, and are not counted: torch's Adam keeps its step counts
    there (not fused, not capturable), and FiniteLosses copies each step's loss into a host buffer."""

    def __init__(self):
        self.reads: dict[int, list[tuple[str, str]]] = {}
        self.mode: HostSyncs | None = None
        self.step = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.mode is not None:
            self.reads[self.step], self.mode.seen = self.mode.seen, []
        if trainer.global_step == WATCHED.start:
            optimizer = trainer.optimizers[0]

            def on_the_host():
                return [state["step"] for state in optimizer.state.values()] + [pl_module.finite_losses.host]

            self.mode = HostSyncs(on_the_host)
            self.mode.__enter__()
        elif trainer.global_step == WATCHED.stop and self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        self.step = trainer.global_step


class PlantedRead(Callback):
    """Reads the last step's logged loss to the host at the start of the PLANTED steps."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in PLANTED:
            trainer.callback_metrics["train/loss"].item()


@pytest.fixture(scope="module")
def step_reads(tmp_path_factory) -> dict[int, list[tuple[str, str]]]:
    """One fit of the shipped shapes config (clipping, its loggers and callbacks, checkpoints, the progress bar) with
    the fixed-shape step compiled by Dynamo (its eager backend: the same step without generated code), 30 steps."""
    import captioner.lightning_cli as lightning_cli

    tmp = tmp_path_factory.mktemp("fit")
    watch = StepReads()
    instantiate = lightning_cli.CaptionerCLI.instantiate_trainer

    def with_watch(self, **kwargs):
        trainer = instantiate(self, **kwargs)
        trainer.callbacks[:0] = [watch, PlantedRead()]  # the watch first: it sees the planted read
        return trainer

    sizes = [
        f"--data.init_args.train_size={16 * STEPS // 5}",  # five captions an image, each a training example
        "--data.init_args.val_size=8",
        "--data.init_args.test_size=8",
        "--data.init_args.batch_size=16",
        "--data.init_args.num_workers=0",
        "--trainer.max_epochs=1",
        f"--trainer.log_every_n_steps={LOG_EVERY}",
        "--model.embed_dim=16",
        "--model.decoder_dim=16",
        "--model.attention_dim=16",
    ]
    step = ["--trainer.accelerator=cpu", "--model.compile=true", "--model.compile_backend=eager"]
    torch.compiler.reset()
    bar = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(bar):
        patch.setattr(lightning_cli.CaptionerCLI, "instantiate_trainer", with_watch)
        patch.chdir(tmp)  # the config's data, checkpoints and logs land there, as in a user's project folder
        cli = run_lightning_cli(["fit", "--config", str(REPO / "configs" / "shapes.yaml"), *sizes, *step])
    assert cli.model.model.fixed_shape and cli.trainer.global_step == STEPS
    assert (tmp / "checkpoints" / "shapes" / "last.ckpt").is_file()
    # The progress bar shows the previous step's loss, from the finite-loss check's host copy
    assert re.search(r"Epoch 0: +\d+%.*loss=\d", bar.getvalue()), bar.getvalue()[-500:]
    return watch.reads


def logging_step(step: int) -> bool:
    return (step + 1) % LOG_EVERY == 0  # Lightning logs after the step whose count of steps is a multiple


def test_a_fit_reads_the_device_only_at_its_logging_steps(step_reads):
    assert sorted(step_reads) == list(WATCHED)  # at least 20 steps watched
    quiet = {step: reads for step, reads in step_reads.items() if not logging_step(step) and step not in PLANTED}
    assert len(quiet) >= 20 and all(reads == [] for reads in quiet.values()), {s: r for s, r in quiet.items() if r}
    logging = {step: reads for step, reads in step_reads.items() if logging_step(step)}
    assert len(logging) == 2  # steps 9 and 19 (29's is the last step's, not watched)
    for reads in logging.values():  # the loggers read the step's logged values there, and only there
        assert 1 <= len(reads) <= LOGGED_VALUES, reads


def test_a_read_planted_in_a_hook_is_seen_at_the_steps_it_runs(step_reads):
    for step in PLANTED:
        assert collections.Counter(what for what, _ in step_reads[step]) == {
            "reads a value to the host (.item(), bool(), int(), float(), if t:)": 1
        }


def test_without_a_progress_bar_the_fit_runs(tmp_path, capfd):
    """`--trainer.enable_progress_bar=false`: captioner's default bar is left out rather than refused by Lightning."""
    from tests.conftest import run_main, tiny_fit_args

    ran = run_main(capfd, "fit", *tiny_fit_args(tmp_path, "--trainer.enable_progress_bar=false"))
    assert ran.status == 0 and "Epoch 0" not in ran.out + ran.err, ran.err[-2000:]
