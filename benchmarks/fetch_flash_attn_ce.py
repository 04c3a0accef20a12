"""Fetch flash-attn's Triton cross-entropy kernel (one file of the flash-attn sdist) into a folder.

Used as a GPU benchmark peer only, loaded at run time from the file named by FLASH_ATTN_CE_FILE;
nothing of it is committed. The package's CUDA extension takes hours to build and that kernel
does not use it, hence one file rather than ``pip install flash-attn``.

Usage: python benchmarks/fetch_flash_attn_ce.py DEST_DIR   (writes DEST_DIR/cross_entropy.py, VERSION)
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path


def main(dest_dir: str) -> None:
    dest = Path(dest_dir) / "cross_entropy.py"
    index = "https://pypi.org/pypi/flash-attn/json"
    meta = json.load(urllib.request.urlopen(index, timeout=30))
    sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
    print(f"flash-attn {meta['info']['version']}: {sdist['filename']}")
    # A mirror may answer with URLs relative to the index page.
    data = urllib.request.urlopen(urllib.parse.urljoin(index, sdist["url"]), timeout=60).read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("flash_attn/ops/triton/cross_entropy.py"))
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(tar.extractfile(member).read())
    (dest.parent / "VERSION").write_text(meta["info"]["version"] + "\n")
    print(f"wrote {dest}")


if __name__ == "__main__":
    main(sys.argv[1])
