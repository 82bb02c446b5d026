"""MkDocs hook: serve MathJax with the site, from the installed `django-static-mathjax` wheel.

The built site then renders its maths offline, with no CDN. The wheel (a dependency of the
`docs` and `test` extras) ships MathJax 3's `es5/` build; this hook adds to the site the one
combined component the pages load (`tex-mml-chtml.js`), the CHTML web fonts it fetches, and
the TeX extensions its autoloader fetches on first use of a macro such as `\\boldsymbol`.
"""

import importlib.util
import pathlib

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files


# Where the files land in the site; mkdocs.yml's extra_javascript points at the script.
SITE_DIR = "assets/mathjax"
# Paths below MathJax's `es5/`: the combined component and what it loads from its own folder.
COMPONENT = "tex-mml-chtml.js"
LOADED_DIRS = ("output/chtml/fonts/woff-v2", "input/tex/extensions")


def mathjax_es5() -> pathlib.Path:
    """The `es5/` folder of the installed MathJax (`django-static-mathjax`)."""
    spec = importlib.util.find_spec("mathjax")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        es5 = pathlib.Path(location) / "static" / "mathjax" / "es5"
        if (es5 / COMPONENT).is_file():
            return es5
    raise RuntimeError(
        "MathJax not found: the docs need the `django-static-mathjax` package "
        '(pip install -e ".[docs]"), which ships MathJax for offline rendering.'
    )


def on_files(files: Files, config: MkDocsConfig) -> Files:
    es5 = mathjax_es5()
    paths = [es5 / COMPONENT]
    for sub in LOADED_DIRS:
        paths += sorted(p for p in (es5 / sub).rglob("*") if p.is_file())
    for path in paths:
        uri = f"{SITE_DIR}/{path.relative_to(es5).as_posix()}"
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
