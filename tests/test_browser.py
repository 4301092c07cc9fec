"""The widgets as a learner meets them: JupyterLab in headless Chromium (scripts/browser_check.py).
Needs Debian's chromium (.ci/run installs it); skipped elsewhere, except under CI where it must run."""
import importlib.util
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
HAVE_BROWSER = os.path.exists("/usr/bin/chromium") and importlib.util.find_spec("playwright") is not None

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture(scope="module")
def report():
    if not HAVE_BROWSER:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser tests: install chromium (apt-get install chromium) and playwright")
        pytest.skip("no /usr/bin/chromium or playwright here (`apt-get install chromium` to run these)")
    spec = importlib.util.spec_from_file_location("browser_check", ROOT / "scripts" / "browser_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    return module.main(ARTIFACTS)


@pytest.mark.parametrize("notebook, views", [("05_sampling.ipynb", ["temperature", "top-p"]),
                                             ("04_attention.ipynb", ["layer", "head"]),
                                             ("01_tokenization.ipynb", ["typing (a whole phrase)"])])
def test_views_change_when_the_learner_acts(report, notebook, views):
    result = report[notebook]
    for view in views:
        assert result["views"][view]["changed"], (notebook, view, result["views"][view])
        assert result["views"][view]["before"] != result["views"][view]["after"]
    assert result["console_errors"] == [], result["console_errors"]
    assert (ARTIFACTS / (Path(notebook).stem + ".png")).stat().st_size > 10_000


def test_slider_views_show_the_new_setting(report):
    sampling = report["05_sampling.ipynb"]["views"]
    assert "effective choices" in sampling["temperature"]["after"]
    attention = report["04_attention.ipynb"]["views"]
    assert attention["layer"]["after"].startswith("layer 28") and "head 3" in attention["head"]["after"]
    assert "3706" in report["01_tokenization.ipynb"]["views"]["typing (a whole phrase)"]["after"]
