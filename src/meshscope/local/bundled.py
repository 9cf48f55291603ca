"""Files that ship with meshscope: the example TrainingJobs and the CRD.

In a source checkout (editable install) they live at the repository root; in a wheel, hatch copies them into the
package under ``_data/``. This module is the one place that knows both.
"""

from __future__ import annotations

from pathlib import Path

from meshscope.errors import MeshscopeError

DEMO_EXAMPLE = "llama3-70b-h100.yaml"
"""The job ``meshscope demo`` plans."""

_PACKAGE = Path(__file__).resolve().parents[1]  # meshscope/
_CANDIDATES = (_PACKAGE / "_data", _PACKAGE.parent.parent)


def data_root(kind: str) -> Path:
    """The directory holding ``kind`` (``examples`` or ``crds``).

    Raises:
        MeshscopeError: if the installation lacks it.
    """
    for root in _CANDIDATES:
        if (root / kind).is_dir():
            return root / kind
    raise MeshscopeError(f"meshscope's bundled {kind}/ directory is missing from this installation ({_PACKAGE})")


def bundled_example(name: str = DEMO_EXAMPLE) -> Path:
    """Path of a bundled example manifest."""
    path = data_root("examples") / name
    if not path.is_file():
        known = sorted(p.name for p in data_root("examples").glob("*.yaml"))
        raise MeshscopeError(f"no bundled example {name!r}; known: {', '.join(known)}")
    return path
