"""Rewrite a wheel without the members a pattern names, so that a carried wheel fits the device
tool's 64 MiB copy limit (pyarrow's Flight RPC library, C++ headers and tests: nothing here
imports them). scripts/gpu/carry.sh runs it on pyarrow when CARRY_PYARROW=1.

    python scripts/gpu/slim_wheel.py pyarrow-*.whl 'pyarrow/include/*' 'pyarrow/tests/*' '*flight*'

The wheel is replaced in place; its RECORD drops the removed members (pip does not check it).
"""

import fnmatch
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, patterns: list[str]) -> tuple[int, int]:
    """Drop every member matching one of `patterns`; returns (bytes before, bytes after)."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {i.filename for i in src.infolist()
                   if any(fnmatch.fnmatch(i.filename, p) for p in patterns)}
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = data.decode().splitlines()
                data = "\n".join(r for r in rows if r.split(",")[0] not in dropped).encode() + b"\n"
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    return before, wheel.stat().st_size


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    before, after = slim(Path(sys.argv[1]), sys.argv[2:])
    print(f"{sys.argv[1]}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
