"""Memory the process has freed goes back to the operating system.

glibc keeps what Python, protobuf and numpy free on its heap for reuse: after preparing a
1024x1024 U-Net (176 MB of weights, copied by each graph step), 729 MB stayed resident
although only 88 MB were in use, and every later phase (calibration's session and its
activations) stacked its own peak on top. ``malloc_trim`` returns the free pages; it is
called between phases, where the previous phase's copies are gone.

Within a phase, large inputs need more: glibc raises its mmap threshold to the size of each
mapped block freed (up to 32 MiB), so after the first run of a model every activation below
that size comes from the heap, and what one session's run freed stays resident under the next
session's run. On a U-Net at 1x3x1024x2048, three CPU sessions run sample by sample as the
end-to-end check does peaked at 1390 MiB this way, and at 1222 MiB with every block of 1 MiB or
more mapped on its own (unmapped when freed). Mapping costs page faults on each run (fastestdet
at 352x352: 3.1 -> 5.9 ms a run), so it is only done for large samples (``adapt_heap_to``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

LARGE_SAMPLE_BYTES = 4 << 20  # a sample this large: its activations are mapped (see above)
MAPPED_BLOCK_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@functools.cache
def _libc_function(name: str) -> object | None:
    library = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(library) if library else None
        return getattr(libc, name, None)
    except OSError:  # not glibc (macOS, Windows, musl without it): nothing to do
        return None


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS (a no-op where libc has no ``malloc_trim``)."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)  # type: ignore[operator]


def adapt_heap_to(sample_bytes: int) -> bool:
    """For samples of ``LARGE_SAMPLE_BYTES`` or more, map every block of 1 MiB or more on its
    own for the rest of the process, so a freed activation leaves at once; True if it did."""
    mallopt = _libc_function("mallopt")
    if sample_bytes < LARGE_SAMPLE_BYTES or mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MAPPED_BLOCK_BYTES))  # type: ignore[operator]


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; peak RSS elsewhere; 0 where neither
    can be read, as on Windows: a figure for the report, never a reason to fail)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        try:
            import resource
        except ImportError:
            return 0
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
