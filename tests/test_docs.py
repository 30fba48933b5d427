"""The docs cannot drift: the config reference is generated from the models and must match them,
every relative link in the README and docs/ resolves to a file (and its #anchor to a heading or an
explicit anchor there), and the README stays a two-minute read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.config_reference import render_reference

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "jobs" / "README.md",
         ROOT / "jobs" / "models" / "README.md", ROOT / "bench" / "README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def test_config_reference_is_generated_from_the_models():
    """docs/config.md is exactly what `eft config --reference` prints; regenerate it with
    `.venv/bin/eft config --reference > docs/config.md` after changing app/config.py."""
    assert (ROOT / "docs" / "config.md").read_text() == render_reference()


def test_every_config_key_is_described():
    from app.config import JobConfig
    from app.config_reference import section_models

    for key, model in section_models(JobConfig):
        assert model.__doc__, f"section {key or 'top level'} ({model.__name__}) has no docstring"
        for name, field in model.model_fields.items():
            sections = [a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                        if isinstance(a, type) and hasattr(a, "model_fields")]
            assert field.description or sections, f"{key + '.' if key else ''}{name} has no description"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    text = page.read_text()
    found = {github_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.MULTILINE)}
    return found | set(re.findall(r'<a id="([^"]+)"', text))


def links_of(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
    return LINK.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = []
    for target in links_of(page):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_check_catches_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#two-words) [bad](a.md#three) [gone](nope.md)\n```\n[skipped](x.md)\n```\n")
    assert links_of(page) == ["a.md#two-words", "a.md#three", "nope.md"]
    assert "two-words" in anchors_of(tmp_path / "a.md") and "three" not in anchors_of(tmp_path / "a.md")
    assert not (tmp_path / "nope.md").exists()


def test_readme_is_a_two_minute_read():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    text = "\n".join(lines)
    assert "make demo" in text and "make test" in text and "make test-fast" in text
