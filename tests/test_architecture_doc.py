"""docs/architecture.md names every room of the house: each package folder under rlspec/, rollout/ and trainers/."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("rollout", "trainers", "configs")  # rlspec/<name> links to the top-level folder


def rooms() -> list[str]:
    out = []
    for top in ("rlspec", "rollout", "trainers"):
        for d in sorted((ROOT / top).iterdir()):
            if d.is_dir() and not d.is_symlink() and (d / "__init__.py").exists() and d.name not in LINKED:
                out.append(d.name)
    return out


def test_every_package_folder_is_named_on_the_architecture_page():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [name for name in rooms() if f"{name}/" not in page]
    assert rooms() and not missing, f"docs/architecture.md does not name {missing}: add each room and what it holds"
