"""Does keeping freed memory in the process help? `captioner.runtime.keep_freed_memory` on and off.

    python benchmarks/malloc.py

A malloc setting holds for a whole process, so each measurement runs in a fresh child process, and the two settings
take turns (ROUNDS pairs) so that a slow spell of the shared machine hits both. Each child times, at the shapes
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
from captioner.models.decoder import AttentionDecoder
from captioner.runtime import keep_freed_memory

ROUNDS = 4


def faults(fn) -> int:
    before = page_faults()
    fn()
    return page_faults() - before


def child(keep: bool) -> dict:
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
    runs = {False: [], True: []}
    for _ in range(ROUNDS):
        for keep in (False, True):
            output = subprocess.run(
                [sys.executable, __file__, "--child", str(int(keep))], check=True, capture_output=True, text=True
            ).stdout
            runs[keep].append(json.loads(output.strip().splitlines()[-1]))
    rows = []
    for keep, name in ((False, "glibc default"), (True, "keep_freed_memory()")):
        for i, run in enumerate(runs[keep]):
            rows.append(
                {
                    "malloc": name,
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

    def median(keep: bool, key: str) -> float:
        return statistics.median(run[key] for run in runs[keep])

    def ratio(keep: bool) -> float:
        return statistics.median(run["b64_images_per_s"] / run["b1_images_per_s"] for run in runs[keep])

    print(
        result(
            applied=all(run["applied"] for run in runs[True]),
            b64_speedup=f"{median(True, 'b64_images_per_s') / median(False, 'b64_images_per_s'):.2f}",
            b1_speedup=f"{median(True, 'b1_images_per_s') / median(False, 'b1_images_per_s'):.2f}",
            train_speedup=f"{median(True, 'train_captions_per_s') / median(False, 'train_captions_per_s'):.2f}",
            median_ratio_default=f"{ratio(False):.1f}",
            median_ratio_kept=f"{ratio(True):.1f}",
            median_decode_faults_default=f"{median(False, 'decode_faults'):.0f}",
            median_decode_faults_kept=f"{median(True, 'decode_faults'):.0f}",
        )
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(bool(int(sys.argv[2])))))
    else:
        main()
