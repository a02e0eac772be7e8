"""Move files too large for one device call: bundle them, split the bundle into parts, and join
the parts on the other side with every digest checked.

    python3 bench/peers/parts.py split --out .peers --part-mib 56 a.whl b.whl ...
    python3 bench/peers/parts.py join --manifest .peers/manifest.json \\
        --parts .peers/parts --stash /tmp/peers-parts --out /tmp/peers-wheels

A device call carries at most 64 MiB (the working tree included), so the wheels travel as one
uncompressed tar (the wheels are compressed already) cut into parts, a part or two per call.
`join` copies each part that has arrived, once its digest matches, into a stash outside the
checkout, so the parts of earlier calls count however the checkout is refreshed; when all are
there it joins them, checks the bundle's digest and each file's, and unpacks the files. Until
then it names the parts still missing.

Standard library only: it runs with the bare `python3` of a machine that reaches no registry.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path

BUNDLE = "bundle.tar"
CHUNK = 1 << 20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def split(files: list[Path], out: Path, part_bytes: int) -> dict:
    """Bundle `files` into `out/bundle.tar`, cut it into `out/parts/bundle.tar.NN` of at most
    `part_bytes` each, and write `out/manifest.json` (every file, the bundle and every part,
    each with its size and sha256). Returns the manifest."""
    if part_bytes <= 0:
        raise ValueError(f"part size must be positive, got {part_bytes} bytes")
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"two files share a name: {sorted(names)}")
    parts_dir = out / "parts"
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(parents=True)
    bundle = out / BUNDLE
    with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as tar:
        for f in files:
            tar.add(f, arcname=f.name, recursive=False)
    parts = []
    with open(bundle, "rb") as src:
        while block := src.read(part_bytes):
            part = parts_dir / f"{BUNDLE}.{len(parts):02d}"
            part.write_bytes(block)
            parts.append({"name": part.name, "size": len(block),
                          "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {
        "bundle": {"name": BUNDLE, "size": bundle.stat().st_size, "sha256": sha256(bundle)},
        "files": [{"name": f.name, "size": f.stat().st_size, "sha256": sha256(f)}
                  for f in files],
        "parts": parts,
    }  # fmt: skip
    bundle.unlink()  # the parts hold it; the manifest says how to check it
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stash_arrived(manifest: dict, sources: list[Path], stash: Path) -> list[str]:
    """Copy into `stash` every part found in `sources` whose digest matches the manifest (a
    part whose digest does not match is reported and left out). Returns the parts still
    missing from the stash."""
    stash.mkdir(parents=True, exist_ok=True)
    missing = []
    for part in manifest["parts"]:
        kept = stash / part["name"]
        if kept.is_file() and sha256(kept) == part["sha256"]:
            continue
        for source in sources:
            candidate = source / part["name"]
            if not candidate.is_file():
                continue
            if sha256(candidate) != part["sha256"]:
                print(f"{candidate}: sha256 differs from the manifest; ignored", file=sys.stderr)
                continue
            shutil.copyfile(candidate, kept)
            break
        else:
            missing.append(part["name"])
    return missing


def join(manifest: dict, stash: Path, out: Path) -> list[Path]:
    """Join the stashed parts, check the bundle's digest, unpack it into `out` and check every
    file's digest. Returns the unpacked files. Raises ValueError on any mismatch."""
    bundle = stash / manifest["bundle"]["name"]
    with open(bundle, "wb") as dst:
        for part in manifest["parts"]:
            with open(stash / part["name"], "rb") as src:
                shutil.copyfileobj(src, dst, CHUNK)
    if sha256(bundle) != manifest["bundle"]["sha256"]:
        raise ValueError(f"{bundle}: sha256 differs from the manifest after the join")
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(bundle) as tar:
        tar.extractall(out, filter="data")
    bundle.unlink()
    files = []
    for entry in manifest["files"]:
        path = out / entry["name"]
        if sha256(path) != entry["sha256"]:
            raise ValueError(f"{path}: sha256 differs from the manifest")
        files.append(path)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="bundle files and cut the bundle into parts")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--part-mib", type=float, default=56.0)
    s.add_argument("files", type=Path, nargs="+")
    j = sub.add_parser("join", help="stash arrived parts; join and unpack once all are there")
    j.add_argument("--manifest", type=Path, required=True)
    j.add_argument("--parts", type=Path, action="append", default=[],
                   help="a folder where parts may have arrived (repeatable)")
    j.add_argument("--stash", type=Path, required=True)
    j.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.command == "split":
        m = split(args.files, args.out, int(args.part_mib * (1 << 20)))
        print(f"{len(m['files'])} files, {m['bundle']['size'] / (1 << 20):.1f} MiB in "
              f"{len(m['parts'])} parts under {args.out / 'parts'}")
        return 0
    manifest = json.loads(args.manifest.read_text())
    missing = stash_arrived(manifest, args.parts, args.stash)
    have = len(manifest["parts"]) - len(missing)
    print(f"parts: {have} of {len(manifest['parts'])} in {args.stash}")
    if missing:
        print("still missing: " + " ".join(missing))
        return 2
    for path in join(manifest, args.stash, args.out):
        print(f"ok {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
