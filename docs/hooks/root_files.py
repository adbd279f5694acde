"""MkDocs hook: a page whose front matter names `root_file` shows that file of the repository's
root (BENCHMARKS.md, CHANGELOG.md, CONTRIBUTING.md, LICENSE), so each is written once, where
GitHub shows it, and read on the site too. Its links are written from the root: a link into
docs/ or to another root file with a page becomes the page's link; a link to anything else (a
source file, a test) keeps its text, since the site does not carry the source."""

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Root files with a page on the site, by the docs/ path of that page.
PAGES = {
    "README.md": "index.md",
    "SECURITY.md": "security.md",
    "BENCHMARKS.md": "development/benchmarks.md",
    "CONTRIBUTING.md": "development/contributing.md",
    "CHANGELOG.md": "development/changelog.md",
    "LICENSE": "license.md",
}
INLINE = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)((?:\s+\"[^\"]*\")?)\)")
REFERENCE = re.compile(r"^(\s*\[[^\]]+\]:\s*)(\S+)(.*)$", re.M)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#|/)", re.I)


def target_from(page_path: str, target: str) -> str | None:
    """A root-relative link as the page at page_path must write it, or None: no page."""
    path, hash_, anchor = target.partition("#")
    path = posixpath.normpath(path)
    if path == "docs" or path.startswith("docs/"):
        doc = path.removeprefix("docs").lstrip("/")
        if not doc.endswith(".md"):  # a folder: its index page
            doc = posixpath.join(doc, "index.md") if doc else "index.md"
    elif path in PAGES:
        doc = PAGES[path]
    else:
        return None
    relative = posixpath.relpath(doc, posixpath.dirname(page_path) or ".")
    return relative + hash_ + anchor


def rewrite(markdown: str, page_path: str) -> str:
    def inline(match: re.Match) -> str:
        bang, text, target, title = match.groups()
        if EXTERNAL.match(target):
            return match.group(0)
        new = target_from(page_path, target)
        if new is None:
            return text if not bang else ""
        return f"{bang}[{text}]({new}{title})"

    def reference(match: re.Match) -> str:
        head, target, tail = match.groups()
        if EXTERNAL.match(target):
            return match.group(0)
        new = target_from(page_path, target)
        return f"{head}{new}{tail}" if new is not None else ""

    return REFERENCE.sub(reference, INLINE.sub(inline, markdown))


def on_page_markdown(markdown: str, page, config, files) -> str:
    name = page.meta.get("root_file")
    if not name:
        return markdown
    source = ROOT / name
    if not source.is_file():
        raise FileNotFoundError(f"{page.file.src_uri} shows {name}, which is not there")
    text = source.read_text()
    if not name.endswith(".md"):
        title = page.meta.get("title", name)
        return f"# {title}\n\n```text\n{text}```\n"
    return markdown + "\n" + rewrite(text, page.file.src_uri)
