"""The documents name only things that exist.

Checked in README.md and docs/*.md:

* every repository path written in an inline code span (`like/this.py`) exists;
* every dotted reference written in a code span or a fenced code block that starts with ``autosplit.``
  (`autosplit.parallelize`, `autosplit.cost_model.fit_to_model`, `autosplit.MeshShape.parse`) resolves:
  the longest importable prefix is imported and the rest is looked up with getattr
  (``autosplit.passes`` and ``autosplit.cost_model`` are the top-level passes/ and cost_model/ folders,
  installed under those names);
* every relative markdown link (`[design](design.md)`, `[search](design.md#strategy-search)`) points at
  a file that exists, relative to the document, and at a heading that file has.

What counts as a path (inline code spans only: fenced blocks hold shell sessions and program output,
full of paths the commands create).  A span is split on white space; a token, stripped of the
punctuation around it, is a path when it

* contains a '/',
* is not a URL (no '://') and not a home- or absolute path ('~', '/'),
* ends in a file extension from ``EXTENSIONS`` or in '/' (a folder),
* and is not a placeholder: no segment holds '{', '<', '*', '$' or '...', and no segment is an
  upper-case word (`DIR/report.html`, `PATH/...`).

A path resolves from the repository root, or from ``autosplit/`` (design.md writes `runtime/...` and
`schedule/...` for the folders inside the package).  Method references such as `plan.summary()` or
`pm.step` are not module references and are not checked.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

EXTENSIONS = (".py", ".md", ".json", ".html", ".txt", ".toml", ".cfg", ".dot", ".svg", ".js", ".css",
              ".yaml", ".yml", ".sh", ".pt")
RESOLVE_FROM = ("", "autosplit/")

# Paths the documented commands write; they are output, not part of the repository, so they cannot be
# required to exist.  Why an explicit list: any other missing path is a broken reference.
GENERATED = ("plan_out/", "plan_vit_b/", "ckpt/", "report_hybrid/", "report_gpu/", "data/", "bench_out/")
# Files in other projects' repositories (torch's DTensor, meta-pytorch/autoparallel) that design.md cites
# as prior art; they are not in this repository.
EXTERNAL = ("torch/", "autoparallel/")

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_DOTTED = re.compile(r"(?<![\w./\-])autosplit(?:\.[A-Za-z_]\w*)+")
_UPPER_WORD = re.compile(r"^[A-Z][A-Z0-9_]+$")
_STRIP = "()[],;:'\"!?"


def _fences_and_prose(text: str) -> tuple[list[str], str]:
    fences = [m.group(0) for m in _FENCE.finditer(text)]
    return fences, _FENCE.sub("\n", text)


def inline_spans(text: str) -> list[str]:
    return [m.group(2) for m in _SPAN.finditer(_fences_and_prose(text)[1])]


def is_path(token: str) -> bool:
    if "/" not in token or "://" in token or token.startswith(("~", "/")):
        return False
    if not (token.endswith("/") or token.endswith(EXTENSIONS)):
        return False
    for seg in token.rstrip("/").split("/"):
        if not seg or any(c in seg for c in "{<*$") or "..." in seg or _UPPER_WORD.match(seg):
            return False
    return True


def paths_in(text: str) -> list[str]:
    out = []
    for span in inline_spans(text):
        for token in span.split():
            token = token.strip(_STRIP).rstrip(".")  # a sentence's full stop is not part of a path
            if token and is_path(token):
                out.append(token)
    return out


def dotted_in(text: str) -> list[str]:
    fences, _ = _fences_and_prose(text)
    out = []
    for chunk in [*inline_spans(text), *fences]:
        for ref in _DOTTED.findall(chunk):
            if ref.endswith(tuple(ext for ext in EXTENSIONS)) and ref.count(".") == 1:
                continue                               # a file name such as autosplit.json
            out.append(ref)
    return out


def links_in(text: str) -> list[str]:
    """Relative link targets, with their '#anchor' if any ('#anchor' alone: this document)."""
    prose = _fences_and_prose(text)[1]
    return [t for t in _LINK.findall(prose) if "://" not in t and not t.startswith("mailto:")]


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation other than '-' and '_' dropped, spaces to '-',
    a repeated id suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+?)[ \t]*$", _fences_and_prose(text)[1], re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


def link_ok(target: str, where: Path, text: str) -> bool:
    file, _, anchor = target.partition("#")
    path = where.parent / file if file else where
    if not path.exists():
        return False
    if not anchor:
        return True
    return anchor in anchors(text if not file else path.read_text() if path.is_file() else "")


def path_exists(path: str, root: Path = ROOT) -> bool:
    if path.startswith(GENERATED + EXTERNAL):
        return True
    return any((root / base / path).exists() for base in RESOLVE_FROM)


def resolves(ref: str) -> bool:
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:   # not a module: look the name up on a shorter prefix
            if e.name is not None and module.startswith(e.name):
                continue
            raise                          # a module that exists but fails to import: show why
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def broken(text: str, where: Path = ROOT / "README.md", root: Path = ROOT) -> list[str]:
    """Every broken reference in one document's text: 'path X', 'name X' or 'link X'."""
    bad = [f"path {p}" for p in paths_in(text) if not path_exists(p, root)]
    bad += [f"name {r}" for r in dict.fromkeys(dotted_in(text)) if not resolves(r)]
    bad += [f"link {t}" for t in links_in(text) if not link_ok(t, where, text)]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_references_resolve(doc):
    text = doc.read_text()
    assert paths_in(text) or dotted_in(text) or doc.name == "README.md", "nothing checked: the parser is broken"
    assert broken(text, where=doc) == []


def test_docs_index_lists_every_doc():
    index = (ROOT / "docs" / "README.md").read_text()
    for doc in DOCS:
        if doc.parent.name == "docs" and doc.name != "README.md":
            assert f"({doc.name})" in index, f"docs/README.md does not link {doc.name}"


def test_checker_finds_broken_names_and_paths():
    text = """
A real path `autosplit/runtime/parallel/fsdp.py`, one from the package root `runtime/stage/params.py`,
a folder `autosplit/report/`, a real name `autosplit.parallelize` and `autosplit.cost_model.fit_to_model`,
a method `plan.summary()`, a URL `https://example.com/a.py`, placeholders `DIR/report.html` and
`pp{r}_tp{t}/stage{s}.py`, generated output `plan_out/summary.txt`, a file `autosplit.json`.
Broken: `autosplit/runtime/no_such_file.py` and `autosplit.no_such_name`, `autosplit.MeshShape.nope`.

```python
pm = autosplit.parallelise(model)        # misspelled
```
See [the design](design.md), [its runtime](design.md#runtime-autosplitruntime), [nothing](no_such_doc.md),
[no such heading](design.md#no-such-heading) and [here](#nowhere).
"""
    assert broken(text, where=ROOT / "docs" / "README.md") == [
        "path autosplit/runtime/no_such_file.py",
        "name autosplit.no_such_name", "name autosplit.MeshShape.nope", "name autosplit.parallelise",
        "link no_such_doc.md", "link design.md#no-such-heading", "link #nowhere"]
