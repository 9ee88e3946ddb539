"""A mkdocs hook: the Sphinx roles of the package's docstrings read as plain code.

The docstrings name other objects as ``:class:`~genlm_backend.cache.OutputCache``` or
``:meth:`from_name```, which Markdown renders as the role's text followed by code. Here the
role goes, and a leading ``~`` keeps only the last part of the name, as Sphinx shows it.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _code(match: re.Match) -> str:
    name = match.group(2).lstrip(".")
    if match.group(1):
        name = name.rsplit(".", 1)[-1]
    return f"<code>{name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub(_code, html)
