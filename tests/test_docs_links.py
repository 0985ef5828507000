"""README.md and docs/: every relative Markdown link resolves, and the front page stays short.

For each `[text](target)` and `![alt](target)` outside code (fenced blocks and inline code
spans are skipped) whose target is relative (no scheme such as https: or mailto:), the file
or folder must exist relative to the Markdown file; a `#fragment` on a Markdown target (or
a link that is only `#fragment`) must name a heading of that file, slugged as GitHub does.
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKDOWN = [README] + sorted((ROOT / "docs").glob("**/*.md"))
README_MAX_LINES = 220

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1)(?:[^\n]|\n(?![ \t]*\n)))+?\1")   # not across a blank line
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text):
  """(line number, line) outside fenced code blocks, inline code spans blanked out.

  A code span may run over a line break, so spans are removed from the whole text at once,
  each replaced by as many newlines as it held (line numbers stay right).
  """
  lines, inside = [], False
  for line in text.splitlines():
    if _FENCE.match(line):
      inside = not inside
      lines.append("")
    else:
      lines.append("" if inside else line)
  prose = _INLINE_CODE.sub(lambda m: "\n" * m.group(0).count("\n"), "\n".join(lines))
  return enumerate(prose.split("\n"), 1)


def _slug(heading):
  """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
  heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link keeps its text
  heading = heading.replace("`", "").strip().lower()
  heading = "".join(c for c in heading if c.isalnum() or c in " -_")
  return heading.replace(" ", "-")


def _anchors(path):
  seen, anchors = {}, set()
  for _, line in _prose_lines(path.read_text(encoding="utf-8")):
    match = _HEADING.match(line)
    if not match:
      continue
    slug = _slug(match.group(2))
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    anchors.add(slug if n == 0 else f"{slug}-{n}")
  return anchors


def _links(path):
  for number, line in _prose_lines(path.read_text(encoding="utf-8")):
    for target in _LINK.findall(line):
      yield number, target


def _problems(path, root=ROOT):
  problems = []
  for number, target in _links(path):
    if not target or _SCHEME.match(target):
      continue
    file_part, _, fragment = target.partition("#")
    resolved = (path.parent / file_part).resolve() if file_part else path
    where = f"{path.relative_to(root)}:{number}: {target}"
    if not resolved.exists():
      problems.append(f"{where}: no such file or folder")
      continue
    if fragment and resolved.suffix == ".md" and fragment.lower() not in _anchors(resolved):
      problems.append(f"{where}: no heading with anchor #{fragment}")
  return problems


@pytest.mark.parametrize("path", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_relative_links_resolve(path):
  problems = _problems(path)
  assert not problems, "\n".join(problems)


def test_docs_folder_has_pages():
  assert len(MARKDOWN) > 1, "docs/*.md: no pages found"


def test_readme_is_a_front_page():
  lines = README.read_text(encoding="utf-8").count("\n")
  assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_checker_finds_a_broken_link(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("# A title\n\n[ok](#a-title) [missing](nowhere.md) [bad anchor](#nope)\n"
                  "`[in code](nowhere.md)` [web](https://example.com) ``a span\n"
                  "[over lines](nowhere.md)``\n\n```\n[fenced](nowhere.md)\n```\n", encoding="utf-8")
  problems = _problems(page, root=tmp_path)
  assert [p.split(": ", 1)[1] for p in problems] == ["nowhere.md: no such file or folder",
                                                     "#nope: no heading with anchor #nope"]
