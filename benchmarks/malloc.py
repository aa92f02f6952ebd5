"""Page faults from glibc's malloc: the additive scorer's reused workspace and `captioner.runtime.keep_freed_memory`.

    python benchmarks/malloc.py

Three settings:
- "fresh pieces": glibc's default, and the scorer builds each piece of its (B,G,P,A) tensor in fresh memory
  (`AdditiveAttention.reuse_workspace = False`, the library before commit 511f375);
- "glibc default": the library as a Python user gets it, the scorer reusing its per-thread workspace;
- "keep_freed_memory()": also glibc's thresholds raised, as the `captioner` command does at start-up.

A malloc setting holds for a whole process, so each measurement runs in a fresh child process, and the settings take
turns (ROUNDS rounds) so that a slow spell of the shared machine hits them all. Each child times, at the shapes
sizes, beam 3 at batch 64 and at batch 1 (decode.py's setting: random decoder, 16 steps, fastest of 8 calls each)
and a teacher-forced training step at batch 64 (train_step.py's, median), and counts the minor page faults of one
batch-64 beam-search call and of one training step.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import torch
from common import SIZES, machine, page_faults, result, table, timed
from decode import MAX_LEN, SPECIAL, random_decoder
from train_step import trainer

from captioner.decoding import beam_search
from captioner.models.attention import AdditiveAttention
from captioner.models.decoder import AttentionDecoder
from captioner.runtime import keep_freed_memory

ROUNDS = 4
SETTINGS = {  # name -> (keep_freed_memory, reuse_workspace)
    "fresh pieces": (False, False),
    "glibc default": (False, True),
    "keep_freed_memory()": (True, True),
}


def faults(fn) -> int:
    before = page_faults()
    fn()
    return page_faults() - before


def child(setting: str) -> dict:
    keep, AdditiveAttention.reuse_workspace = SETTINGS[setting]
    applied = keep_freed_memory() if keep else False
    P, E = SIZES["shapes"][:2]
    decoder = random_decoder("shapes")
    out = {"applied": applied}
    for batch in (64, 1):
        annotations = torch.randn(batch, P, E)

        def decode(annotations=annotations):
            with torch.inference_mode():
                beam_search(decoder, annotations, beam_size=3, max_len=MAX_LEN, **SPECIAL)

        out[f"b{batch}_images_per_s"] = batch / timed(decode, repeats=8, warmup=2, best=True)
        if batch == 64:
            out["decode_faults"] = faults(decode)
    step = trainer(AttentionDecoder, "shapes")
    out["train_captions_per_s"] = 64 / timed(step, repeats=8, warmup=2)
    out["train_faults"] = faults(step)
    return out


def main() -> None:
    runs = {setting: [] for setting in SETTINGS}
    for _ in range(ROUNDS):
        for setting in SETTINGS:
            output = subprocess.run(
                [sys.executable, __file__, "--child", setting], check=True, capture_output=True, text=True
            ).stdout
            runs[setting].append(json.loads(output.strip().splitlines()[-1]))
    rows = []
    for setting, setting_runs in runs.items():
        for i, run in enumerate(setting_runs):
            rows.append(
                {
                    "setting": setting,
                    "process": i + 1,
                    "beam 3 b64 images/s": f"{run['b64_images_per_s']:.0f}",
                    "beam 3 b1 images/s": f"{run['b1_images_per_s']:.1f}",
                    "b64 over b1": f"{run['b64_images_per_s'] / run['b1_images_per_s']:.1f}",
                    "faults / b64 call": run["decode_faults"],
                    "train captions/s": f"{run['train_captions_per_s']:.0f}",
                    "faults / train step": run["train_faults"],
                }
            )
    print(f"shapes sizes, beam 3, {MAX_LEN} steps; training batch 64; {ROUNDS} processes each; {machine()}\n")
    print(table(rows))

    def median(setting: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[setting])

    def speedup(setting: str, key: str) -> str:
        return f"{median(setting, key) / median('fresh pieces', key):.2f}"

    def ratio(setting: str) -> str:
        return f"{statistics.median(run['b64_images_per_s'] / run['b1_images_per_s'] for run in runs[setting]):.1f}"

    print(
        result(
            applied=all(run["applied"] for run in runs["keep_freed_memory()"]),
            workspace_b64_speedup=speedup("glibc default", "b64_images_per_s"),
            workspace_b1_speedup=speedup("glibc default", "b1_images_per_s"),
            kept_b64_speedup=speedup("keep_freed_memory()", "b64_images_per_s"),
            kept_b1_speedup=speedup("keep_freed_memory()", "b1_images_per_s"),
            kept_train_speedup=speedup("keep_freed_memory()", "train_captions_per_s"),
            median_ratio_fresh=ratio("fresh pieces"),
            median_ratio_default=ratio("glibc default"),
            median_ratio_kept=ratio("keep_freed_memory()"),
            median_decode_faults_fresh=f"{median('fresh pieces', 'decode_faults'):.0f}",
            median_decode_faults_default=f"{median('glibc default', 'decode_faults'):.0f}",
            median_decode_faults_kept=f"{median('keep_freed_memory()', 'decode_faults'):.0f}",
        )
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
    else:
        main()
