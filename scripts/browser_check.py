"""Act as a learner in a real browser: JupyterLab in headless Chromium, widgets moved, views checked.

    .venv/bin/python scripts/browser_check.py [--out test-artifacts/browser]

Starts JupyterLab on a free loopback port with a token, over a temporary copy of the course (so
nothing in the repository is modified), opens each notebook that has widgets, runs it, then moves the
temperature and top-p sliders (05), the layer and head sliders (04) and types in the tokenizer box (01).
For each it records whether the view changed, the time from the key press to the updated view (a
MutationObserver in the page), the browser console errors, and a screenshot. Used by
tests/test_browser.py and by `make bench` (after the model benchmark), which prints the timings.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from course_lib.serve.serving import free_port

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]

# Lab settings for a test browser: render every cell (no virtual scrolling), and no news pop-up.
SETTINGS = {"@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}

# JavaScript run in the page: press a key on the slider labelled `label`, and time (performance.now)
# until the element whose text contains `watch` changes. This is the latency a learner sees:
# browser -> kernel -> compute -> HTML back -> DOM updated.
TIMED_KEY = """async ([label, watch, key]) => {
  const slider = [...document.querySelectorAll('.jp-OutputArea .widget-slider')]
      .find(s => s.querySelector('.widget-label')?.innerText.trim() === label);
  const handle = slider?.querySelector('.noUi-handle');
  const view = [...document.querySelectorAll('.jp-OutputArea .widget-html-content')].find(e => e.innerText.includes(watch));
  if (!handle || !view) return {error: 'not found: ' + (!handle ? label : watch)};
  const before = view.innerText;
  const changed = new Promise(resolve => {
    const obs = new MutationObserver(() => { if (view.innerText !== before) { obs.disconnect(); resolve(performance.now()); } });
    obs.observe(view, {childList: true, subtree: true, characterData: true});
    setTimeout(() => { obs.disconnect(); resolve(null); }, 10000);
  });
  handle.focus();
  const start = performance.now();
  handle.dispatchEvent(new KeyboardEvent('keydown', {key, bubbles: true}));
  const end = await changed;
  return {changed: end !== null, ms: end === null ? null : end - start, before: before.slice(0, 120),
          after: view.innerText.slice(0, 120)};
}"""


class Lab:
    """JupyterLab over a temporary copy of notebooks/ and data/, on 127.0.0.1 with a token."""

    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="course-lab-"))
        shutil.copytree(ROOT / "notebooks", self.tmp / "notebooks", ignore=shutil.ignore_patterns("src"))
        shutil.copytree(ROOT / "data", self.tmp / "data")
        self.port, self.token = free_port(), "course-test-token"
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={self.port}", "--ServerApp.ip=127.0.0.1",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.tmp / 'notebooks'}",
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--allow-root", "--LabApp.extension_manager=readonly"]
        settings = self.tmp / "lab-settings"
        for plugin, values in SETTINGS.items():
            path = settings / (plugin.replace(":", "/") + ".jupyterlab-settings")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ, COURSE_DEVICE="cpu", JUPYTERLAB_SETTINGS_DIR=str(settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.tmp / "lab-workspaces"))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.tmp / "lab.log", "w"), env=env)
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("JupyterLab did not start; see " + str(self.tmp / "lab.log"))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_notebook(page, lab: Lab, name: str, timeout_s: int = 300):
    """Open a notebook, run all cells through the Run menu, wait until every cell has finished."""
    # note: a workspace per notebook, so the lab does not reopen the previous notebook's tab as well
    page.goto(f"{lab.url}/lab/workspaces/{Path(name).stem}/tree/{name}?token={lab.token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    page.wait_for_function("() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]"
                           ".some(e => e.innerText.includes('Idle'))", timeout=60_000)  # the kernel is ready
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    page.wait_for_function("""() => {
      const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.innerText);
      const idle = [...document.querySelectorAll('.jp-StatusBar-TextItem')].some(e => e.innerText.includes('Idle'));
      return idle && prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p));
    }""", timeout=timeout_s * 1000, polling=500)


def timed_slider(page, label: str, watch: str, key: str) -> dict:
    result = page.evaluate(TIMED_KEY, [label, watch, key])
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def check_sampling(page) -> dict:
    return {"temperature": timed_slider(page, "temperature", "effective choices", "ArrowRight"),
            "top-p": timed_slider(page, "top-p", "effective choices", "ArrowLeft")}


def check_attention(page) -> dict:
    # note: the notebook leaves the layer slider at its maximum, so we move it down
    return {"layer": timed_slider(page, "layer", "% of attention", "ArrowLeft"),
            "head": timed_slider(page, "head", "% of attention", "ArrowLeft")}


def check_tokenizer(page) -> dict:
    box = page.locator(".jp-OutputArea .widget-textarea textarea").first
    chips = ".jp-OutputArea .widget-html-content:has-text('SmolLM2 tokenizer')"
    before = page.locator(chips).first.inner_text()
    box.fill("")
    start = time.perf_counter()
    box.type("Unbelievable 👍")
    page.wait_for_function("() => [...document.querySelectorAll('.widget-html-content')].some(e => "
                           "e.innerText.includes('3706'))", timeout=10_000)
    ms = (time.perf_counter() - start) * 1000
    after = page.locator(chips).first.inner_text()
    return {"typing (a whole phrase)": {"changed": after != before, "ms": ms, "before": before[:80], "after": after[:80]}}


CHECKS = {"05_sampling.ipynb": check_sampling, "04_attention.ipynb": check_attention,
          "01_tokenization.ipynb": check_tokenizer}


def main(out: Path, only: list[str] | None = None) -> dict:
    from playwright.sync_api import sync_playwright
    out.mkdir(parents=True, exist_ok=True)
    report, lab = {}, Lab()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            for name, check in CHECKS.items():
                if only and name[:2] not in only:
                    continue
                page = browser.new_page(viewport={"width": 1300, "height": 1000})
                errors = []
                page.on("console", lambda msg, errors=errors: msg.type == "error" and errors.append(msg.text))
                page.on("pageerror", lambda exc, errors=errors: errors.append(str(exc)))
                run_notebook(page, lab, name)
                result = check(page)
                page.screenshot(path=str(out / (Path(name).stem + ".png")), full_page=False)
                report[name] = {"views": result, "console_errors": errors}
                print(name, json.dumps(report[name], ensure_ascii=False)[:400], flush=True)
                page.close()
            browser.close()
    finally:
        lab.stop()
    (out / "browser_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "test-artifacts" / "browser"))
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    result = main(Path(args.out), args.only)
    for name, r in result.items():
        for view, v in r["views"].items():
            print(f"{name:<24} {view:<12} changed={v['changed']}  key press -> updated view: {v['ms']:.0f} ms")
