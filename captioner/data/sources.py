"""Where each real dataset's files can be had, and how a split file is made from what a source gives.

Karpathy's `caption_datasets.zip` (the split files of COCO, Flickr8k and Flickr30k) has answered 404 since 2023. So
each split file has sources tried in order, each read into Karpathy's format and checked against the split's known
image counts before it is kept:

- COCO (`dataset_coco.json`, 113,287 / 5,000 / 5,000 images): Karpathy's zip, then the same split as BLIP and LAVIS
  publish it (`coco_karpathy_{train,val,test}.json`, with LAVIS's MD5s);
- Flickr8k (`dataset_flickr8k.json`, 6,000 / 1,000 / 1,000): Karpathy's zip, then the dataset's own text files
  (`Flickr8k.token.txt` and the `Flickr_8k.{train,dev,test}Images.txt` lists, whose split Karpathy's file holds),
  from the public mirror of its zips in jbrownlee/Datasets' releases;
- Flickr30k (`dataset_flickr30k.json`, 29,000 / 1,014 / 1,000): Karpathy's zip, then LAVIS's `flickr30k_*.json`. Its
  images have no public source: they are asked of their authors (data/README.md).
- UCM-captions (`dataset_ucm.json`, 1,680 / 210 / 210; Qu et al. 2016): the `dataset.json` of a public GitHub
  repository that holds the set as released (its SHA-256 pinned), then the same file in that repository's archive.
  Its 2,100 photos come from that archive (checked by the digest of their files), else from the UC Merced Land Use
  archive (Yang and Newsam 2010; its MD5 as torchgeo publishes it), whose class-named files are numbered as the
  captions are: class by class in alphabetical order, each block of 100 captions describing its class.

A source's name (`SOURCES`) is what `CocoDataModule`'s `urls` overrides, for a mirror or a test's server.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    """One file's address, its digest where one is known ("md5:<hex>" or "sha256:<hex>"), and the name it is saved
    under where the address does not end in one (GitHub's archives), from this address or a mirror's."""

    url: str
    digest: str | None = None
    filename: str | None = None

    def saved_as(self, url: str) -> str:
        """The downloaded file's name: this source's own, or the last part of `url` (this address or a mirror's)."""
        return self.filename or Path(url).name


LAVIS = "https://storage.googleapis.com/sfr-vision-language-research/datasets"
MIRROR_8K = "https://github.com/jbrownlee/Datasets/releases/download/Flickr8k"
# UCM-captions as released (dataset.json and imgs/1.tif ... 2100.tif), in a public repository, at a fixed commit
UCM_REPO = "AnkitJha06/Image-Description-Generation-Using-Attention-Mechanism"
UCM_COMMIT = "a74db8f41cfe3c8a7a60e59fc49bc144a7bcb797"
UCM_ARCHIVE_TOP = f"{UCM_REPO.split('/')[1]}-{UCM_COMMIT}"  # the folder at the top of GitHub's archive of it
UCMERCED = "UCMerced_LandUse.zip"
TORCHGEO = "https://huggingface.co/datasets/torchgeo/ucmerced/resolve/main"  # torchgeo's mirror of the archive
UCMERCED_MD5 = "md5:5b7ec56793786b6dc8a908e8854ac0e4"  # torchgeo's (torchgeo/datasets/ucmerced.py)
SOURCES = {
    "karpathy": Source("https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip"),
    # LAVIS's own MD5s (lavis/configs/datasets/coco/defaults_cap.yaml)
    "coco_karpathy_train": Source(f"{LAVIS}/coco_karpathy_train.json", "md5:aa31ac474cf6250ebb81d18348a07ed8"),
    "coco_karpathy_val": Source(f"{LAVIS}/coco_karpathy_val.json", "md5:b273847456ef5580e33713b1f7de52a0"),
    "coco_karpathy_test": Source(f"{LAVIS}/coco_karpathy_test.json", "md5:3ff34b0ef2db02d01c37399f6a2a6cd1"),
    "flickr30k_train": Source(f"{LAVIS}/flickr30k_train.json"),
    "flickr30k_val": Source(f"{LAVIS}/flickr30k_val.json"),
    "flickr30k_test": Source(f"{LAVIS}/flickr30k_test.json"),
    # No digest is published for these: the split file made from them is checked by its counts
    "flickr8k_text": Source(f"{MIRROR_8K}/Flickr8k_text.zip"),
    "flickr8k_images": Source(f"{MIRROR_8K}/Flickr8k_Dataset.zip"),
    "train2014": Source("http://images.cocodataset.org/zips/train2014.zip"),
    "val2014": Source("http://images.cocodataset.org/zips/val2014.zip"),
    "train2017": Source("http://images.cocodataset.org/zips/train2017.zip"),
    "val2017": Source("http://images.cocodataset.org/zips/val2017.zip"),
    "annotations2014": Source("http://images.cocodataset.org/annotations/annotations_trainval2014.zip"),
    "annotations2017": Source("http://images.cocodataset.org/annotations/annotations_trainval2017.zip"),
    "ucm_split": Source(
        f"https://raw.githubusercontent.com/{UCM_REPO}/{UCM_COMMIT}/dataset.json",
        "sha256:d21094cc42b172adb0c407d3ef0163e1b6115a1837760178858890e937e4a3fb",
    ),
    # GitHub makes its archives on request, so their bytes are not pinned: the photos in it are checked instead
    "ucm_repository": Source(f"https://codeload.github.com/{UCM_REPO}/zip/{UCM_COMMIT}", filename="ucm_repository.zip"),
    "ucmerced": Source(f"http://weegee.vision.ucmerced.edu/datasets/{UCMERCED}", UCMERCED_MD5),
    "ucmerced_mirror": Source(f"{TORCHGEO}/{UCMERCED}", UCMERCED_MD5),
}

Splits = dict  # Karpathy's format: {"images": [{"filepath", "filename", "split", "imgid", "sentences": [...]}]}


def counts(karpathy: Splits) -> tuple[int, int, int]:
    """Images in train (restval included), val and test."""
    found = {"train": 0, "val": 0, "test": 0}
    for image in karpathy["images"]:
        split = "train" if image["split"] == "restval" else image["split"]
        found[split] = found.get(split, 0) + 1
    return found["train"], found["val"], found["test"]


def _image(filepath: str, filename: str, split: str, index: int, captions: list[str], cocoid: int | None) -> dict:
    record = {"filepath": filepath, "filename": filename, "split": split, "imgid": index}
    record["sentences"] = [{"raw": caption, "tokens": []} for caption in captions]
    return record | ({"cocoid": cocoid} if cocoid is not None else {})


def from_karpathy_zip(files: list[Path], split_file: str) -> Splits:
    """`caption_datasets.zip`: the split file itself."""
    with zipfile.ZipFile(files[0]) as archive:
        member = next((name for name in archive.namelist() if Path(name).name == split_file), None)
        if member is None:
            raise ValueError(f"it holds no {split_file}")
        return json.loads(archive.read(member))


def from_lavis(files: list[Path], split_file: str) -> Splits:
    """BLIP's and LAVIS's files, train, val and test: the train file has one entry per caption ({"image":
    "val2014/COCO_val2014_000000116100.jpg", "caption": str}), val and test one per image with its captions (a list).
    COCO's image ids are read from the file names. Their Flickr30k names start with the folder of its archive,
    `flickr30k-images/`, which Karpathy's file does not name: left out, so that the photos are in the image root
    whichever source gave the split."""
    images: dict[str, dict] = {}
    for path, split in zip(files, ("train", "val", "test"), strict=True):
        for entry in json.loads(path.read_text(encoding="utf-8")):
            name = entry["image"]
            captions = entry["caption"] if isinstance(entry["caption"], list) else [entry["caption"]]
            if name not in images:
                filepath, _, filename = name.rpartition("/")
                filepath = "" if "flickr30k" in split_file else filepath
                cocoid = re.search(r"_(\d+)\.\w+$", filename)
                cocoid = int(cocoid.group(1)) if cocoid and filename.startswith("COCO_") else None
                images[name] = _image(filepath, filename, split, len(images), [], cocoid)
            images[name]["sentences"] += [{"raw": caption, "tokens": []} for caption in captions]
    return {"images": list(images.values()), "dataset": Path(split_file).stem.removeprefix("dataset_")}


TOKENS_8K = "Flickr8k.token.txt"
LISTS_8K = {"train": "Flickr_8k.trainImages.txt", "val": "Flickr_8k.devImages.txt", "test": "Flickr_8k.testImages.txt"}


def flickr8k_splits(read: Callable[[str], str]) -> Splits:
    """Flickr8k's own text files (`read(name)` gives one's text): `Flickr8k.token.txt` (`<image>#<n>\\t<caption>`
    lines) and the train, dev and test lists of image names, the split Karpathy's `dataset_flickr8k.json` holds."""
    captions: dict[str, list[str]] = {}
    for line in read(TOKENS_8K).splitlines():
        key, _, caption = line.partition("\t")
        if caption.strip():
            captions.setdefault(key.rsplit("#", 1)[0], []).append(caption.strip())
    images = []
    for split, listing in LISTS_8K.items():
        for name in read(listing).split():
            images.append(_image("", name, split, len(images), captions.get(name, []), None))
    return {"images": images, "dataset": "flickr8k"}


def read_split_file(path: Path) -> Splits:
    """A split file on disk, in Karpathy's format: a Karpathy JSON file as it is, or Flickr8k's own text files (its
    `Flickr8k.token.txt`, the train, dev and test lists beside it)."""
    if path.name == TOKENS_8K:
        return flickr8k_splits(lambda name: (path.parent / name).read_text(encoding="utf-8"))
    return json.loads(path.read_text(encoding="utf-8"))


def from_flickr8k_zip(files: list[Path], split_file: str) -> Splits:
    """The mirror's `Flickr8k_text.zip`: the text files at its top or in a folder."""
    with zipfile.ZipFile(files[0]) as archive:
        names = {Path(name).name: name for name in archive.namelist() if not name.startswith("__MACOSX")}
        missing = [name for name in (TOKENS_8K, *LISTS_8K.values()) if name not in names]
        if missing:
            raise ValueError(f"it holds no {', '.join(missing)}")
        return flickr8k_splits(lambda name: io.TextIOWrapper(archive.open(names[name]), encoding="utf-8").read())


@dataclass(frozen=True)
class Route:
    """One way to a split file: the sources it downloads, and how what they give becomes the file."""

    sources: tuple[str, ...]
    read: Callable[[list[Path], str], Splits]


@dataclass(frozen=True)
class Archive:
    """One archive that holds a folder of a dataset's images: its source, the folder in it that holds them, how a
    file's path in that folder becomes its name in the dataset (None: kept; a name of None: the file is left out),
    the SHA-256 of the images it must give (`captioner.data.download.images_digest`) where it is known, and what is
    said once when it is the archive used."""

    source: str
    folder: str
    rename: Callable[[str], str | None] | None = None
    digest: str | None = None
    note: str = ""


@dataclass(frozen=True)
class Images:
    """A folder of the images a split file names: `folder` under the image root ("": the root itself; COCO's
    `train2014/`, Flickr8k's photos), from the first of `archives` that gives it."""

    folder: str
    archives: tuple[Archive, ...]


@dataclass(frozen=True)
class Plan:
    """What `download: true` fetches for a Karpathy split file, in order: the file (from the first route that gives
    the split's counts), then the folders of images that are not on disk. `section` is data/README.md's, for files
    put in place by hand."""

    counts: tuple[int, int, int]
    routes: tuple[Route, ...]
    images: tuple[Images, ...]
    section: str


def from_json(files: list[Path], split_file: str) -> Splits:
    """A split file in Karpathy's format, as it is."""
    return json.loads(files[0].read_text(encoding="utf-8"))


def from_zip_member(member: str) -> Callable[[list[Path], str], Splits]:
    """A split file in Karpathy's format, as it is, at `member` of a zip."""

    def read(files: list[Path], split_file: str) -> Splits:
        with zipfile.ZipFile(files[0]) as archive:
            try:
                return json.loads(archive.read(member))
            except KeyError:
                raise ValueError(f"it holds no {member}") from None

    return read


# UC Merced's 21 classes, in the order UCM-captions numbers their photos (1-100 agricultural, ..., 2001-2100 tennis)
UCM_CLASSES = (
    *("agricultural", "airplane", "baseballdiamond", "beach", "buildings", "chaparral", "denseresidential", "forest"),
    *("freeway", "golfcourse", "harbor", "intersection", "mediumresidential", "mobilehomepark", "overpass"),
    *("parkinglot", "river", "runway", "sparseresidential", "storagetanks", "tenniscourt"),
)


def ucm_number(path: str) -> str | None:
    """UC Merced's `<class>/<class>NN.tif` under the name UCM-captions gives it: its class's block of 100, NN within
    it (`agricultural/agricultural00.tif` is `1.tif`, `tenniscourt/tenniscourt99.tif` is `2100.tif`); None for any
    other file."""
    match = re.fullmatch(r"([a-z]+)/\1(\d\d)\.tif", path)
    if match is None or match.group(1) not in UCM_CLASSES:
        return None
    return f"{100 * UCM_CLASSES.index(match.group(1)) + int(match.group(2)) + 1}.tif"


UCMERCED_NOTE = (
    "UCM-captions' photos taken from the UC Merced Land Use archive, numbered by class: the captions' release saved "
    "them again, so a model's scores on these photos may differ slightly from its scores on the release's"
)


KARPATHY_ZIP = Route(("karpathy",), from_karpathy_zip)
FLICKR8K_IMAGES = (Images("", (Archive("flickr8k_images", "Flicker8k_Dataset"),)),)  # its photos, in the image root
PLANS = {
    "dataset_coco.json": Plan(
        (113_287, 5_000, 5_000),
        (KARPATHY_ZIP, Route(("coco_karpathy_train", "coco_karpathy_val", "coco_karpathy_test"), from_lavis)),
        tuple(Images(part, (Archive(part, part),)) for part in ("train2014", "val2014")),
        "MS-COCO (Karpathy splits, the usual setting)",
    ),
    "dataset_flickr8k.json": Plan(
        (6_000, 1_000, 1_000),
        (KARPATHY_ZIP, Route(("flickr8k_text",), from_flickr8k_zip)),
        FLICKR8K_IMAGES,
        "Flickr8k",
    ),
    # Flickr8k's own text files, put in place by hand: only its photos are fetched
    TOKENS_8K: Plan((6_000, 1_000, 1_000), (), FLICKR8K_IMAGES, "Flickr8k"),
    "dataset_flickr30k.json": Plan(
        (29_000, 1_014, 1_000),
        (KARPATHY_ZIP, Route(("flickr30k_train", "flickr30k_val", "flickr30k_test"), from_lavis)),
        (),  # no public source of the images
        "Flickr30k",
    ),
    "dataset_ucm.json": Plan(
        (1_680, 210, 210),
        (
            Route(("ucm_split",), from_json),
            Route(("ucm_repository",), from_zip_member(f"{UCM_ARCHIVE_TOP}/dataset.json")),
        ),
        (
            Images(
                "",
                (
                    Archive(
                        "ucm_repository",
                        f"{UCM_ARCHIVE_TOP}/imgs",
                        digest="70bf3caf4ad6ffde9e4f6176cc77d551016f6fcf32e7670bd962c62137a95d68",
                    ),
                    Archive("ucmerced", "UCMerced_LandUse/Images", ucm_number, note=UCMERCED_NOTE),
                    Archive("ucmerced_mirror", "UCMerced_LandUse/Images", ucm_number, note=UCMERCED_NOTE),
                ),
            ),
        ),
        "UCM-captions (aerial photos)",
    ),
}
