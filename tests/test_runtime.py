import os
import subprocess
import sys

import pytest

from captioner.runtime import keep_freed_memory, keep_more_onednn_kernels

# Run in a child process: the malloc setting holds for the whole process.
CHILD = """
import resource, torch
from captioner.runtime import keep_freed_memory
applied = keep_freed_memory()
sizes = [2**20 * n for n in range(1, 31)]  # growing blocks below 32 MiB, each freed before the next
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    for n in sizes:
        torch.ones(n // 4)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run_child(env_value: str) -> tuple[bool, int]:
    env = {"CAPTIONER_KEEP_FREED_MEMORY": env_value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_stops_the_page_faults_of_reallocating_large_blocks():
    applied, faults_kept = run_child("1")
    not_applied, faults_default = run_child("0")
    assert applied and not not_applied
    # The second and third passes reuse the first pass's memory instead of taking fresh pages from the kernel.
    assert faults_kept < faults_default / 2


def test_the_environment_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv("CAPTIONER_KEEP_FREED_MEMORY", "0")
    assert keep_freed_memory() is False


# oneDNN's kernel cache: a child process, since oneDNN reads its capacity once per process.
ONEDNN_CHILD = """
import sys, torch
from captioner.runtime import keep_more_onednn_kernels
if sys.argv[1] == "call":
    keep_more_onednn_kernels()
elif sys.argv[1] == "module":  # a Python user's own training: the LightningModule, built before any matmul
    from captioner.lit_module import CaptioningModule
    CaptioningModule(["<pad>", "<start>", "<end>", "<unk>", "a"], pretrained=False, embed_dim=8, decoder_dim=8,
                     attention_dim=8)
for _ in range(2):  # 1,100 matmul shapes, twice: more than oneDNN's default of 1024 kernels
    for rows in range(1, 1101):
        torch.ones(rows, 32, dtype=torch.bfloat16) @ torch.ones(32, 32, dtype=torch.bfloat16)
"""


def kernels_built(setup: str) -> int:
    """How many kernels oneDNN built in the child (its verbose log's cache misses) after `setup`: "none",
    "call" (keep_more_onednn_kernels()) or "module" (a CaptioningModule made first)."""
    env = {"ONEDNN_VERBOSE": "all", "PATH": "/usr/bin:/bin"}
    args = [sys.executable, "-c", ONEDNN_CHILD, setup]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return out.stdout.count("create:cache_miss")


def test_keep_more_onednn_kernels_builds_each_shape_once():
    default = kernels_built("none")
    if default == 0:
        pytest.skip("torch does not run bfloat16 matmuls through oneDNN on this CPU")
    assert default > 2000  # the second pass rebuilt what the first pass had pushed out of the cache
    assert kernels_built("call") <= 1100  # at most one per shape: the second pass built none
    # Training with one's own Lightning Trainer, without the captioner command: the LightningModule, built before
    # the first matmul, makes the same room.
    assert kernels_built("module") <= 1100


def test_a_captioner_made_in_python_makes_the_same_room(monkeypatch, tiny_model):
    from captioner.api import Captioner

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    Captioner.load(tiny_model, device="cpu")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16384"


def test_keep_more_onednn_kernels_leaves_a_capacity_the_environment_sets(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    assert keep_more_onednn_kernels() is False
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert keep_more_onednn_kernels() is True
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16384"


def test_the_captioner_command_starts_with_room_for_more_kernels(monkeypatch, capsys):
    from captioner.cli import main

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    with pytest.raises(SystemExit):
        main(["caption", "--help"])
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16384"
