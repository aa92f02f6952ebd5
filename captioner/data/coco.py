"""Real caption datasets: official COCO captions (pycocotools), Karpathy splits (COCO, Flickr8k, Flickr30k) and a
custom image folder with a JSONL or CSV captions file.

Every reader returns `Record`s; `CaptionSet` holds one split of them and is what the datamodule and the feature cache
use. Bad annotations (missing image file, empty caption, caption longer than the maximum) are counted and skipped, and
reported in one summary line when the split is used.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from captioner.data.images import load_image
from captioner.data.sources import TOKENS_8K, read_split_file
from captioner.data.vocab import tokenize, words_and_lost
from captioner.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Record:
    image: str  # the image file's path, as pathlib spells it (`image_path`)
    captions: list[str]
    image_id: int | str = field(default=0)
    tokens: list[list[str]] | None = field(default=None, compare=False, repr=False)  # each caption's, from `clean`


def read_coco(annotation_file: str | Path, image_dir: str | Path) -> list[Record]:
    """Official COCO captions (`annotations/captions_{train,val}{2014,2017}.json`) read with pycocotools."""
    from pycocotools.coco import COCO

    annotation_file = Path(annotation_file)
    if not annotation_file.is_file():
        raise ConfigError(f"{annotation_file}: annotation file not found")
    coco = COCO(str(annotation_file))
    records = []
    for image_id in sorted(coco.getImgIds()):
        info = coco.loadImgs(image_id)[0]
        captions = [a["caption"] for a in coco.loadAnns(coco.getAnnIds(imgIds=image_id))]
        records.append(Record(str(Path(image_dir) / info["file_name"]), captions, image_id))
    return records


def read_karpathy(split_file: str | Path, image_root: str | Path, split: str) -> list[Record]:
    """Karpathy's `dataset_{coco,flickr8k,flickr30k}.json`; split "train" includes "restval"."""
    return read_karpathy_splits(split_file, image_root)[split]


KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}  # the file's name -> ours


def read_karpathy_splits(split_file: str | Path, image_root: str | Path) -> dict[str, list[Record]]:
    """Every split of a Karpathy file at once ("train" with "restval"): COCO's is parsed in seconds, once. Flickr8k's
    own `Flickr8k.token.txt` is read too, with the train, dev and test lists beside it (the same split)."""
    split_file = Path(split_file)
    if not split_file.is_file():
        raise ConfigError(
            f"{split_file}: split file not found; data/README.md says where each dataset's is had "
            "(download: true fetches COCO's and Flickr's)"
        )
    if split_file.name == TOKENS_8K:  # Flickr8k's own text files, the train, dev and test lists beside it
        try:
            data = read_split_file(split_file)
        except OSError as err:
            raise ConfigError(f"{err.filename}: {err.strerror} (Flickr8k's lists go beside {TOKENS_8K})") from None
    else:
        data = json.loads(split_file.read_text())
    splits: dict[str, list[Record]] = {"train": [], "val": [], "test": []}
    folders: dict[str, Path] = {}  # each image folder, made once (pathlib is slow to make 123k paths)
    for item in data["images"]:
        if item["split"] in KARPATHY_SPLITS:
            filepath = item.get("filepath", "")
            folder = folders.get(filepath) or folders.setdefault(filepath, Path(image_root, filepath))
            captions = [s.get("raw") or " ".join(s["tokens"]) for s in item["sentences"]]
            image_id = item.get("cocoid", item.get("imgid", item["filename"]))
            splits[KARPATHY_SPLITS[item["split"]]].append(
                Record(image_path(folder, item["filename"]), captions, image_id)
            )
    return splits


def image_path(folder: Path, name: str) -> str:
    """`str(folder / name)`, without making a Path for a plain file name (a few microseconds each, for 123k)."""
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        return str(folder / name)
    return name if str(folder) == "." else f"{folder}{'' if str(folder).endswith('/') else '/'}{name}"


def read_custom(captions_file: str | Path, image_dir: str | Path) -> list[Record]:
    """A folder of images plus a captions file: JSONL lines `{"image": "rel/path.jpg", "caption": "..."}` or a CSV
    with an `image,caption` header. Several lines for one image give several references."""
    captions_file = Path(captions_file)
    if not captions_file.is_file():
        raise ConfigError(f"{captions_file}: captions file not found")
    rows: list[tuple[str, str]] = []
    with captions_file.open(newline="", encoding="utf-8") as f:
        if captions_file.suffix.lower() == ".csv":
            reader = csv.DictReader(f)
            if not {"image", "caption"} <= set(reader.fieldnames or []):
                found = ",".join(reader.fieldnames or [])[:100] or "an empty file"
                raise ConfigError(f"{captions_file}: the CSV header must have the columns image,caption; found {found}")
            rows = [(r["image"], r["caption"] or "") for r in reader]
        else:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        row = json.loads(line)
                        rows.append((row["image"], row.get("caption") or ""))
                    except (ValueError, KeyError, TypeError):
                        raise ConfigError(f"{captions_file}:{number}: not a JSON object with an image key") from None
    by_image: dict[str, list[str]] = {}
    for image, caption in rows:
        by_image.setdefault(image, []).append(caption)
    return [Record(str(Path(image_dir) / image), caps, image) for image, caps in by_image.items()]


def clean(records: list[Record], max_caption_len: int | None, name: str) -> tuple[list[Record], str | None]:
    """Drop empty captions (no word in any script), captions of more than `max_caption_len` words (None: keep every
    length) and images whose file is missing. Returns the records kept, each with its captions' tokens (a caption is
    tokenized here, once), and a one-line summary of what was dropped, with the first missing file and the folder it
    was looked for in, and of the symbols that captions lose to the tokenizer (None when nothing was)."""
    dropped: Counter[str] = Counter()
    missing: Path | None = None
    lost: Counter[str] = Counter()  # symbols and emoji that `tokenize` drops -> captions that had them
    kept = []
    files = _Listings()
    for record in records:
        if not files.has(record.image):
            dropped["image file missing"] += 1
            missing = missing or Path(record.image)
            continue
        captions, tokens = [], []
        for caption in record.captions:
            words, symbols = words_and_lost(caption)
            if symbols:
                lost.update(symbols)
            if not words:
                dropped["empty caption"] += 1
            elif max_caption_len is not None and len(words) > max_caption_len:
                dropped[f"caption longer than {max_caption_len} words"] += 1
            else:
                captions.append(caption)
                tokens.append(words)
        if captions:
            kept.append(Record(record.image, captions, record.image_id, tokens))
        else:
            dropped["image with no usable caption"] += 1
    if not dropped and not lost:
        return kept, None
    parts = [plural(n, what) for what, n in sorted(dropped.items())]
    if missing is not None:
        parts[sorted(dropped).index("image file missing")] += (
            f" (the first: {missing.resolve()}, looked for in {missing.parent.resolve()})"
        )
    summary = f"{name}: skipped {', '.join(parts)}; kept {plural(len(kept), 'image')}" if dropped else name + ":"
    if lost:
        symbols = " ".join(symbol for symbol, _ in lost.most_common(10))
        summary += f"{';' if dropped else ''} captions lose the symbols {symbols} (the tokenizer keeps words)"
    return kept, summary


class _Listings:
    """Whether image files exist, from one listing of each folder (a stat of every file takes seconds at COCO's
    size). A listed entry counts as a file if it is one, or a link to anything: a link that leads nowhere is said when
    its image is read, as an unreadable file is. A name listed only in another case (an annotation's `Photo.JPG` for
    the file `photo.jpg`) is asked of the file system itself: it exists where names ignore case (macOS, Windows),
    and not elsewhere."""

    def __init__(self):
        self.folders: dict[str, tuple[set[str], set[str]]] = {}  # folder -> its names, and the same casefolded

    def has(self, path: str) -> bool:
        folder, name = os.path.split(path)
        listed = self.folders.get(folder)
        if listed is None:
            try:
                with os.scandir(folder or ".") as entries:
                    names = {e.name for e in entries if e.is_symlink() or e.is_file(follow_symlinks=False)}
            except OSError:  # a missing folder: nothing in it
                names = set()
            listed = self.folders[folder] = (names, {n.casefold() for n in names})
        names, folded = listed
        return name in names or (name.casefold() in folded and os.path.lexists(path))


PLURALS = {"image file missing": "image files missing", "image with no usable caption": "images with no usable caption"}


def plural(count: int, what: str) -> str:
    """ "1 empty caption", "2 empty captions", "2 image files missing", "2 captions longer than 50 words"."""
    if count == 1:
        return f"1 {what}"
    first, _, rest = what.partition(" ")
    words = PLURALS.get(what) or (f"{first}s {rest}" if first == "caption" else f"{what}s")
    return f"{count:,} {words}"


class CaptionSet:
    """One split of a real dataset: images on disk and their reference captions, and the summary of what `clean`
    dropped from them (reported by the datamodule when the split is used)."""

    def __init__(self, name: str, records: list[Record], summary: str | None = None):
        if not records:
            raise ConfigError(f"{name}: no usable images" + (f" ({summary})" if summary else ""))
        self.records, self.summary = records, summary
        listing = "\n".join(f"{r.image}|{len(r.captions)}" for r in records)
        self.identity = f"{name}-n{len(records)}-{hashlib.sha256(listing.encode()).hexdigest()[:10]}"

    def __len__(self) -> int:
        return len(self.records)

    def load_image(self, index: int) -> Image.Image:
        return load_image(self.records[index].image)

    def captions(self, index: int) -> list[str]:
        return self.records[index].captions

    def tokens(self, index: int) -> list[list[str]]:
        """The tokens of each of image `index`'s captions (`tokenize`), made once."""
        record = self.records[index]
        if record.tokens is None:
            record.tokens = [tokenize(caption) for caption in record.captions]
        return record.tokens

    def image_id(self, index: int) -> int | str:
        return self.records[index].image_id

    def image(self, index: int) -> Path:
        return Path(self.records[index].image)
