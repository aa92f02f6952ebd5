"""What the image cache changes in the model's inputs: for photos of several sizes, the pixels and the annotations
(the frozen encoder's output) that the model gets from the cache, against those it gets from the image files, which
is also what `Captioner.caption` gives it.

    python benchmarks/image_cache_inputs.py                          # scikit-image's photos, at 224 and 448 pixels
    python benchmarks/image_cache_inputs.py --images data/ucm/images # and a folder of your images

Forms, each against the files' path:
- format 1 (the cache before format 2): PIL's resize of the photo, then JPEG at quality 95; and without its JPEG;
- format 2 (now): the files' path's own resize (torchvision, on the image as a tensor), then JPEG at quality 95;
- format 2 without its JPEG: what is left is its resize, which should be none;
- augmented, format 2: the same random crop (RandomResizedCrop's box, at least 80% of the area) taken from the cached
  image and scaled up to the input size, where the files' path takes it from the photo.

Figures: the mean absolute difference of the pixels, in levels of 255; the annotations' relative difference
||a - a_files|| / ||a_files||, and the mean cosine of each annotation vector (a grid cell's) with the files' path's,
over the images. The encoder: pretrained EfficientNet-Lite0 (the bundled model's and configs/ucm.yaml's), frozen; at
448 pixels its grid is 14x14.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import torch
from common.harness import Script
from PIL import Image
from torchvision.transforms import RandomResizedCrop, v2

from captioner.data.image_cache import QUALITY, _Encoded
from captioner.data.images import load_image
from captioner.models.encoder import Encoder

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "retina", "immunohistochemistry", "cat", "hubble_deep_field")


def photos(folder: str | None, limit: int) -> list[Image.Image]:
    if folder is None:
        import skimage.data

        return [Image.fromarray(getattr(skimage.data, name)()) for name in PHOTOS]
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    picks = np.linspace(0, len(files) - 1, min(limit, len(files))).astype(int)
    return [load_image(files[i]) for i in picks]


def jpeg(pixels: torch.Tensor) -> torch.Tensor:
    """Pixels (3,S,S) uint8 through JPEG at the cache's quality, as a build writes them and a read gives them."""
    buffer = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(buffer, "JPEG", quality=QUALITY)
    return v2.functional.pil_to_tensor(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))


def inputs(images: list[Image.Image], encoder: Encoder, seed: int = 0) -> dict[str, tuple[list, list]]:
    """Per form, the model's input pixels from the cache and from the files, image by image."""
    preprocessing = encoder.preprocessing
    S = preprocessing.size
    files = preprocessing.transforms(normalize=False)  # the uncached path: ToImage, Resize (a tensor's)
    mode = v2.InterpolationMode(preprocessing.interpolation)
    pil_resize = v2.Resize((S, S), interpolation=mode, antialias=True)  # format 1 resized the PIL image
    encoded = _Encoded(None, preprocessing)
    torch.manual_seed(seed)  # the crop boxes
    names = ("format 1", "format 1, no JPEG", "format 2", "format 2, no JPEG")
    forms: dict[str, tuple[list, list]] = {name: ([], []) for name in names}
    forms["augmented, format 2"] = ([], [])
    for image in images:
        want = files(image)
        format1 = v2.functional.pil_to_tensor(pil_resize(image))
        resized = torch.from_numpy(encoded.resize(image)).permute(2, 0, 1)
        made = {"format 1": jpeg(format1), "format 1, no JPEG": format1, "format 2": jpeg(resized)}
        for name, got in (made | {"format 2, no JPEG": resized}).items():
            forms[name][0].append(got)
            forms[name][1].append(want)
        # one crop box, as augmentation draws it, relative to the image: from the photo, and from the cached image
        photo = v2.functional.pil_to_tensor(image)
        H, W = photo.shape[-2:]
        top, left, height, width = RandomResizedCrop.get_params(photo, scale=(0.8, 1.0), ratio=(3 / 4, 4 / 3))
        box = (top / H, left / W, height / H, width / W)

        def cropped(x: torch.Tensor, box=box) -> torch.Tensor:
            h, w = x.shape[-2:]
            t, l, bh, bw = round(box[0] * h), round(box[1] * w), round(box[2] * h), round(box[3] * w)
            return v2.functional.resized_crop(x, t, l, bh, bw, [S, S], interpolation=mode, antialias=True)

        forms["augmented, format 2"][0].append(cropped(jpeg(resized)))
        forms["augmented, format 2"][1].append(cropped(photo))
    return forms


@torch.inference_mode()
def compare(encoder: Encoder, got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, str]:
    a, b = torch.stack(got), torch.stack(want)  # (N,3,S,S) uint8
    levels = (a.float() - b.float()).abs().mean()
    x, y = encoder(a), encoder(b)  # (N,P,E): the encoder normalises uint8 images itself
    relative = ((x - y).flatten(1).norm(dim=1) / y.flatten(1).norm(dim=1)).mean()
    cosine = torch.nn.functional.cosine_similarity(x, y, dim=-1).mean()
    return {
        "pixels: mean |difference|, levels": f"{levels:.2f}",
        "annotations: relative difference": f"{relative:.4f}",
        "annotations: mean cosine": f"{cosine:.4f}",
    }


def main() -> None:
    script = Script(__file__, __doc__)
    script.option("--images", help="a folder of images (default: scikit-image's photos)")
    script.option("--limit", type=int, default=210, help="at most this many of the folder's images")
    script.option("--sizes", default="224,448", help="the encoder's input sizes, comma-separated")
    options = script.start()
    images = photos(options.images, options.limit)
    print(f"{len(images)} images of {len({image.size for image in images})} sizes", flush=True)
    title = f"the model's inputs from the image cache against from the files, {len(images)} images"
    rows = script.table("image_cache_inputs", title)
    for size in map(int, options.sizes.split(",")):
        torch.manual_seed(0)
        encoder = Encoder("efficientnet_lite0", image_size=size).eval()
        forms = inputs(images, encoder)
        for name, (got, want) in forms.items():
            row = {"input size": size, "form": name}
            rows.measure(row, lambda got=got, want=want, encoder=encoder: compare(encoder, got, want))
    script.finish()


if __name__ == "__main__":
    sys.exit(main())
