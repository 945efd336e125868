"""The documentation keeps up with the code: every public name of `aaccl` is in the
API reference (docs/reference.md, rendered by mkdocstrings), with every public method
of the classes whose members it lists; the pages the site builds are in its nav; no
page cites a file the repository does not have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import aaccl

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = (ROOT / "docs" / "reference.md").read_text()

UNLISTED = {
    ("ACCL", "open"): "the constructor behind open_world, from a configured Driver",
    ("Call", "owner"): "an attribute: the ACCL that made the call",
    **{("Call", name): "the device's outcome, an attribute (the class docstring says so)"
       for name in ("args", "retcode", "aborted", "error", "detail", "started", "ended")},
    ("Kernel", "name"): "an attribute, given to ACCL.kernel",
}
"""Public members the reference leaves out on purpose, and why."""


def directive(name: str) -> str:
    return f"::: aaccl.{name}\n"


@pytest.mark.parametrize("name", aaccl.__all__)
def test_every_public_name_is_in_the_reference(name: str) -> None:
    assert directive(name) in REFERENCE, f"docs/reference.md has no '::: aaccl.{name}'"


def listed_members(name: str) -> list[str] | None:
    """The members the reference lists for `aaccl.NAME` (None: it lists none)."""
    block = REFERENCE.split(directive(name), 1)[1].split(":::", 1)[0]
    inline = re.search(r"members: \[([^\]]*)\]", block)
    if inline:
        return [m.strip().strip("'\"") for m in inline.group(1).split(",") if m.strip()]
    if re.search(r"^\s+members:\s*$", block, re.M):
        return re.findall(r"^\s+- (\w+)\s*$", block, re.M)
    return None


@pytest.mark.parametrize("name", ["ACCL", "Call", "Buffer", "Kernel"])
def test_the_reference_lists_every_public_method(name: str) -> None:
    cls = getattr(aaccl, name)
    listed = listed_members(name)
    assert listed is not None, f"the reference lists no members of {name}"
    public = [m for m in vars(cls) if not m.startswith("_") and (name, m) not in UNLISTED]
    assert sorted(set(public) - set(listed)) == []
    assert sorted(set(listed) - set(dir(cls))) == []  # nor any that is gone


def test_no_page_cites_design_md() -> None:
    """DESIGN.md is the project's design brief, kept outside the repository: pages
    cite what the repository has (benchmarks/README.md for the targets)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             ROOT / "benchmarks" / "README.md"]
    citing = [str(p.relative_to(ROOT)) for p in pages if "DESIGN.md" in p.read_text()]
    assert citing == []


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [str(p.relative_to(ROOT / "docs")) for p in sorted((ROOT / "docs").rglob("*.md"))]
    assert [p for p in pages if f" {p}\n" not in nav] == []
