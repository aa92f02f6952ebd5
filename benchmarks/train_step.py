"""Training speed (captions/s): one optimizer step of teacher forcing (forward, loss, backward, clipping at 5, Adam) on
annotations, as the feature cache feeds it, in each form captioner has, against the same model trained the way the
popular tutorial writes the loop.

    python benchmarks/train_step.py            # on this machine's device (CUDA when present)
    python benchmarks/train_step.py --smoke    # tiny sizes, one pass: checks the script only
    python benchmarks/train_step.py --forms "grouped, a copy per caption|grouped, each image once"

Forms:
- tutorial: captions sorted by length, each word run on a slice of the captions still going, the attention projection
  of the annotations computed again at every word, the output layer word by word (`common.tutorial_forward`);
- captioner eager: the shrinking batch (`--model.compile=false`, the CPU's default): the projection once per batch,
  each word on the captions still going, the output layer once on every word;
- captioner fixed shapes, uncompiled (on a CPU): every caption runs every step, padded to `bucket_steps`: the form
  that the GPU compiles;
- captioner compiled (on CUDA): that form under torch.compile(mode="reduce-overhead") (`--model.compile`, the default
  on CUDA), with the seconds its first two passes took (compiling each caption length's graph);
- grouped (on a CPU, at the paper's sizes): batches of 16 images with 5 captions each (80 captions, as
  configs/coco_resnet101.yaml trains), fixed shapes, uncompiled: each image's annotations and keys once for its 5
  captions, against a copy of them for each caption (what the step did before).

On a CPU: the shapes sizes and the paper's, batches of 64 captions, float32. On CUDA: the paper's sizes (P=196,
E=2048, D=A=M=512, V=10,000), batches of 64 and 256, float32 with TF32 matmuls (the CLI's default on CUDA) and under
bf16 autocast. Captions of 8 to 16 tokens. Each figure: the median pass over 4 batches (CUDA: 5 passes; CPU: 3),
after two untimed passes. Each row is printed, and written to --out, as soon as it is measured; a form that fails is
a row with its error.
"""

from __future__ import annotations

import sys

import torch
from common.harness import Script, timed, timings
from common.synthetic import SIZES, TINY, annotations, caption_batches
from common.tutorial import tutorial_forward

from captioner.models.show_attend_tell import ShowAttendTell, caption_loss


def model(dims: tuple, device: torch.device) -> ShowAttendTell:
    """A ShowAttendTell at `dims` (the paper's: a ResNet-101 pooled to 14x14; tiny: EfficientNet-Lite0 pooled to
    3x3), untrained. Its encoder is never run: the steps take annotations, as training on the feature cache does."""
    P, E, D, A, M, V = dims
    torch.manual_seed(0)
    sizes = {"embed_dim": M, "decoder_dim": D, "attention_dim": A, "dropout": 0.5}
    backbone = {"backbone": "resnet101"} if E == 2048 else {}
    m = ShowAttendTell(V, pretrained=False, grid_size=int(P**0.5), **backbone, **sizes)
    assert (m.encoder.num_pixels, m.encoder.out_dim) == (P, E)
    return m.to(device).train()


GROUPED = 5  # captions an image in the grouped forms (configs/coco_resnet101.yaml's 16 images x 5 captions)


def captions_per_second(dims: tuple, B: int, form: str, bf16: bool, device: torch.device, passes: int) -> dict:
    torch.compiler.reset()
    m = model(dims, device)
    if form == "compiled":  # --smoke: Dynamo's capture only, not Inductor's minutes of C++ compiling
        m.compile_training_step(**({"mode": "reduce-overhead"} if device.type == "cuda" else {"backend": "aot_eager"}))
    m.fixed_shape = form != "tutorial" and form != "eager"
    optimizer = torch.optim.Adam(m.parameters(), lr=4e-4)
    k = GROUPED if form.startswith("grouped") else 1
    data = [
        (annotations(dims, B // k, seed=i).to(device), captions.to(device), lengths.to(device))
        for i, (captions, lengths) in enumerate(caption_batches(dims[-1], B))
    ]

    def step(a, captions, lengths):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if form == "tutorial":
                logits, alphas, order = tutorial_forward(m.decoder, a, captions, lengths)
                loss = caption_loss(logits, captions[order, 1:], alphas, m.alpha_c).loss
            elif form == "grouped, a copy per caption":  # each caption its image's annotations, as before
                loss = m(captions, lengths, annotations=a.repeat_interleave(k, dim=0)).loss
            else:
                loss = m(captions, lengths, annotations=a, captions_per_image=k).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
        optimizer.step()

    def one_pass():
        for batch in data:
            step(*batch)

    first = sum(timings(one_pass, 2, warmup=0, device=device))  # the compiled form compiles each caption length
    row = {"captions/s": f"{len(data) * B / timed(one_pass, passes, warmup=0, device=device):.0f}"}
    return row | ({"first two passes, s": f"{first:.1f}"} if form == "compiled" else {})


def main() -> None:
    script = Script(__file__, __doc__, smoke="tiny sizes, one pass: checks the script only", budget=True)
    script.option("--forms", help="only these forms, separated by |")
    options = script.start()
    cuda = torch.cuda.is_available() and not options.smoke
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_float32_matmul_precision("high")  # TF32 on CUDA, what `captioner fit` sets there by default
    if options.smoke:
        forms = (
            "tutorial",
            "eager",
            "fixed shapes",
            "compiled",
            "grouped, a copy per caption",
            "grouped, each image once",
        )
        runs = [("tiny", TINY, 2 * GROUPED, False, form) for form in forms]
    elif cuda:
        runs = [
            ("paper", SIZES["paper"], B, bf16, form)
            for B in (64, 256)
            for bf16 in (False, True)
            for form in ("tutorial", "eager", "compiled")
        ]
    else:
        forms = ("tutorial", "eager", "fixed shapes")
        runs = [(size, dims, 64, False, form) for size, dims in SIZES.items() for form in forms]
        grouped = ("grouped, a copy per caption", "grouped, each image once")
        runs += [("paper", SIZES["paper"], 16 * GROUPED, False, form) for form in grouped]
    if options.forms:
        runs = [run for run in runs if run[-1] in options.forms.split("|")]
    passes = 1 if options.smoke else 5 if cuda else 3
    rows = script.table("train_step", "training step, captions/s")
    tutorial: dict[tuple, float] = {}  # the tutorial's rate (grouped: the copy's) at each size, batch and precision
    for size, dims, B, bf16, form in runs:
        precision = "bf16-mixed" if bf16 else "float32 (TF32)" if cuda else "float32"

        def measure(size=size, dims=dims, B=B, bf16=bf16, form=form):
            result = captions_per_second(dims, B, form, bf16, device, passes)
            rate = float(result["captions/s"])
            if form in ("tutorial", "grouped, a copy per caption"):  # what the next forms are compared with
                tutorial[size, B, bf16] = rate
            elif (size, B, bf16) in tutorial:
                result["x tutorial" if not form.startswith("grouped") else "x a copy per caption"] = (
                    f"{rate / tutorial[size, B, bf16]:.2f}x"
                )
            return result

        rows.measure({"sizes": size, "batch": B, "precision": precision, "form": form}, measure)
    script.finish(", captions of 8 to 16 tokens, clipping at 5, Adam")


if __name__ == "__main__":
    sys.exit(main())
