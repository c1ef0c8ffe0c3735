"""The bundle's manifest.json: what the bundle holds, written last, read first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from retrieval.bundle.fingerprints import fingerprint_files

MANIFEST_FILE = "manifest.json"


# 2: the manifest holds fingerprints of the served files and a probe query.
BUNDLE_FORMAT_VERSION = 2


# Format 1 bundles still load (serving warns that their parts cannot be checked against the export).
READABLE_FORMAT_VERSIONS = (1, 2)


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write ``manifest`` (with ``fingerprints`` of the files under its ``files``) to manifest.json; return it.

    Call it after every served file is in place: the fingerprints are taken now.
    """
    directory = Path(directory)
    manifest = {**manifest, "fingerprints": fingerprint_files(directory, manifest["files"])}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, default=str))
    return manifest


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a bundle: {MANIFEST_FILE} is missing")
    manifest = json.loads(path.read_text())
    if not isinstance(manifest, dict) or manifest.get("format_version") not in READABLE_FORMAT_VERSIONS:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ValueError(
            f"{path}: bundle format {version!r}, this library reads {list(READABLE_FORMAT_VERSIONS)}"
        )
    return manifest
