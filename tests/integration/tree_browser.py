"""A tree page (stages/rl/tree_page.py) in a real headless browser: Debian's chromium driven by playwright (no
browser download, no network). Shared by the page test and the runs that write pages (tiny chain, verl on CPU)."""

from __future__ import annotations

import io
from pathlib import Path

from tests.conftest import missing_setup, require_chromium

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
MODEL_BLUE = (0x4A, 0x7F, 0xD0)   # a generated segment's bar (tree_page.CSS .model)


def near(pixel: tuple[int, ...], color: tuple[int, int, int], tol: int = 12) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(pixel[:3], color))


def check_tree_page(page: Path, shot: Path) -> dict:
    """Open `page` from disk, screenshot it to `shot`, click the first generated segment; returns what the page
    showed: console errors, the SVG drawings and bars, the blue pixels of the screenshot, the opened detail's text."""
    require_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing_setup("playwright is not installed: ./scripts/setup.sh installs the test extras (pyproject.toml)")
    from PIL import Image

    errors: list[str] = []
    with sync_playwright() as driver:   # a new, empty profile per launch
        browser = driver.chromium.launch(executable_path=require_chromium(), headless=True, args=FLAGS)
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(page.resolve().as_uri())
            tab.screenshot(path=str(shot))
            bar = tab.locator("rect.model[data-detail]").first
            target = bar.get_attribute("data-detail")
            hidden_before = tab.locator(f"#{target}").is_hidden()
            bar.click()
            detail = tab.locator(f"#{target}")
            shown = {"trees": tab.locator("svg.tree").count(), "bars": tab.locator("rect[data-detail]").count(),
                     "forks": tab.locator("circle.fork").count(), "hidden_before": hidden_before,
                     "visible_after": detail.is_visible(), "detail_text": detail.inner_text()}
        finally:
            browser.close()
    image = Image.open(io.BytesIO(shot.read_bytes())).convert("RGB")
    shown["blue_pixels"] = sum(near(p, MODEL_BLUE) for p in image.getdata())
    shown["errors"] = errors
    return shown
