"""A streaming model run as an app runs it: each window fed the state the model itself gave on
the window before (closed loop), against a reference run on the windows as stored.

Why: every other figure feeds each window the float model's state, so an error the model feeds
back never compounds there (a streaming Silero v6: 38.6 dB so, 19.8 dB on the HTP fed its own
state). Shared by the quantize stage (the QDQ model on the CPU EP) and the compile worker (the
ctx on the HTP), so both decide alike which windows continue a run. numpy only: the compile
environment has no onnx to spare.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

Feeds = dict[str, np.ndarray]
Run = Callable[[Feeds], Feeds]  # feeds -> every output by name

# A window's stored state input is the reference's state output on the window before it (the
# same run of a stream) when they agree this closely; otherwise a run starts there.
SAME_STATE_RTOL = 1e-4


def follows(state: np.ndarray, before: np.ndarray) -> bool:
    """Whether a window's stored ``state`` is the output ``before`` of the window before it."""
    return state.shape == before.shape and np.allclose(
        state, before, rtol=SAME_STATE_RTOL, atol=1e-6
    )


def run_closed_loop(
    windows: Iterable[Feeds],
    reference: Run,
    test: Run,
    recurrent: dict[str, str],
    compare: Callable[[Feeds, Feeds], None],
    more: Callable[[int], bool] = lambda ran: True,
) -> tuple[int, int]:
    """Run ``windows`` in order through ``reference`` as stored and through ``test`` fed its own
    state (``recurrent``: state input -> the output that feeds it) wherever the stored state is
    the reference's after the window before (a run restarts elsewhere: a file's first window,
    the first of a held-out run). ``compare(expected, got)`` gets the outputs an app reads (all,
    when every output is a state). ``more(ran)``: whether to start another window.
    Returns (windows run, windows fed the test's own state)."""
    ran = carried = 0
    previous_reference: Feeds | None = None
    own_state: Feeds | None = None
    for feeds in windows:
        if not more(ran):
            break
        expected = reference(feeds)
        read = [n for n in expected if n not in recurrent.values()] or list(expected)
        continues = previous_reference is not None and all(
            follows(np.asarray(feeds[inp]), previous_reference[out])
            for inp, out in recurrent.items()
        )
        run_feeds = dict(feeds)
        if continues and own_state is not None:
            run_feeds.update(own_state)
            carried += 1
        got = test(run_feeds)
        compare({n: expected[n] for n in read}, {n: got[n] for n in read})
        previous_reference = {out: np.asarray(expected[out]) for out in recurrent.values()}
        own_state = {inp: np.asarray(got[out]) for inp, out in recurrent.items()}
        ran += 1
    return ran, carried
