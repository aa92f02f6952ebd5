"""`captioner caption`, run in the test's process through the script's `main` (exit status, stdout, stderr), and once in
a process of its own for what it imports."""

import json
import subprocess
import sys

from PIL import Image

from tests.conftest import run_main
from tests.images import write_bad_files, write_good_images


def test_folder_with_good_and_broken_files(tiny_model, tmp_path, capfd):
    good = write_good_images(tmp_path / "photos")
    bad = write_bad_files(tmp_path / "photos" / "broken")
    ran = run_main(capfd, "caption", str(tmp_path / "photos"), "--checkpoint", tiny_model, "--batch-size", "4",
                   "--beam-size", "2")  # fmt: skip
    assert ran.status == 1
    assert "Traceback" not in ran.err and "%|" not in ran.err  # no progress bar: stderr is not a terminal
    captioned = dict(line.split("\t") for line in ran.out.splitlines())
    assert sorted(captioned) == sorted(map(str, good))
    assert all(caption.strip() for caption in captioned.values())
    errors = [line for line in ran.err.splitlines() if line.startswith("error:")]
    assert len(errors) == len(bad)
    for path, reason in bad.items():
        assert any(f"error: {path}: " in line and reason in line for line in errors), (path, errors)


def test_all_good_files_exit_zero_with_json_and_overlays(tiny_model, tmp_path, capfd):
    image = tmp_path / "one.png"
    write_good_images(tmp_path / "x")[0].rename(image)
    ran = run_main(capfd, "caption", str(image), "--checkpoint", tiny_model, "--json", "--overlays",
                   str(tmp_path / "overlays"))  # fmt: skip
    assert ran.status == 0, ran.err
    record = json.loads(ran.out.strip())
    assert set(record) == {"path", "caption", "tokens", "score"} and record["path"] == str(image)
    assert record["caption"] == " ".join(record["tokens"])
    (sheet,) = (tmp_path / "overlays").glob("*.png")
    tiles = 1 + len(record["tokens"])  # the image, then one tile per word, 192 pixels wide for this 4:3 photo
    width, height = Image.open(sheet).size
    assert width == 5 * 192 and height == -(-tiles // 5) * (144 + 22) + 24  # rows of tiles, then the colour bar


def test_missing_path_is_reported_and_fails(tiny_model, tmp_path, capfd):
    ran = run_main(capfd, "caption", str(tmp_path / "missing.jpg"), "--checkpoint", tiny_model)
    assert ran.status == 1
    assert ran.err.strip().splitlines()[-1] == f"error: {tmp_path / 'missing.jpg'}: file not found"


def test_a_url_and_a_folder_without_images_are_one_line_each_and_the_rest_is_captioned(tiny_model, tmp_path, capfd):
    (tmp_path / "empty").mkdir()
    image = write_good_images(tmp_path / "x")[0]
    url = "https://example.com/cat.jpg"
    ran = run_main(capfd, "caption", url, str(tmp_path / "empty"), str(image), "--checkpoint", tiny_model)
    assert ran.status == 1 and "Traceback" not in ran.err
    assert ran.err.strip().splitlines() == [
        f"error: {url}: URLs are not supported; download the image and pass its path",
        f"error: {tmp_path / 'empty'}: no image files in this folder (looked for .jpg, .jpeg, .png, .bmp, .gif, .tif, "
        ".tiff, .webp, .ppm, .pgm, .jfif)",
    ]
    assert [line.split("\t")[0] for line in ran.out.splitlines()] == [str(image)]


def test_impossible_decoding_settings_are_one_line(tiny_model, tmp_path, capfd):
    image = write_good_images(tmp_path / "x")[0]
    for args, message in (
        (["--beam-size", "100000"], "words this vocabulary can generate"),
        (["--max-len", "0"], "max_len"),
    ):
        ran = run_main(capfd, "caption", str(image), "--checkpoint", tiny_model, *args)
        assert ran.status == 2 and "Traceback" not in ran.err, ran.err
        (line,) = ran.err.strip().splitlines()
        assert line.startswith("error: ") and message in line


def test_captioning_imports_neither_lightning_nor_nltk(tiny_model, tmp_path):
    """They take seconds to import, and `captioner caption` needs neither (benchmarks/caption_cli.py times start-up).
    A process of its own: the test's process has imported both."""
    image = write_good_images(tmp_path / "x")[0]
    code = (
        "import sys; from captioner.cli import caption; "
        f"status = caption([{str(image)!r}, '--checkpoint', {tiny_model!r}]); "
        "print(status, [m for m in ('lightning', 'nltk') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 []"
