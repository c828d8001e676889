"""Open a handover bundle's index.html from disk in headless Chromium, check what a reader gets,
and save a full-page screenshot.

    python scripts/screenshot_bundle.py handover/local --png docs/bundle.png [--json report.json]

The checks: every link (``<a href>``) leads to a file inside the bundle or to a heading of the
page, every image loaded (``naturalWidth > 0``), the browser logged no error, and every request the
page made was for a file inside the bundle (no server, no external URL). The report (``--json``)
lists the links, images, requests, console errors and problems, and the page's text; the exit
status is 1 when there is a problem (each one on stderr), after the screenshot and the report are
written. tests/test_bundle.py runs it on a real cluster's bundle; after ``./scripts/quickstart.sh``
the command above regenerates the README's screenshot.

It drives the system Chromium (Debian's ``chromium``, which scripts/test.sh installs) through
playwright's DevTools driver, which the ``test`` extra installs: no browser is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from playwright.sync_api import sync_playwright

#: The page's width in CSS pixels (the screenshot's width); its height is the whole page.
WIDTH = 1280

_INSPECT = """() => ({
  links: [...document.querySelectorAll("a[href]")].map(a => ({href: a.getAttribute("href"), url: a.href})),
  ids: [...document.querySelectorAll("[id]")].map(e => e.id),
  images: [...document.images].map(i => ({src: i.getAttribute("src"), natural_width: i.naturalWidth})),
  text: document.body.innerText,
})"""


def inside(url: str, root: Path) -> str | None:
    """The path, relative to ``root``, of the existing file a ``file://`` URL names; None otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "file":
        return None
    path = Path(unquote(parts.path)).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) and path.is_file() else None


def inspect(bundle: Path, png: Path, *, chromium: str) -> dict[str, Any]:
    """Open ``bundle``/index.html, save the screenshot to ``png``, and report what the page did."""
    root = bundle.resolve()
    console: list[str] = []
    requests: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console.append(f"uncaught: {e}"))
            page.on("request", lambda r: requests.append(r.url))
            page.on("requestfailed", lambda r: console.append(f"failed to load {r.url}: {r.failure}"))
            page.goto((root / "index.html").as_uri(), wait_until="load")
            seen: dict[str, Any] = page.evaluate(_INSPECT)
            png.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=png, full_page=True)
        finally:
            browser.close()
    ids = set(seen["ids"])
    links = [
        link | {"target": link["href"] if link["href"].startswith("#") else inside(link["url"], root)}
        for link in seen["links"]
    ]
    problems = [f"link {link['href']!r} leads to no file of the bundle" for link in links if link["target"] is None]
    hrefs = [link["href"] for link in links]
    problems += [f"link {href!r} names no id of the page" for href in hrefs if href[:1] == "#" and href[1:] not in ids]
    problems += [f"image {image['src']!r} did not load" for image in seen["images"] if image["natural_width"] <= 0]
    problems += [f"request outside the bundle: {url}" for url in requests if inside(url, root) is None]
    problems += [f"console error: {text}" for text in console]
    return {
        "links": links,
        "images": seen["images"],
        "requests": [inside(url, root) or url for url in requests],
        "console_errors": console,
        "problems": problems,
        "text": seen["text"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path, help="the bundle's directory (holds index.html)")
    parser.add_argument("--png", type=Path, required=True, help="where to write the full-page screenshot")
    parser.add_argument("--json", type=Path, help="where to write the report")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium", help="the browser")
    args = parser.parse_args()
    if not (args.bundle / "index.html").is_file():
        parser.error(f"{args.bundle}: no index.html (write a bundle with `infractl bundle`)")
    if not Path(args.chromium).is_file():
        parser.error(f"no Chromium at {args.chromium}: `apt-get install chromium` (scripts/test.sh installs it)")
    report = inspect(args.bundle, args.png, chromium=args.chromium)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    for problem in report["problems"]:
        print(f"screenshot_bundle: {problem}", file=sys.stderr)
    counts = {key: len(report[key]) for key in ("links", "images", "problems")}
    print(f"{args.png}: " + ", ".join(f"{n} {key}" for key, n in counts.items()))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
