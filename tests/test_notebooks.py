"""Both notebooks run top to bottom, and are committed executed, with their outputs, so that their figures show where
the repository is browsed. `make notebooks` executes them again and writes them in place."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO
from tests.images import photo

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def execute(path) -> nbformat.NotebookNode:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", record_timing=False, resources={"metadata": {"path": path.parent}}
    )
    return client.execute()


def images(notebook: nbformat.NotebookNode) -> list[int]:
    """The number of figures (PNG or JPEG outputs) of each code cell."""
    cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    return [sum(bool({"image/png", "image/jpeg"} & set(o.get("data", {}))) for o in cell.outputs) for cell in cells]


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"attention_overlays.ipynb", "attention_basics.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_executed_with_their_figures(path):
    notebook = nbformat.read(path, as_version=4)
    cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1))  # top to bottom, once
    assert not [o for cell in cells for o in cell.outputs if o.output_type == "error"]
    assert sum(images(notebook)) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_and_draws_what_was_committed(path):
    executed = execute(path)
    outputs = [o for cell in executed.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    committed = images(nbformat.read(path, as_version=4))
    # Cell by cell, the figures committed are those the code draws now (a cell committed without figures may draw
    # some here: the last cell of attention_overlays shows your own checkpoint when `make demo` has written one)
    assert [n for n, c in zip(images(executed), committed, strict=True) if c] == [c for c in committed if c]


def test_the_overlays_notebook_runs_on_your_checkpoint_and_photos_by_changing_its_parameters_cell_alone(
    tiny_model, tmp_path
):
    path = REPO / "notebooks" / "attention_overlays.ipynb"
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code[0].metadata.get("tags") == ["parameters"]  # the first code cell, as papermill expects
    photos = [tmp_path / "cat.jpg", tmp_path / "coffee.png"]
    photo("chelsea").save(photos[0])
    photo("coffee").save(photos[1])
    code[0].source = f"checkpoint = {tiny_model!r}\nimages = {[str(p) for p in photos]!r}\nbeam_size = 2"
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": path.parent}})
    executed = client.execute()
    outputs = [o for cell in executed.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    printed = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")
    assert all(f"{p.name}: " in printed for p in photos)  # each photo's caption
    assert images(executed)[2] == 2  # one overlay figure per photo


if __name__ == "__main__":  # make notebooks
    for notebook_path in NOTEBOOKS:
        executed = execute(notebook_path)
        for cell in executed.cells:  # warnings about the writer's kernel (they name its paths) are not committed
            if cell.cell_type == "code":
                cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
        nbformat.write(executed, notebook_path)
        print(f"executed {notebook_path.relative_to(REPO)}: {sum(images(nbformat.read(notebook_path, 4)))} figures")
