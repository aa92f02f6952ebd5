import subprocess
import sys

import pytest

from captioner.runtime import keep_freed_memory

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
