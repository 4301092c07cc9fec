"""The rendered edition: executed lessons as offline HTML (no remote scripts), widgets replaced by a note."""
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
site = importlib.util.module_from_spec(spec)
spec.loader.exec_module(site)


def test_widget_outputs_become_a_note():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("w")
    cell.outputs = [nbformat.v4.new_output("display_data", data={site.WIDGET_MIME: {"model_id": "x"}, "text/plain": "VBox()"})]
    nb.cells, nb.metadata["widgets"] = [cell], {"state": {}}
    html = site.to_html(site.strip_widgets(nb))
    assert "Interactive view" in html and "VBox()" not in html and "widgets" not in nb.metadata


def test_remote_scripts_are_removed():
    html = site.to_html(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title $x$")]))
    assert not re.search(r'<script[^>]*src="https?://', html) and not re.search(r'<link[^>]*href="https?://', html)


@pytest.mark.slow
def test_lesson_00_builds_offline_with_figures(tmp_path):
    pages = site.build(tmp_path, only=["00"])
    assert [p[0] for p in pages] == ["00_pipeline_tour.html"]
    html = (tmp_path / "00_pipeline_tour.html").read_text()
    assert "The capital of France is Paris." in html  # the model's real answer, from this run
    assert html.count("data:image/png;base64") >= 3  # the figures are embedded
    assert not re.search(r'<script[^>]*src="https?://', html)
    index = (tmp_path / "index.html").read_text()
    assert "00_pipeline_tour.html" in index and "The pipeline tour" in index
