"""The built docs site renders its maths in a real browser, offline.

The site is built with `mkdocs build --strict`, served on 127.0.0.1, and every page that holds
maths is loaded in Qt WebEngine (Chromium, from the `PyQt6-WebEngine` wheel of the `test`
extra) with every request off this machine blocked. After MathJax has typeset the page, the
rendered DOM must hold a MathJax element for every formula, no TeX error, no TeX source left in
its visible text, and the page must have loaded nothing from the network and hit no missing
file. Run it alone with `python -m pytest tests/test_docs_render.py`.

Run as a script (`python tests/test_docs_render.py SITE_DIR PAGE...`), this file is the
renderer: it prints one JSON report per page. The test runs it in a subprocess, so Qt and
Chromium stay out of the pytest process.
"""

import http.server
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time


ROOT = pathlib.Path(__file__).resolve().parent.parent
# Pages whose maths the brief names explicitly; every other page with maths is checked too.
REQUIRED_PAGES = ["guides/concepts/index.html", "api/s3req/index.html"]
# TeX delimiters that MathJax removes when it typesets; visible text keeps none of them.
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|(?<![\w$])\$[^\s$][^$\n]*\$(?![\w$])")
PAGE_TIMEOUT_S = 15.0

# Runs in the page once MathJax is done: what a reader would see.
REPORT_JS = r"""
(() => {
  const content = document.querySelector(".md-content") || document.body;
  const math = [...content.querySelectorAll(".arithmatex")];
  const texts = [];
  const walker = document.createTreeWalker(content, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const el = n.parentElement;
    if (el.closest("pre, code, script, style, mjx-assistive-mml")) continue;
    if (el.getClientRects().length === 0) continue;  // not laid out: invisible
    texts.push(n.textContent);
  }
  return JSON.stringify({
    formulas: math.length,
    rendered: math.filter(e => e.querySelector("mjx-container")).length,
    unrendered: math.filter(e => !e.querySelector("mjx-container"))
                    .map(e => e.textContent.slice(0, 120)),
    tex_errors: [...content.querySelectorAll("mjx-merror")]
                    .map(e => e.getAttribute("data-mjx-error") || e.textContent),
    text: texts.join(""),
  });
})()
"""

# Waits for MathJax: its startup promise, then whatever typesetting was queued after it.
WAIT_JS = r"""
(() => {
  if (window.__mj_state === undefined) {
    window.__mj_state = "waiting";
    const settle = (p) => p.then(() => {
      if (MathJax.startup.promise !== p) return settle(MathJax.startup.promise);
      window.__mj_state = "done";
    }, (e) => { window.__mj_state = "failed: " + e; });
    const poll = () => (window.MathJax && MathJax.startup && MathJax.startup.promise)
        ? settle(MathJax.startup.promise) : setTimeout(poll, 20);
    poll();
  }
  return window.__mj_state;
})()
"""


def _serve(site: pathlib.Path, misses: list[str]) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            kwargs["directory"] = str(site)
            http.server.SimpleHTTPRequestHandler.__init__(self, *args, **kwargs)

        def log_request(self, code="-", size="-"):
            if int(code) >= 400:
                misses.append(f"{code} {self.path}")

        def log_message(self, format, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def render(site: pathlib.Path, pages: list[str]) -> list[dict]:
    """Load each page in Qt WebEngine, offline, and report what its DOM shows after MathJax."""
    from PyQt6.QtCore import QTimer, QUrl
    from PyQt6.QtWebEngineCore import (
        QWebEnginePage,
        QWebEngineProfile,
        QWebEngineUrlRequestInterceptor,
    )
    from PyQt6.QtWidgets import QApplication

    misses: list[str] = []
    server = _serve(site, misses)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    app = QApplication([sys.argv[0]])

    class Offline(QWebEngineUrlRequestInterceptor):
        """Blocks (and records) every request that is not to the local server."""

        def __init__(self):
            QWebEngineUrlRequestInterceptor.__init__(self)
            self.blocked: list[str] = []

        def interceptRequest(self, info):
            url = info.requestUrl().toString()
            if not url.startswith(base) and info.requestUrl().scheme() not in ("data", "blob"):
                self.blocked.append(url)
                info.block(True)

    class Page(QWebEnginePage):
        """Records the console's warnings and errors."""

        def __init__(self, profile):
            QWebEnginePage.__init__(self, profile)
            self.console: list[str] = []

        def javaScriptConsoleMessage(self, level, message, lineNumber, sourceID):
            if level != QWebEnginePage.JavaScriptConsoleMessageLevel.InfoMessageLevel:
                self.console.append(f"{sourceID}:{lineNumber}: {message}")

    profile = QWebEngineProfile()  # off the record: no cache carried between runs
    interceptor = Offline()
    profile.setUrlRequestInterceptor(interceptor)
    reports: list[dict] = []
    todo = list(pages)
    state: dict = {}

    def finish(report: dict) -> None:
        report.update(
            page=state["name"],
            seconds=round(time.monotonic() - state["t0"], 2),
            console=state["page"].console,
            blocked=interceptor.blocked[state["blocked0"] :],
            http_errors=misses[state["misses0"] :],
        )
        reports.append(report)
        if "error" in report:
            todo.clear()  # MathJax broken: one report says why, no need to wait on every page
        QTimer.singleShot(0, start_next)

    def poll() -> None:
        if time.monotonic() - state["t0"] > PAGE_TIMEOUT_S:
            error = {"error": f"MathJax not done after {PAGE_TIMEOUT_S} s"}
            state["page"].runJavaScript(REPORT_JS, lambda r: finish(error | json.loads(r)))
            return

        def on_state(value) -> None:
            if value == "done":
                state["page"].runJavaScript(REPORT_JS, lambda r: finish(json.loads(r)))
            elif isinstance(value, str) and value.startswith("failed"):
                finish({"error": value})
            else:
                QTimer.singleShot(25, poll)

        state["page"].runJavaScript(WAIT_JS, on_state)

    def start_next() -> None:
        if "page" in state:
            state["page"].deleteLater()  # pages go before their profile
        if not todo:
            QTimer.singleShot(0, app.quit)
            return
        name = todo.pop(0)
        page = Page(profile)
        state.update(
            name=name,
            page=page,
            t0=time.monotonic(),
            blocked0=len(interceptor.blocked),
            misses0=len(misses),
        )

        def loaded(ok: bool) -> None:
            if ok:
                poll()
            else:
                finish({"error": "page failed to load"})

        page.loadFinished.connect(loaded)
        page.load(QUrl(base + name))

    QTimer.singleShot(0, start_next)
    app.exec()
    server.shutdown()
    return reports


def _browser_missing() -> str | None:
    """Why no browser can run here, or None when Qt WebEngine imports."""
    env = _browser_env()
    probe = subprocess.run(
        [sys.executable, "-c", "import PyQt6.QtWebEngineCore, PyQt6.QtWidgets"],
        env=env,
        capture_output=True,
        text=True,
    )
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["?"])[-1]
    return f'Qt WebEngine unavailable ({last}); pip install -e ".[test]" installs it'


def _browser_env() -> dict:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", NO_MKDOCS_2_WARNING="1")
    # Chromium's sandbox refuses to run as root (as CI does); the pages are our own.
    env["QTWEBENGINE_CHROMIUM_FLAGS"] = "--no-sandbox --disable-gpu --log-level=3"
    env.setdefault("QT_LOGGING_RULES", "*.debug=false;qt.qpa.*=false;qt.rhi.*=false")
    return env


def test_maths_renders_offline_in_a_browser(tmp_path):
    import pytest

    if shutil.which("mkdocs") is None:
        pytest.skip("docs extra not installed (mkdocs missing)")
    reason = _browser_missing()
    if reason is not None:
        pytest.skip(reason)
    site = tmp_path / "site"
    env = _browser_env()
    t0 = time.monotonic()
    build = subprocess.run(
        ["mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    t_build = time.monotonic() - t0
    assert not list(site.rglob("*.py")), "the MathJax hook must not be published"

    # Every page: those with maths must render it, and no page may show TeX source.
    pages = sorted(str(p.relative_to(site)) for p in site.rglob("*.html") if p.name != "404.html")
    pages = REQUIRED_PAGES + [p for p in pages if p not in REQUIRED_PAGES]
    with_maths = {p for p in pages if 'class="arithmatex"' in (site / p).read_text("utf-8")}
    assert set(REQUIRED_PAGES) <= with_maths, sorted(with_maths)

    out = subprocess.run(
        [sys.executable, __file__, str(site), *pages],
        env=env,
        capture_output=True,
        text=True,
        timeout=60 + PAGE_TIMEOUT_S * len(pages),
    )
    t_render = time.monotonic() - t0 - t_build
    assert out.returncode == 0, out.stderr[-4000:]
    reports = json.loads(out.stdout)
    assert [r["page"] for r in reports] == pages[: len(reports)]
    print(f"build {t_build:.1f} s, render {len(pages)} pages {t_render:.1f} s")
    for r in reports:
        where = r["page"]
        assert "error" not in r, (where, r)
        assert r["blocked"] == [], (where, "requests off the machine", r["blocked"])
        assert r["http_errors"] == [], (where, "missing files", r["http_errors"])
        assert r["console"] == [], (where, "console", r["console"])
        assert r["tex_errors"] == [], (where, "TeX errors", r["tex_errors"])
        assert r["unrendered"] == [], (where, "formulas MathJax did not typeset", r["unrendered"])
        assert r["rendered"] == r["formulas"]
        leftover = [m.group() for m in RAW_TEX.finditer(r["text"])]
        assert leftover == [], (where, "TeX source visible", leftover[:10])
        assert (r["formulas"] > 0) == (where in with_maths), where
    assert len(reports) == len(pages)


if __name__ == "__main__":
    print(json.dumps(render(pathlib.Path(sys.argv[1]), sys.argv[2:]), indent=1))
