"""Whatever a model writes, every command that scores, draws or logs its captions goes on: an empty caption (an
untrained model's first word is often <end>), a caption of <unk> alone, and one that runs to the longest caption
without an <end>. A checkpoint's output layer is biased towards one token so that every caption it writes is one of
these, then each command runs on it."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from captioner.api import Captioner
from captioner.cli import main, run_lightning_cli
from captioner.data.shapes import ShapesDataset, word_boxes
from captioner.data.vocab import Vocabulary
from captioner.metrics import attention_ceiling, attention_correctness, bleu, cider, coco_caption_scores
from captioner.serve import answer, create_app
from captioner.visualize import attention_grid, plot_attention
from tests.conftest import tiny_fit_args

MAX_LEN = 6  # the longest caption the commands below write (--max-len, --model.max_caption_len)
CASES = {"empty": Vocabulary.END, "unk": Vocabulary.UNK, "endless": "circle"}  # the token the output layer favours


def expected_words(case: str, max_len: int = MAX_LEN) -> list[str]:
    return [] if case == "empty" else [CASES[case]] * max_len


@pytest.mark.parametrize("case", CASES)
def test_the_scorers_and_drawers_take_the_caption(case):
    words = expected_words(case)
    split = ShapesDataset("test", 1)
    objects, references = split.objects(0), [caption.split() for caption in split.captions(0)]
    alphas = torch.softmax(torch.randn(len(words), 49), -1)
    assert 0.0 <= bleu([words], [references]) <= 1.0 and cider([words], [references]) >= 0.0
    hypotheses, texts = {0: " ".join(words)}, {0: [" ".join(r) for r in references]}
    scores = coco_caption_scores(hypotheses, texts, meteor=False, tokenized=True)  # METEOR: under `evaluate` below
    assert all(math.isfinite(value) for value in scores.values())
    masses, _ = attention_correctness(alphas, word_boxes(words, objects), (7, 7), (224, 224))
    assert masses == [] and attention_ceiling(word_boxes(words, objects), (7, 7), (224, 224)) == []  # names none
    sheet = attention_grid(split.load_image(0), words, alphas, (7, 7))
    assert sheet.width >= 5 * 192
    figure = plot_attention(split.load_image(0), words, alphas, (7, 7))
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert [title.rsplit(" ", 1)[0] for title in titles[1:]] == words  # each word, then its top tenth's share


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory) -> dict[str, str]:
    """The tiny model's fit checkpoint, one copy per case, its output layer biased towards the case's token."""
    state = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    vocab = Vocabulary(state["hyper_parameters"]["vocab"])
    folder = tmp_path_factory.mktemp("degenerate")
    paths = {}
    for case, token in CASES.items():
        biased = {**state, "state_dict": dict(state["state_dict"])}
        bias = biased["state_dict"]["model.decoder.L_o.bias"].clone()
        bias[vocab.stoi[token]] = 1e4
        biased["state_dict"]["model.decoder.L_o.bias"] = bias
        biased["hyper_parameters"] = {**state["hyper_parameters"], "max_caption_len": MAX_LEN}
        paths[case] = str(folder / f"{case}.ckpt")
        torch.save(biased, paths[case])
    return paths


@pytest.mark.parametrize("case", CASES)
def test_every_command_takes_the_caption(case, checkpoints, tmp_path, capsys):
    checkpoint, words = checkpoints[case], expected_words(case)
    images = [ShapesDataset("test", 2, seed=3).load_image(i) for i in range(2)]

    for beam_size in (1, 3):  # the Python API, greedy and beam search
        results = Captioner.load(checkpoint).caption(images, beam_size=beam_size, max_len=MAX_LEN)
        assert [r.tokens for r in results] == [words, words]
        assert all(r.alphas.shape == (len(words), 49) for r in results)

    # validation and test: BLEU, CIDEr-D, attention correctness and its ceiling, and TensorBoard's attention images
    board = ["--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger", f"--trainer.logger.save_dir={tmp_path}"]
    callbacks = ["--trainer.callbacks+=captioner.lightning_cli.AttentionImages"]
    cli = run_lightning_cli(["validate", *tiny_fit_args(tmp_path, *board, *callbacks), f"--ckpt_path={checkpoint}"])
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert metrics["val/bleu4"] == 0.0 and metrics["val/cider"] >= 0.0 and math.isfinite(metrics["val/loss"])
    assert list(tmp_path.rglob("events.out.tfevents.*"))  # the attention images were written
    run_lightning_cli(["test", *tiny_fit_args(tmp_path), f"--ckpt_path={checkpoint}"])
    rows = list(csv.DictReader(next((tmp_path / "logs").rglob("metrics.csv")).open()))
    assert float(rows[-1]["test/bleu4"]) == 0.0

    output = tmp_path / "predictions.jsonl"
    predict = ["predict", *tiny_fit_args(tmp_path), f"--ckpt_path={checkpoint}", f"--predictions.output={output}"]
    run_lightning_cli(predict)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert records and all(record["caption"] == " ".join(words) for record in records)

    capsys.readouterr()
    main(["evaluate", "--ckpt_path", checkpoint, "--max-len", str(MAX_LEN), "--output", str(tmp_path / "evaluation")])
    scores = json.loads((tmp_path / "evaluation" / "metrics.json").read_text())
    assert scores["Bleu_4"] < 1e-6 and all(math.isfinite(value) for value in scores.values())
    assert scores["exact_reference"] == 0.0

    capsys.readouterr()  # the demo: captions of the checkpoint's own test images, their overlays, the score
    main(["demo", "--ckpt_path", checkpoint, "--samples", "2", "--overlays", str(tmp_path / "demo")])
    said = capsys.readouterr().out.splitlines()
    assert [line.split("generated:")[1].split() for line in said if "generated:" in line] == [words, words]
    assert len(list((tmp_path / "demo").glob("*.png"))) == 2 and said[-1].startswith("val/bleu4=")

    images[0].save(tmp_path / "photo.png")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["caption", str(tmp_path / "photo.png"), "--ckpt_path", checkpoint, "--max-len", str(MAX_LEN), "--json",
              "--overlays", str(tmp_path / "overlays")])  # fmt: skip
    assert exit_info.value.code == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == words
    assert len(list((tmp_path / "overlays").glob("*.png"))) == 1

    app = create_app(Captioner.load(checkpoint))  # the server, whose answers carry one attention row per word
    with TestClient(app) as client:
        images[1].save(tmp_path / "other.png")
        response = client.post("/api/caption", files={"image": ("other.png", (tmp_path / "other.png").read_bytes())})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"][:MAX_LEN] == words[:MAX_LEN] and len(body["alphas"]) == len(body["tokens"])
    assert np.isfinite(body["score"]) and answer(results[0])["tokens"] == words
