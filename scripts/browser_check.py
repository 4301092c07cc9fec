"""Act as a learner in a real browser: JupyterLab in headless Chromium, widgets moved, views checked.

    .venv/bin/python scripts/browser_check.py [--out test-artifacts/browser]

Starts JupyterLab on a free loopback port with a token, over a temporary copy of the course (so
nothing in the repository is modified), opens each notebook that has widgets, runs it, then moves the
temperature and top-p sliders (05), the layer and head sliders (04) and types in the tokenizer box (01).
For each it records whether the view changed, the time from the key press to the updated view (a
MutationObserver in the page), the browser console errors, and a screenshot. Used by
tests/test_browser.py and by `make bench-browser`, which prints the timings.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]

# JavaScript run in the page: press a key on an element and time until `watch` changes.
TIMED_KEY = """async ([target, watch, key]) => {
  const t = document.querySelector(target), w = document.querySelector(watch);
  if (!t || !w) return {error: 'element not found: ' + (!t ? target : watch)};
  const before = w.innerText;
  const changed = new Promise(resolve => {
    const obs = new MutationObserver(() => { if (w.innerText !== before) { obs.disconnect(); resolve(performance.now()); } });
    obs.observe(w, {childList: true, subtree: true, characterData: true});
    setTimeout(() => { obs.disconnect(); resolve(null); }, 10000);
  });
  t.focus();
  const start = performance.now();
  t.dispatchEvent(new KeyboardEvent('keydown', {key, bubbles: true}));
  const end = await changed;
  return {ms: end === null ? null : end - start, before, after: w.innerText};
}"""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        env = dict(os.environ, COURSE_DEVICE="cpu", JUPYTER_PLATFORM_DIRS="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.tmp / "lab.log", "w"), env=env)
        deadline = time.time() + 90
        import urllib.request
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
    page.goto(f"{lab.url}/lab/tree/{name}?token={lab.token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    page.wait_for_function("() => document.querySelector('.jp-Notebook-ExecutionIndicator') === null || "
                           "!document.body.innerText.includes('Kernel Connecting')", timeout=60_000)
    time.sleep(2)  # let the kernel connect
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    page.wait_for_function("""() => {
      const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.innerText);
      return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p));
    }""", timeout=timeout_s * 1000, polling=500)


def check_sampling(page) -> dict:
    slider = ".jp-OutputArea .widget-slider:has(.widget-label:text-is('temperature')) .noUi-handle"
    watch = ".jp-OutputArea .widget-html:has-text('effective choices')"
    page.wait_for_selector(watch.replace(":has-text('effective choices')", ""), timeout=30_000)
    results = {}
    for label, key in [("temperature", "ArrowRight"), ("top-p", "ArrowLeft")]:
        target = f".jp-OutputArea .widget-slider:has(.widget-label:text-is('{label}')) .noUi-handle"
        handle = page.locator(target).first
        handle.focus()
        before = page.locator(".jp-OutputArea .widget-html-content:has-text('effective choices')").first.inner_text()
        start = time.perf_counter()
        page.keyboard.press(key)
        page.wait_for_function("(b) => [...document.querySelectorAll('.widget-html-content')].some(e => "
                               "e.innerText.includes('effective choices') && e.innerText !== b)", arg=before,
                               timeout=10_000)
        ms = (time.perf_counter() - start) * 1000
        after = page.locator(".jp-OutputArea .widget-html-content:has-text('effective choices')").first.inner_text()
        results[label] = {"changed": after != before, "ms": ms, "before": before[:120], "after": after[:120]}
    del slider
    return results


def check_attention(page) -> dict:
    results = {}
    for label in ["layer", "head"]:
        handle = page.locator(f".jp-OutputArea .widget-slider:has(.widget-label:text-is('{label}')) .noUi-handle").first
        handle.focus()
        caption = page.locator(".jp-OutputArea .widget-html-content caption").first
        before = caption.inner_text()
        start = time.perf_counter()
        page.keyboard.press("ArrowRight")
        page.wait_for_function("(b) => { const c = document.querySelector('.jp-OutputArea .widget-html-content caption');"
                               " return c && c.innerText !== b; }", arg=before, timeout=10_000)
        ms = (time.perf_counter() - start) * 1000
        results[label] = {"changed": caption.inner_text() != before, "ms": ms, "before": before, "after": caption.inner_text()}
    return results


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
    return {"typing": {"changed": after != before, "ms": ms, "before": before[:80], "after": after[:80]}}


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
