"""Where site profiles are found, by name: the search path and what is on it (``hpc.core.site`` loads
them). Its own module so that `hpcx status`, which needs only the profiles' files, imports neither the
profile schema nor a TOML parser (``hpc.login.siteroots``)."""

from __future__ import annotations

import os
from pathlib import Path

USER_SITES = "~/.config/hpcx/sites"
SYSTEM_SITES = "/etc/hpcx/sites"


def bundled_dir() -> Path:
    """The profiles shipped with hpcx: ``hpc/_sites`` in an installed wheel, else ``site/`` of the checkout."""
    here = Path(__file__).resolve().parents[1]  # hpc/
    installed = here / "_sites"
    return installed if installed.is_dir() else here.parent / "site"


def search_path() -> list[tuple[Path, str]]:
    """(folder, origin) in lookup order; the first profile of a name wins."""
    folders = [(Path(p).expanduser(), "$HPCX_SITE_PATH")
               for p in os.environ.get("HPCX_SITE_PATH", "").split(os.pathsep) if p]
    folders += [(Path(USER_SITES).expanduser(), "user"), (Path(SYSTEM_SITES), "system"), (bundled_dir(), "bundled")]
    return folders


def find_sites() -> dict[str, tuple[Path, str]]:
    """Every profile name on the search path -> (file, origin), sorted by name; earlier folders shadow later ones."""
    found: dict[str, tuple[Path, str]] = {}
    for folder, origin in search_path():
        for path in sorted(folder.glob("*.toml")) if folder.is_dir() else []:
            found.setdefault(path.stem, (path, origin))
    return dict(sorted(found.items()))
