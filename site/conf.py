"""Sphinx settings for the lessons' site (`make site`; scripts/build_site.py assembles the pages it reads).

Everything a page needs ships with the site, so it opens from disk with no network: Furo bundles its own CSS
and JavaScript and uses the system's fonts, the ipywidgets scripts (require.js and the widget manager, fetched
from CDNs by default) are left out because a static page has no kernel behind its widgets, and LaTeX outputs
show as text rather than through MathJax from a CDN.
"""

project = "Training neural networks with PyTorch, hands-on"
author = "the course's authors"
copyright = "the course's authors"
extensions = ["myst_nb"]

# The notebooks arrive executed (build/executed/ for the CPU run, site/gpu/ for a GPU run): never run them here.
nb_execution_mode = "off"
nb_ipywidgets_js: dict = {}
nb_merge_streams = True
nb_mime_priority_overrides = [("html", "text/latex", None)]
myst_enable_extensions: list = []

html_theme = "furo"
html_title = "PyTorch training, hands-on: the lessons with their outputs"
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_copy_source = False  # the sources are notebooks with their images inside: no copy to download
html_show_sourcelink = False
html_show_search_summary = False  # the summaries are fetch()ed page by page, which a page opened from disk may not do
html_use_index = False
html_domain_indices = False
html_permalinks_icon = "#"
html_theme_options = {"navigation_with_keys": True}
suppress_warnings = ["myst.header"]  # a notebook's headings may skip a level; the page reads the same
