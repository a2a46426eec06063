"""MkDocs hook: the package's version on the site, beside its name and in the footer.

Why a hook: a version typed into mkdocs.yml goes stale at the next release. This reads ``ddp_rank.__version__``
(the version pyproject.toml declares; ``tests/docs/test_site_version.py`` holds the two equal) at every build, and
sets ``extra.version`` for templates, the site's name (``ddp_rank 0.1.0``, in every page's header) and the
footer's line; the Changelog page (``docs/changelog.md``) includes CHANGELOG.md itself.
"""

from __future__ import annotations

from typing import Any

import ddp_rank


def on_config(config: Any) -> Any:
    version = ddp_rank.__version__
    name = config["site_name"].split(" ")[0]
    config["site_name"] = f"{name} {version}"
    config["extra"]["version"] = version
    config["copyright"] = f"{name} {version}"
    return config
