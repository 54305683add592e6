"""Repository tools that are not part of the installed package (pyproject's packages.find leaves tools/ out): run
them from the repository root, e.g. `python -m tools.corpus RAW_DIR OUT_DIR` (tools/fetch_demo_corpus.sh does)."""
