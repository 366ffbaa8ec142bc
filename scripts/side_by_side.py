"""Run shell commands side by side, each line they print prefixed with its name.

    python scripts/side_by_side.py NAME COMMAND [NAME COMMAND ...]

`make demo` trains the EAGLE drafter and the draft LM this way, one thread each on 2 cores: the
pair finishes sooner than one after the other with both threads each (small products do not
scale to a second thread; LOG.md, 2026-12-03). Every command runs to its end whatever the others
do (a failure never cuts a neighbour's training short, so nothing is lost); the exit status is
that of the first command that failed, in argument order, or 0.
"""

from __future__ import annotations

import subprocess
import sys
import threading


def relay(name: str, stream, out, lock: threading.Lock) -> None:
    """Copy `stream` to `out` line by line, each line prefixed with `[name]` (carriage returns of
    progress bars end a line too, so a bar's updates stay readable)."""
    buf = b""
    while chunk := stream.read1(4096):
        buf += chunk
        *lines, buf = buf.replace(b"\r", b"\n").split(b"\n")
        with lock:
            for line in lines:
                if line.strip():
                    out.write(f"[{name}] {line.decode(errors='replace')}\n")
            out.flush()
    if buf.strip():
        with lock:
            out.write(f"[{name}] {buf.decode(errors='replace')}\n")
            out.flush()


def main(argv: list[str]) -> int:
    if not argv or len(argv) % 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    lock = threading.Lock()
    jobs = []
    for name, command in zip(argv[::2], argv[1::2]):
        proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        thread = threading.Thread(target=relay, args=(name, proc.stdout, sys.stdout, lock))
        thread.start()
        jobs.append((name, proc, thread))
    failed = []
    for name, proc, thread in jobs:
        proc.wait()
        thread.join()
        if proc.returncode:
            failed.append((name, proc.returncode))
    for name, code in failed:
        print(f"[{name}] failed with exit status {code}", file=sys.stderr)
    return failed[0][1] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
