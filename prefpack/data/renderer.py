"""What rendered a store's chat rows besides the template: the transformers and Jinja versions, recorded in meta.json
(``renderer``) beside the template's sha256, and stores that share a template but not its renderer, said once.

The same rows and template can give other text under another transformers: 5.24 drops message keys whose value is
None before rendering (a template reading ``message.content is none`` then takes another branch), and a Jinja
release may change whitespace or filters. The tokens in a store are what they are, so a mixture (or a run's eval
stores) whose stores were rendered by different versions is trained as it is, with one warning naming both.
"""

from __future__ import annotations

from collections.abc import Iterable

RENDERER_PACKAGES = ("transformers", "jinja2")


def renderer_versions() -> dict[str, str]:
    """The versions that render chat templates in this process (``transformers``' ``render_jinja_template`` on
    ``jinja2``), as meta.json's ``renderer`` records them."""
    import jinja2
    import transformers

    return {"transformers": transformers.__version__, "jinja2": jinja2.__version__}


def _describe(renderer: dict) -> str:
    return ", ".join(f"{name} {renderer.get(name, '?')}" for name in RENDERER_PACKAGES)


def renderer_warnings(stores: Iterable[tuple[str, dict]]) -> list[str]:
    """One line per pair of stores (``(what, meta)``, in order) whose chat rows were rendered with the same template
    (its sha256) by different transformers or Jinja versions; stores without chat rows or from before the renderer
    was recorded are not compared (nothing says what rendered them)."""
    first: dict[str, tuple[str, dict]] = {}  # template sha256 -> the first store rendered with it, its renderer
    said: set[tuple[str, tuple]] = set()
    lines = []
    for what, meta in stores:
        template, renderer = meta.get("chat_template") or {}, meta.get("renderer")
        sha = template.get("sha256")
        if not sha or not isinstance(renderer, dict):
            continue
        if sha not in first:
            first[sha] = (what, renderer)
            continue
        other, seen = first[sha]
        versions = tuple(renderer.get(n) for n in RENDERER_PACKAGES)
        if versions == tuple(seen.get(n) for n in RENDERER_PACKAGES) or (sha, versions) in said:
            continue
        said.add((sha, versions))
        lines.append(f"warning: {what} and {other} were rendered with the same chat template (sha256 {sha[:12]}) by "
                     f"different versions ({_describe(renderer)} against {_describe(seen)}), so the same rows may "
                     "have been rendered differently (transformers 5.24 drops message keys set to null); trained "
                     "as stored: prepare them again with one version for identical renderings")
    return lines
