"""oneDNN against MKL for the decoder's matmuls when decoding on this CPU (captioner/models/onednn.py).

    python benchmarks/onednn.py

First table: the largest matmul of a decoding step, the LSTM input projection, for 1 to 5 rows (beam K at batch 1
runs K rows) and 192 rows (beam 3 at batch 64): `F.linear` (torch's MKL GEMM) against the oneDNN operator that
`captioner.models.onednn.Linear` calls. Median µs per call.

Second table: beam 3 in decode.py's setting (random decoder, `<end>` suppressed, 16 steps) at batch 1 and 64, with
`captioner.models.onednn.enabled` on and off; three rounds in which the two settings take turns, the same number of
calls for each, fastest call.

Third: the bundled shapes model on 64 test images, beam 3, both settings: how many captions are identical.

The header and `default_on` in the RESULT line say whether the decoder uses oneDNN by default on this CPU (on AMD
CPUs only; see captioner/models/onednn.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import SIZES, machine, result, same_bundled_captions, table, timed
from decode import MAX_LEN, call_seconds, random_decoder

from captioner.models import onednn
from captioner.runtime import cpu_vendor

ROUNDS = 3
ROWS = (1, 2, 3, 4, 5, 192)


def matmul_rows(sizes: str) -> dict:
    _, E, D, _, M, _ = SIZES[sizes]
    weight, bias = torch.randn(4 * D, M + E), torch.randn(4 * D)
    row = {"sizes": sizes}
    with onednn.use(True), torch.inference_mode():
        for n in ROWS:
            x = torch.randn(n, M + E)
            repeats = 200 if n < 192 else 50
            mkl = timed(lambda x=x: F.linear(x, weight, bias), repeats=repeats, warmup=20)
            dnn = timed(lambda x=x: onednn.linear(x, weight, bias), repeats=repeats, warmup=20)
            row[f"{n} rows: MKL / oneDNN us"] = f"{1e6 * mkl:.0f} / {1e6 * dnn:.0f}"
            row[f"{n}"] = mkl / dnn
    return row


def decoding(sizes: str) -> dict:
    P, E = SIZES[sizes][:2]
    decoder = random_decoder(sizes)
    inputs = {batch: torch.randn(batch, P, E) for batch in (1, 64)}
    times = {(flag, batch): [] for flag in (False, True) for batch in inputs}
    for _ in range(ROUNDS):
        for flag in (False, True):
            with onednn.use(flag):
                for batch, encoded in inputs.items():
                    times[flag, batch] += call_seconds(decoder, encoded, beam=3)
    speed = {key: key[1] / min(seconds) for key, seconds in times.items()}
    return {
        "sizes": sizes,
        "batch 1, MKL": f"{speed[False, 1]:.1f}",
        "batch 1, oneDNN": f"{speed[True, 1]:.1f}",
        "batch 1 speed-up": speed[True, 1] / speed[False, 1],
        "batch 64, MKL": f"{speed[False, 64]:.1f}",
        "batch 64, oneDNN": f"{speed[True, 64]:.1f}",
        "batch 64 speed-up": speed[True, 64] / speed[False, 64],
    }


def main() -> None:
    vendor = cpu_vendor() or "unknown"
    print(f"{machine()}; oneDNN linear available: {onednn.AVAILABLE}")
    print(f"CPU vendor {vendor}; the decoder uses oneDNN by default here: {onednn.enabled}\n")
    if not onednn.AVAILABLE:
        raise SystemExit("this torch build has no oneDNN linear: nothing to compare")
    matmuls = [matmul_rows(sizes) for sizes in ("shapes", "paper")]
    print("LSTM input projection, median us per call (MKL / oneDNN):\n")
    print(table([{k: v for k, v in row.items() if not k.isdigit()} for row in matmuls]))
    searches = [decoding(sizes) for sizes in ("shapes", "paper")]
    print(f"\nBeam 3, random decoder, {MAX_LEN} steps, images/s (fastest call):\n")
    print(table([{k: f"{v:.2f}x" if isinstance(v, float) else v for k, v in row.items()} for row in searches]))
    same = same_bundled_captions(lambda _: onednn.use(False), lambda _: onednn.use(True))
    print(f"\nBundled shapes model, 64 test images, beam 3: {same} captions identical with and without oneDNN")
    shapes, paper = searches
    print(
        result(
            shapes_3rows_speedup=f"{matmuls[0]['3']:.1f}",
            paper_3rows_speedup=f"{matmuls[1]['3']:.1f}",
            shapes_192rows_speedup=f"{matmuls[0]['192']:.2f}",
            paper_192rows_speedup=f"{matmuls[1]['192']:.2f}",
            shapes_beam3_b1_speedup=f"{shapes['batch 1 speed-up']:.2f}",
            shapes_beam3_b64_speedup=f"{shapes['batch 64 speed-up']:.2f}",
            paper_beam3_b1_speedup=f"{paper['batch 1 speed-up']:.2f}",
            paper_beam3_b64_speedup=f"{paper['batch 64 speed-up']:.2f}",
            same_captions=same,
            default_on=onednn.enabled,
        )
    )


if __name__ == "__main__":
    main()
