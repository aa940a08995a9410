"""The README is a short front door and the docs/ site builds with every link intact.

* The site builds with mkdocs in strict mode (``mkdocs.yml`` turns a missing page, link
  or anchor into a warning, strict mode into an error): the link check of docs/.
* Every relative link of README.md (a file, or ``page.md#anchor`` into a page of docs/)
  resolves. An anchor must be a heading id under both mkdocs' rule (Python-Markdown's
  ``toc``) and GitHub's, so the link works on the site and on GitHub alike.
* README.md stays at most 300 lines.

The ```python blocks of README.md and docs/ are run by ``tests/test_readme.py``.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 300

_FENCED = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced blocks and code spans (links inside code are not links)."""
    return _CODE_SPAN.sub("", _FENCED.sub("", text))


def links(text: str) -> list[str]:
    """Targets of the markdown links and images of ``text``, outside code."""
    return _LINK.findall(prose(text))


def heading_texts(text: str) -> list[str]:
    """The rendered text of every heading outside fenced blocks (code marks and links dropped)."""
    out = []
    for m in _HEADING.finditer(_FENCED.sub("", text)):
        t = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2))
        out.append(t.replace("`", "").replace("*", ""))
    return out


def toc_slug(heading: str) -> str:
    """Python-Markdown's ``toc`` slugify (what mkdocs uses for heading ids)."""
    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def github_slug(heading: str) -> str:
    """GitHub's heading id: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str, slug, repeat: str) -> set[str]:
    """Heading ids of a page under one slug rule; repeats get ``{repeat}1``, ``{repeat}2``..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in heading_texts(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}{repeat}{n}")
    return out


def broken_links(page: pathlib.Path) -> list[str]:
    """Relative links of ``page`` whose file or anchor does not exist, with the reason."""
    bad = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
            continue
        if anchor:
            text = dest.read_text()
            for rule, slug, repeat in (("mkdocs", toc_slug, "_"), ("GitHub", github_slug, "-")):
                if anchor not in anchors(text, slug, repeat):
                    bad.append(f"{target}: no heading of {dest.name} has the id #{anchor} under {rule}'s rule")
    return bad


def test_slugs_and_links_helpers():
    assert toc_slug("torch.compile") == github_slug("torch.compile") == "torchcompile"
    assert toc_slug("Against PyTorch's own NJT tests") == "against-pytorchs-own-njt-tests"
    assert toc_slug("Images & CNNs") == "images-cnns" != github_slug("Images & CNNs")
    assert heading_texts("# A `b`\n```\n# not a heading\n```\n## [C](x.md)\n") == ["A b", "C"]
    assert links("[a](x.md) `[b](y.md)` ![c](z.png)\n```\n[d](w.md)\n```\n") == ["x.md", "z.png"]
    assert links("see [a\nb](x.md#c) and [d] e") == ["x.md#c"]
    assert anchors("## A\n## A\n", toc_slug, "_") == {"a", "a_1"}


def test_site_builds_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it is in the [dev] extra): the docs/ link check did not run")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    assert (tmp_path / "site" / "index.html").exists()


def test_readme_links_resolve():
    assert links(README.read_text()), "README.md links to no page"
    assert broken_links(README) == []


def test_readme_links_every_docs_page():
    linked = {t.partition("#")[0] for t in links(README.read_text())}
    pages = {f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))}
    assert pages - linked == set(), "README.md's documentation table misses these pages"


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail into docs/"


def test_committed_op_table_is_current():
    """``docs/ops.md`` is what ``python -m padless.ops --markdown`` prints, so ``make docs``
    leaves a fresh clone unchanged; regenerate it with that command when this fails."""
    out = subprocess.run([sys.executable, "-m", "padless.ops", "--markdown"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    committed = (ROOT / "docs" / "ops.md").read_text()
    assert out == committed, "docs/ops.md is out of date: run `python -m padless.ops --markdown > docs/ops.md`"
