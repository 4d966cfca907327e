"""The playground page in headless Chromium: type a prompt, watch text stream in with a
tokens/s figure, and keep a screenshot as an artifact."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from monokernel import envs
from monokernel.serve.testing import SlowBackend

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def find_chromium() -> str | None:
    candidates = [envs.MONOKERNEL_CHROMIUM, "/usr/bin/chromium"]
    candidates += [shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")]
    return next((c for c in candidates if c and Path(c).is_file()), None)


def save_artifact(source: Path) -> None:
    folder = envs.MONOKERNEL_ARTIFACTS
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(source, Path(folder) / source.name)


def test_playground_streams_text_and_speed(
    base_url: str, slow: SlowBackend, tmp_path: Path
) -> None:
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium binary found (apt-get install chromium, or $MONOKERNEL_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    slow.delay_s = 0.03  # 60 tokens take ~2 s: long enough to watch them arrive
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 760})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(base_url + "/")
            page.wait_for_function("document.getElementById('health').textContent === 'ready'")
            page.wait_for_function("document.getElementById('model').textContent !== '…'")
            page.fill("#max_tokens", "60")
            page.fill("#temperature", "0")
            page.fill("#system", "You are a helpful coding assistant.")
            page.click("#prompt")
            page.keyboard.type("Write a Python function that reverses a string.")
            page.click("#send")

            # Mid-stream: text on the page, a live tokens/s, and the request still running.
            page.wait_for_function(
                """() => {
                    const text = document.querySelector('.msg.assistant span:last-child');
                    const tps = parseFloat(document.getElementById('tps').textContent);
                    return text && text.textContent.length > 0 && tps > 0
                        && !document.getElementById('stop').disabled;
                }""",
                timeout=10_000,
            )
            streaming = tmp_path / "playground-streaming.png"
            page.screenshot(path=str(streaming))
            partial = page.inner_text(".msg.assistant span:last-child")

            page.wait_for_function(
                "document.getElementById('finish').textContent.startsWith('finish:')",
                timeout=20_000,
            )
            final = page.inner_text(".msg.assistant span:last-child")
            figures = {k: page.inner_text(f"#{k}") for k in ("tps", "ttft", "ntok", "nprompt")}
            shot = tmp_path / "playground.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    for path in (streaming, shot):
        save_artifact(path)
    assert not errors, errors
    assert final.startswith(partial) and len(final) > len(partial)
    # The server's own timings replace the live estimate when the stream ends.
    assert float(figures["tps"]) > 0 and float(figures["ttft"]) > 0, figures
    assert int(figures["ntok"]) == 60 and int(figures["nprompt"]) > 10, figures
    assert shot.stat().st_size > 10_000
