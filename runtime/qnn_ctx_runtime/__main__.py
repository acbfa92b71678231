"""``python -m qnn_ctx_runtime serve RELEASE [load options]``: the NPU worker (see ``worker``).

Only ``serve`` exists; it is what ``qnn_ctx_runtime.connect`` starts in the Python that can drive
the NPU. Its flags are ``load()``'s keyword arguments (``--target=...``, ``--allow-cpu-fallback``).
"""

from __future__ import annotations

import sys

USAGE = "usage: python -m qnn_ctx_runtime serve RELEASE [load options]  (serve --help for them)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from .worker import main as serve

        return serve(argv[1:])
    print(USAGE, file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
