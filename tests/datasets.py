"""Tiny real-photo caption datasets in every supported format, written into tmp_path by the tests."""

from __future__ import annotations

import json
from pathlib import Path

from tests.images import photo

CAPTIONS = {
    "astronaut.jpg": ["an astronaut in a white suit stands before a flag", "a woman astronaut smiles at the camera"],
    "chelsea.jpg": ["an orange cat looks to the left", "a tabby cat sitting on a floor"],
    "coffee.jpg": ["a cup of coffee on a saucer", "a white cup of espresso on a table"],
    "rocket.jpg": ["a rocket on a launch pad", "a space shuttle ready to launch under a blue sky"],
}


def write_photos(folder: Path, names=CAPTIONS) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        photo(name.split(".")[0]).resize((96, 96)).save(folder / name)


def write_coco(root: Path) -> None:
    """annotations/captions_{train,val}2014.json + train2014/ val2014/ (val: rocket and chelsea)."""
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    splits = {"train": ["astronaut.jpg", "chelsea.jpg", "coffee.jpg"], "val": ["rocket.jpg", "chelsea.jpg"]}
    ann_id = 0
    for split, names in splits.items():
        write_photos(root / f"{split}2014", names)
        images, annotations = [], []
        for image_id, name in enumerate(names, start=1):
            images.append({"id": image_id, "file_name": name, "width": 96, "height": 96})
            for caption in CAPTIONS[name]:
                ann_id += 1
                annotations.append({"id": ann_id, "image_id": image_id, "caption": caption})
        data = {"images": images, "annotations": annotations, "info": {}, "licenses": []}
        (root / "annotations" / f"captions_{split}2014.json").write_text(json.dumps(data))


def write_karpathy(root: Path, name: str = "dataset_coco.json") -> None:
    """Karpathy JSON: astronaut/coffee train, chelsea restval, rocket val and test."""
    write_photos(root / "images")
    splits = {"astronaut.jpg": "train", "coffee.jpg": "train", "chelsea.jpg": "restval", "rocket.jpg": "val"}
    items = [(n, s) for n, s in splits.items()] + [("rocket.jpg", "test")]
    images = [
        {
            "filepath": "images",
            "filename": n,
            "split": s,
            "imgid": i,
            "cocoid": 100 + i,
            "sentences": [{"raw": c, "tokens": c.split()} for c in CAPTIONS[n]],
        }
        for i, (n, s) in enumerate(items)
    ]
    (root / name).write_text(json.dumps({"images": images, "dataset": "coco"}))


def write_custom(root: Path, csv: bool = False) -> None:
    """12 image files (4 photos x 3 names) and a JSONL (or CSV) captions file, one line per caption."""
    lines = []
    for copy in range(3):
        folder = root / "images" / f"set{copy}"
        write_photos(folder)
        for name, captions in CAPTIONS.items():
            lines += [(f"set{copy}/{name}", c) for c in captions]
    if csv:
        body = "image,caption\n" + "".join(f'{image},"{caption}"\n' for image, caption in lines)
        (root / "captions.csv").write_text(body)
    else:
        body = "".join(json.dumps({"image": image, "caption": caption}) + "\n" for image, caption in lines)
        (root / "captions.jsonl").write_text(body)


def write_karpathy_like(root: Path, split_file: str, image_root: str) -> None:
    """A Karpathy split file over 12 images, laid out as the real dataset is: for COCO (dataset_coco.json) the images
    are in train2014/ and val2014/ under image_root, named in "filepath"; for Flickr directly in image_root, with no
    "filepath". Splits: 6 train, 2 restval, 2 val, 2 test."""
    coco = "coco" in split_file
    images = []
    for i, split in enumerate(["train"] * 6 + ["restval"] * 2 + ["val"] * 2 + ["test"] * 2):
        name = list(CAPTIONS)[i % len(CAPTIONS)]
        item = {"filename": f"{i:03d}_{name}", "split": split, "imgid": i, "sentences": []}
        folder = root / image_root
        if coco:
            item["filepath"] = "train2014" if split in ("train", "restval") else "val2014"
            item["cocoid"] = 1000 + i
            folder = folder / item["filepath"]
        folder.mkdir(parents=True, exist_ok=True)
        photo(name.split(".")[0]).resize((96, 96)).save(folder / item["filename"])
        item["sentences"] = [{"raw": c, "tokens": c.split()} for c in CAPTIONS[name]]
        images.append(item)
    if coco:  # the folders that a downloaded and extracted COCO has, whichever split file names them
        for part in ("train2014", "val2014"):
            (root / part).mkdir(parents=True, exist_ok=True)
    (root / split_file).write_text(json.dumps({"images": images, "dataset": "coco" if coco else "flickr8k"}))


def write_ucm(root: Path, split_file: str, image_root: str) -> None:
    """UCM-captions' layout: 256x256 RGB TIFF files named 1.tif, 2.tif... directly in image_root, and a Karpathy
    file without "filepath" whose sentences end with " ." as UCM's do. 12 images: 8 train, 2 val, 2 test."""
    images = []
    for i, split in enumerate(["train"] * 8 + ["val"] * 2 + ["test"] * 2):
        name = list(CAPTIONS)[i % len(CAPTIONS)]
        (root / image_root).mkdir(parents=True, exist_ok=True)
        photo(name.split(".")[0]).resize((256, 256)).save(root / image_root / f"{i + 1}.tif")
        sentences = [{"raw": f"{c} .", "tokens": c.split(), "imgid": i} for c in CAPTIONS[name]]
        images.append({"filename": f"{i + 1}.tif", "split": split, "imgid": i, "sentences": sentences})
    (root / split_file).write_text(json.dumps({"images": images, "dataset": "ucm"}))


def write_for_config(data: dict, cwd: Path) -> None:
    """Fixture data, in its dataset's own format, where a config's `data` section looks for it (relative to cwd).
    The built-in shapes set needs none."""
    args = data.get("init_args", {})
    if data["class_path"].endswith("ShapesDataModule"):
        return
    root = cwd / args["data_dir"]
    fmt = args.get("format", "karpathy")
    if fmt == "karpathy" and Path(args["data_dir"]).name == "ucm":
        write_ucm(root, args["split_file"], args["image_root"])
    elif fmt == "karpathy":
        write_karpathy_like(root, args.get("split_file", "dataset_coco.json"), args.get("image_root", "."))
    elif fmt == "custom":
        assert args.get("captions_file", "captions.jsonl") == "captions.jsonl" and args.get("image_dir") == "images"
        write_custom(root)
    else:
        assert fmt == "coco" and args.get("year", 2014) == 2014, f"no fixture for {fmt} {args.get('year')}"
        write_coco(root)
