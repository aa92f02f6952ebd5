"""What `captioner evaluate` scores, as a library: the model of any file the commands read, the data it is scored
on, and one pass over a split that decodes each image once and scores the captions (`score_split`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from captioner.checkpoints import build_model, model_file, read, resolve
from captioner.data.vocab import Vocabulary, detokenize, tokenize
from captioner.errors import ConfigError
from captioner.metrics import coco_caption_scores, decode_batch, peakedness_scores


def evaluation_data(config: str | None, checkpoint: str, overrides: list[str]):
    """The datamodule that `evaluate` scores on: the `data` section of `config`, or else the data the checkpoint was
    trained on, with `--data.*` overrides (as in `captioner fit`) applied."""
    import yaml
    from jsonargparse import ArgumentParser

    from captioner.data.datamodules import CaptionDataModule

    if config is not None:
        if not Path(config).is_file():
            raise ConfigError(f"{config}: config file not found")
        data = (yaml.safe_load(Path(config).read_text()) or {}).get("data")
        if data is None:
            raise ConfigError(f"{config}: no data section")
    else:
        try:
            hparams = dict(read(resolve(checkpoint), checkpoint, mmap=True)["datamodule_hyper_parameters"])
        except (KeyError, TypeError):
            raise ConfigError(
                f"{checkpoint}: it does not name its data (only a fit checkpoint does); pass --config"
            ) from None
        hparams.pop("_instantiator", None)
        data = {"class_path": hparams.pop("_class_path"), "init_args": hparams}
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(CaptionDataModule, "data")
    return parser.instantiate_classes(parser.parse_args(["--data", json.dumps(data), *overrides])).data


def evaluated_model(checkpoint: str):
    """The model and vocabulary that `evaluate` scores, in eval mode: a fit checkpoint's (as Lightning loads it), or an
    exported file's or a bundled model's (`captioner.checkpoints.build_model`, the encoder as it was trained: not
    folded for captioning, so that its feature cache is the training's)."""
    from captioner.lightning_cli import load_module

    path = resolve(checkpoint)
    if "hyper_parameters" in read(path, checkpoint, mmap=True):
        module = load_module(str(path))
        return module.model.eval(), module.vocab
    file = model_file(path, checkpoint)
    return build_model(file, checkpoint).eval(), Vocabulary(file.vocab)


@torch.no_grad()
def score_split(model, vocab: Vocabulary, datamodule, split: str, decoding: dict, ptb_tokenizer: bool = False):
    """Each image of `split` ("val" or "test") decoded once with the search options `decoding` (as `generate` takes
    them), on CUDA where there is one: the coco-caption scores (on captioner's tokens, or with `ptb_tokenizer`
    coco-caption's PTB tokenizer, which needs Java), the share of captions that are one of their references word for
    word, how peaked each word's attention is, and on datasets with object boxes (shapes) attention correctness and
    its ceiling. Returns the scores and the captions (image id -> text)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    datamodule.set_encoder(model.encoder)
    datamodule.setup("test" if split == "test" else "validate")
    source = datamodule.split(split)
    loader = datamodule.test_dataloader() if split == "test" else datamodule.val_dataloader()
    hypotheses, references = {}, {}  # image id -> the caption's text; -> its references' texts
    exact, everything, masses, ceilings = [], [], [], []  # per image; per object word (shapes)
    for batch in tqdm(loader, desc=f"evaluate {split}", unit="batch", disable=None):  # on a terminal only
        if not batch:  # no readable image in the batch (each was reported)
            continue
        inputs = {k: batch[k].to(device) for k in ("images", "annotations") if k in batch}
        generation = model.generate(**inputs, **decoding)
        decoded = decode_batch(batch, generation, vocab, model.encoder.grid_hw)
        everything += decoded
        for image in decoded:
            image_id = source.image_id(image.index) if hasattr(source, "image_id") else image.index
            hypotheses[image_id] = detokenize(image.words)
            references[image_id] = source.captions(image.index)
            exact.append(image.words in image.references)
            masses += image.masses  # datasets with object boxes (shapes); empty lists for the others
            ceilings += image.ceilings
    if ptb_tokenizer:
        scores = coco_caption_scores(hypotheses, references)
    else:  # the words that the vocabulary, training and validation see, in any script
        words = {k: " ".join(tokenize(v)) for k, v in hypotheses.items()}
        scores = coco_caption_scores(
            words, {k: [" ".join(tokenize(c)) for c in v] for k, v in references.items()}, tokenized=True
        )
    scores["exact_reference"] = sum(exact) / max(len(exact), 1)  # captions that are one of their references
    peaks = peakedness_scores(everything)  # how peaked each word's attention is, over all words and content words
    if peaks:  # a word's share in its strongest tenth of the grid (and uniform's), its entropy over uniform's (1)
        P = model.encoder.num_pixels
        scores |= {name.replace("attn_", "attention_"): value for name, value in peaks.items()}
        scores["attention_top_tenth_uniform"] = math.ceil(P / 10) / P
    if masses:
        scores["attention_correctness"] = sum(masses) / len(masses)
        scores["attention_ceiling"] = sum(ceilings) / len(ceilings)
    return scores, hypotheses
