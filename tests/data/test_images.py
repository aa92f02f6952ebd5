import numpy as np
import pytest
from PIL import Image

from captioner.data.images import ImageError, find_images, load_image
from tests.images import write_bad_files, write_good_images


def test_every_promised_mode_loads_as_rgb(tmp_path):
    for path in write_good_images(tmp_path):
        image = load_image(path)
        assert image.mode == "RGB" and min(image.size) >= 1, path


def test_exif_orientation_is_respected(tmp_path):
    path = next(p for p in write_good_images(tmp_path) if p.name == "exif_rotated.jpg")
    assert Image.open(path).size == (160, 120)
    assert load_image(path).size == (120, 160)  # orientation 6: displayed rotated by 90 degrees


def test_sixteen_bit_images_keep_their_contrast(tmp_path):
    path = next(p for p in write_good_images(tmp_path) if p.name == "sixteen_bit.png")
    pixels = np.asarray(load_image(path))
    assert pixels.max() - pixels.min() > 150  # not clipped to white by a naive conversion


def test_transparent_pixels_become_white(tmp_path):
    path = tmp_path / "clear.png"
    Image.new("RGBA", (4, 4), (255, 0, 0, 0)).save(path)
    assert np.asarray(load_image(path))[0, 0].tolist() == [255, 255, 255]


def test_broken_files_raise_one_line_naming_file_and_reason(tmp_path):
    for path, reason in write_bad_files(tmp_path).items():
        with pytest.raises(ImageError) as info:
            load_image(path)
        message = str(info.value)
        assert message.startswith(f"{path}: ") and reason in message and "\n" not in message


def test_find_images_recurses_into_folders_and_keeps_files(tmp_path):
    good = write_good_images(tmp_path / "a")
    (tmp_path / "a" / "readme.txt").write_text("not an image")
    found, errors = find_images([tmp_path / "a", tmp_path / "other.jpg"])
    assert sorted(found[:-1]) == sorted(good) and found[-1] == tmp_path / "other.jpg" and errors == []


def test_a_server_s_limits_refuse_big_images_from_the_header_and_decode_big_ones_reduced(tmp_path):
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (1500, 2000, 3), dtype=np.uint8))
    photo.save(tmp_path / "big.jpg")
    photo.save(tmp_path / "big.png")
    with pytest.raises(ImageError, match=r"big\.png: 2000x1500 pixels is over the 2 Mpx limit$"):
        load_image(tmp_path / "big.png", max_pixels=2_000_000)
    assert load_image(tmp_path / "big.png", max_pixels=3_000_000).size == (2000, 1500)
    # JPEG: decoded at 1/2 scale (1/4 would go below 448 pixels); PNG: decoded whole, then reduced by 3
    assert load_image(tmp_path / "big.jpg", reduce_to=448).size == (1000, 750)
    assert load_image(tmp_path / "big.png", reduce_to=448).size == (667, 500)
    assert load_image(tmp_path / "big.png", reduce_to=1000).size == (2000, 1500)  # not twice 1000 on both sides
