import json
import logging
from pathlib import Path

import pytest

from captioner.cli import main
from captioner.data.coco import clean, image_path, read_coco, read_custom, read_karpathy
from captioner.data.datamodules import CocoDataModule
from captioner.data.vocab import tokenize
from captioner.errors import ConfigError
from tests.conftest import REPO
from tests.datasets import CAPTIONS, write_coco, write_custom, write_karpathy, write_photos

SMALL_MODEL = ["--model.embed_dim=16", "--model.decoder_dim=16", "--model.attention_dim=16"]


def fit_args(tmp_path, config: str, *data: str, length: str = "--trainer.fast_dev_run=true") -> list[str]:
    """`captioner fit` on a shipped config; call it from tmp_path, where the config's relative paths then land."""
    return [
        "fit",
        "--config",
        str(REPO / config),
        "--trainer.accelerator=cpu",
        length,
        f"--trainer.default_root_dir={tmp_path}",
        f"--checkpoint.dirpath={tmp_path / 'ckpt'}",
        f"--data.init_args.data_dir={tmp_path}",
        "--data.init_args.batch_size=2",
        "--data.init_args.num_workers=0",
        "--data.init_args.min_word_count=1",
        "--data.init_args.download=false",
        *SMALL_MODEL,
        *data,
    ]


def test_readers_agree_on_the_photos_and_their_captions(tmp_path):
    write_coco(tmp_path / "coco")
    write_karpathy(tmp_path / "karpathy")
    write_custom(tmp_path / "custom")
    coco = read_coco(tmp_path / "coco/annotations/captions_train2014.json", tmp_path / "coco/train2014")
    assert [Path(r.image).name for r in coco] == ["astronaut.jpg", "chelsea.jpg", "coffee.jpg"]
    assert coco[1].captions == CAPTIONS["chelsea.jpg"] and coco[1].image_id == 2
    train = read_karpathy(tmp_path / "karpathy/dataset_coco.json", tmp_path / "karpathy", "train")
    assert sorted(Path(r.image).name for r in train) == ["astronaut.jpg", "chelsea.jpg", "coffee.jpg"]  # + restval
    assert [r.image_id for r in read_karpathy(tmp_path / "karpathy/dataset_coco.json", tmp_path, "test")] == [104]
    custom = read_custom(tmp_path / "custom/captions.jsonl", tmp_path / "custom/images")
    assert len(custom) == 12 and all(len(r.captions) == 2 for r in custom)
    write_custom(tmp_path / "csv", csv=True)
    assert [r.captions for r in read_custom(tmp_path / "csv/captions.csv", tmp_path / "csv/images")] == [
        r.captions for r in custom
    ]


@pytest.mark.parametrize("root", [".", "./", "data", "data/", "/abs/data", "data//coco", "../up"])
@pytest.mark.parametrize("filepath", ["", ".", "train2014", "val2014/"])
@pytest.mark.parametrize("name", ["a.jpg", "sub/b.jpg", "./c.jpg", "..", "d e.png"])
def test_an_image_path_is_spelled_as_pathlib_spells_it(root, filepath, name):
    """`image_path` makes Karpathy's 123k paths without pathlib; they must be pathlib's strings, which name the
    splits (their identities key the vocabulary and the caches)."""
    folder = Path(root, filepath)
    assert image_path(folder, name) == str(folder / name)


def test_bad_annotations_are_counted_and_skipped_in_one_line_that_shows_what_was_found(tmp_path):
    write_custom(tmp_path)
    with (tmp_path / "captions.jsonl").open("a") as f:
        for line in [
            {"image": "gone.jpg", "caption": "a photo that is not there"},
            {"image": "images/set1/gone.jpg", "caption": "another"},
            {"image": "set0/coffee.jpg", "caption": "  ...  "},
            {"image": "set0/coffee.jpg", "caption": " -- "},
            {"image": "set1/coffee.jpg", "caption": "word " * 60},
            {"image": "set2/coffee.jpg", "caption": "un café crème 😀"},
            {"image": "set2/rocket.jpg", "caption": "火箭在发射台上"},
        ]:
            f.write(json.dumps(line) + "\n")
    records = read_custom(tmp_path / "captions.jsonl", tmp_path / "images")
    kept, summary = clean(records, max_caption_len=50, name="mine")
    assert len(kept) == 12 and [len(r.captions) for r in kept].count(3) == 2  # café and the Chinese caption stay
    images = (tmp_path / "images").resolve()
    assert summary == (
        f"mine: skipped 1 caption longer than 50 words, 2 empty captions, 2 image files missing (the first: "
        f"{images / 'gone.jpg'}, looked for in {images}); kept 12 images; captions lose the symbols 😀 (the tokenizer "
        "keeps words)"
    )
    assert clean(records[:1], None, "clean") == (records[:1], None)


def test_a_csv_without_the_columns_names_the_header_it_found(tmp_path):
    (tmp_path / "captions.csv").write_text("filename,caption\na.jpg,a cat\n")
    with pytest.raises(
        ConfigError,
        match=r"captions\.csv: the CSV header must have the columns image,caption; found "
        r"filename,caption$",
    ):
        read_custom(tmp_path / "captions.csv", tmp_path)


def test_broken_image_file_does_not_stop_a_run(tmp_path, monkeypatch):
    write_custom(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "images/set0/chelsea.jpg").write_bytes(b"not a jpeg")
    main(
        fit_args(
            tmp_path, "configs/custom.yaml", "--data.init_args.val_fraction=0.3", "--data.init_args.test_fraction=0.2"
        )
    )
    bad = [json.loads(p.read_text())["bad"] for p in (tmp_path / "features").glob("*/meta.json")]
    assert sum(len(b) for b in bad) == 1  # the broken file was marked when the cache was built


@pytest.mark.parametrize("fmt", ["coco", "karpathy", "custom"])
def test_fast_dev_run_on_each_format(tmp_path, fmt, monkeypatch):
    monkeypatch.chdir(tmp_path)
    {"coco": write_coco, "karpathy": write_karpathy, "custom": write_custom}[fmt](tmp_path)
    config = "configs/custom.yaml" if fmt == "custom" else "configs/coco_lite0.yaml"
    fractions = {"val_fraction": 0.3, "test_fraction": 0.2}
    data = CocoDataModule(str(tmp_path), format=fmt, **fractions)
    if fmt == "custom":  # a word that only a held-out image's caption has (coco and karpathy have "launch")
        held_out = next(
            r
            for r in read_custom(tmp_path / "captions.jsonl", tmp_path / "images")
            if data.split_files.custom_split(str(r.image_id)) != "train"
        )
        with (tmp_path / "captions.jsonl").open("a") as file:
            file.write(json.dumps({"image": str(held_out.image_id), "caption": "a zeppelin"}) + "\n")
    words_of = {
        split: {w for i in range(len(data.split(split))) for c in data.split(split).captions(i) for w in tokenize(c)}
        for split in ("train", "val", "test")
    }
    held_out_only = (words_of["val"] | words_of["test"]) - words_of["train"]
    assert held_out_only >= ({"zeppelin"} if fmt == "custom" else {"launch"})  # words the vocabulary must not have

    main(
        fit_args(
            tmp_path,
            config,
            f"--data.init_args.format={fmt}",
            *(f"--data.init_args.{k}={v}" for k, v in fractions.items()),
        )
    )
    vocab_files = list(tmp_path.glob("vocab-*.json"))
    assert len(vocab_files) == 1  # saved beside the data
    words = json.loads(vocab_files[0].read_text())["itos"]
    assert words[:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert set(words[4:]) == words_of["train"]  # built from the training split only (min_word_count 1)


def test_unknown_format_and_missing_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown dataset format"):
        CocoDataModule(data_dir=str(tmp_path), format="voc")
    with pytest.raises(ConfigError, match=r"dataset_coco\.json: split file not found; data/README.md says where"):
        CocoDataModule(data_dir=str(tmp_path)).split("train")


MULTILINGUAL = {
    "astronaut.jpg": ["une astronaute en combinaison blanche devant un drapeau", "Космонавт улыбается в камеру"],
    "chelsea.jpg": ["un chat tigré assis par terre", "一只猫坐在地板上"],
    "coffee.jpg": ["un café crème sur une soucoupe", "一杯咖啡放在桌子上"],
    "rocket.jpg": ["Ракета на стартовой площадке", "une fusée prête au lancement 🚀"],
}


def test_captions_in_any_language_train_evaluate_and_caption(tmp_path, monkeypatch, caplog):
    """Accented, Cyrillic and Chinese captions, with an emoji and one truly empty caption: the vocabulary holds their
    words ("café", Cyrillic words, Chinese characters), only the empty caption is skipped, and the results JSON holds
    the vocabulary's words."""
    monkeypatch.chdir(tmp_path)
    lines = []
    for copy in range(3):
        write_photos(tmp_path / "images" / f"set{copy}", MULTILINGUAL)
        lines += [(f"set{copy}/{name}", c) for name, captions in MULTILINGUAL.items() for c in captions]
    lines.append(("set0/coffee.jpg", " …!? "))  # no word in any script: the one caption to skip
    (tmp_path / "captions.jsonl").write_text("".join(json.dumps({"image": i, "caption": c}) + "\n" for i, c in lines))
    data = ["--data.init_args.val_fraction=0.3", "--data.init_args.test_fraction=0.2"]
    checkpoint = str(tmp_path / "ckpt" / "best.ckpt")
    with caplog.at_level(logging.WARNING):
        main(fit_args(tmp_path, "configs/custom.yaml", *data, length="--trainer.max_epochs=1"))
        evaluation = [
            "--config",
            str(REPO / "configs/custom.yaml"),
            "--ckpt_path",
            checkpoint,
            "--output",
            "evaluation",
        ]
        main(
            [
                "evaluate",
                *evaluation,
                *data,
                f"--data.init_args.data_dir={tmp_path}",
                "--data.init_args.min_word_count=1",
            ]
        )
    (vocab_file,) = tmp_path.glob("vocab-*-tok2-*.json")
    words = set(json.loads(vocab_file.read_text())["itos"])
    assert "café" in words and words & {"猫", "咖", "啡"} and any(regex_cyrillic(word) for word in words)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert said.count("skipped 1 empty caption;") == 1 and "empty captions" not in said  # once, by its own split
    assert "missing" not in said and "longer than" not in said and "lose the symbols 🚀" in said
    scores = json.loads((tmp_path / "evaluation" / "metrics.json").read_text())
    assert all(0.0 <= v <= 10.0 for v in scores.values())
    results = json.loads((tmp_path / "evaluation" / "captions.json").read_text())
    assert results and all(set(tokenize(r["caption"].replace("<unk>", ""))) <= words for r in results)
    with pytest.raises(SystemExit) as exit_info:
        main(["caption", str(tmp_path / "images" / "set1"), "--ckpt_path", checkpoint])
    assert exit_info.value.code == 0


def regex_cyrillic(word: str) -> bool:
    return any("\u0400" <= ch <= "\u04ff" for ch in word)


def test_an_annotation_that_names_its_file_in_another_case_is_kept_where_names_ignore_case(tmp_path, monkeypatch):
    """`Photo.JPG` in the annotations for the file `photo.jpg`: on a file system that ignores case (macOS, Windows;
    emulated here) the image is kept, as it was before the folder listings;
    on one that does not (this one), it is missing, as it is."""
    import os

    from captioner.data.coco import Record

    write_photos(tmp_path / "images")
    name = next(p.name for p in (tmp_path / "images").iterdir())
    records = [Record(str(tmp_path / "images" / name.upper()), ["a photo of a thing"], 1)]
    kept, summary = clean(records, None, "photos")
    assert kept == [] and "1 image file missing" in summary

    lexists = os.path.lexists
    monkeypatch.setattr(os.path, "lexists", lambda path: lexists(os.path.join(*os.path.split(path)[:-1], name)))
    kept, summary = clean(records, None, "photos")
    assert [r.image for r in kept] == [records[0].image] and summary is None


def test_a_run_first_says_each_split_s_images_and_captions(tmp_path, caplog):
    """The counts of each split, said when it is set up (the first lines of a run), so that a wrong split file or
    folder is seen at once."""
    write_karpathy(tmp_path)
    module = CocoDataModule(str(tmp_path), format="karpathy", num_workers=0, min_word_count=1)
    with caplog.at_level(logging.INFO):
        module.setup("fit")
    said = [r.getMessage() for r in caplog.records if " split: " in r.getMessage()]
    tables = {split: module.datasets[split].captions for split in ("train", "val")}
    identity = {split: module.split(split).identity for split in tables}
    assert said == [
        f"{split} split: {len(t):,} images, {int(t.counts.sum()):,} captions ({identity[split]})"
        for split, t in tables.items()
    ]
    assert len(tables["train"]) > 0 and len(tables["val"]) > 0
