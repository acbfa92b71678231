"""The NPU worker: ``python -m qnn_ctx_runtime serve RELEASE [load options]``.

Runs in the Python that can drive the NPU (ARM64 native, with onnxruntime-qnn), loads the release
once with :func:`qnn_ctx_runtime.load`, sends a READY frame carrying ``facts()``, then answers RUN
frames from ``qnn_ctx_runtime.connect`` on stdin/stdout (``qnn_ctx_runtime.wire``) until CLOSE or
the end of stdin, so a worker never outlives its client. The load options are ``load()``'s own
keyword arguments as flags (``--target=snapdragon-x-elite``, ``--allow-cpu-fallback``), read from
its signature so a new option needs no change here.

The protocol owns the process's real stdout: before anything native loads, fd 1 is pointed at
stderr, so QNN's and onnxruntime's prints cannot corrupt a frame. SIGINT is ignored: Ctrl-C in
the app's terminal is the app's to handle, and the worker goes when its stdin closes.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import platform
import signal
import sys
import traceback
import warnings
from typing import IO, Any

from . import wire
from .errors import ActionableError, UsageError
from .loader import LoadedModel, load

PROG = "python -m qnn_ctx_runtime serve"


class Channel:
    """The frame streams: the process's original stdin and stdout."""

    def __init__(self, reader: IO[bytes], writer: IO[bytes]) -> None:
        self.reader = reader
        self.writer = writer
        self.segments: dict[str, wire.Segment] = {}

    @classmethod
    def claim_stdio(cls) -> Channel:
        """Keep fds 0 and 1 for frames and point the standard ones elsewhere (1 -> stderr)."""
        reader_fd, writer_fd = os.dup(0), os.dup(1)
        if sys.platform == "win32":
            import msvcrt

            for fd in (reader_fd, writer_fd):
                msvcrt.setmode(fd, os.O_BINARY)
        sys.stdout.flush()
        os.dup2(2, 1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        return cls(os.fdopen(reader_fd, "rb", buffering=1 << 16), os.fdopen(writer_fd, "wb", 0))

    def send(self, kind: wire.Kind, meta: dict[str, Any] | None = None, **kw: Any) -> None:
        wire.write_frame(self.writer, kind, meta, **kw)

    def segment(self, spec: dict[str, Any]) -> wire.Segment:
        """The segment the client named, mapped once."""
        segment = self.segments.get(spec["name"])
        if segment is None:
            segment = self.segments[spec["name"]] = wire.Segment.attach(spec["name"], spec["size"])
        return segment

    def drop(self, names: list[str]) -> None:
        for name in names:
            segment = self.segments.pop(name, None)
            if segment is not None:
                segment.close()


def error_meta(exc: BaseException, caught: list[warnings.WarningMessage] | None = None) -> dict:
    """An exception as the client rebuilds it: type (and its bases), message, tip, args."""
    kind = type(exc)
    args = list(exc.args) if all(isinstance(a, str | int | float) for a in exc.args) else None
    return {
        "type": kind.__name__,
        "module": kind.__module__,
        "mro": [c.__name__ for c in kind.__mro__ if c is not object],
        "message": exc.message if isinstance(exc, ActionableError) else str(exc),
        "tip": exc.tip if isinstance(exc, ActionableError) else None,
        "args": args,
        "traceback": "".join(traceback.format_exception(exc)[-12:]),
        "warnings": warning_meta(caught),
    }


def warning_meta(caught: list[warnings.WarningMessage] | None) -> list[dict[str, str]]:
    return [{"category": w.category.__name__, "message": str(w.message)} for w in caught or []]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit 2
        raise UsageError(f"{PROG}: {message}", tip=f"Run `{PROG} --help`.")


def parser() -> argparse.ArgumentParser:
    """RELEASE and every keyword argument of ``load()`` as a flag."""
    p = _Parser(
        prog=PROG,
        description="Serve a release to qnn_ctx_runtime.connect() over stdin/stdout.",
    )
    p.add_argument("release", help="release folder or archive")
    for name, param in inspect.signature(load).parameters.items():
        if name == "release" or param.default is inspect.Parameter.empty:
            continue
        flag = "--" + name.replace("_", "-")
        default = param.default
        if isinstance(default, bool):
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, int | float):
            p.add_argument(flag, dest=name, type=type(default), default=default)
        else:
            p.add_argument(flag, dest=name, default=default)
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """Arguments, with every unknown flag named (and the nearest known one) at once."""
    p = parser()
    args, unknown = p.parse_known_args(argv)
    if unknown:
        known = [a for action in p._actions for a in action.option_strings]
        hints = []
        for item in unknown:
            flag = item.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1)
            hints.append(f"{flag!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise UsageError(
            f"Unknown load option(s) for the worker: {', '.join(hints)}.",
            tip=f"load() options: {', '.join(k for k in known if k.startswith('--') and k != '--help')}.",
        )
    return args


def main(argv: list[str]) -> int:
    """Load, say READY (or why not), then serve until CLOSE or the end of stdin."""
    if argv[:1] in (["-h"], ["--help"]):
        parser().print_help()
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = Channel.claim_stdio()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            args = vars(parse(argv))
            model = load(args.pop("release"), **args)
        except Exception as exc:
            print(f"{PROG}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            channel.send(wire.Kind.ERROR, error_meta(exc, caught))
            return 2 if isinstance(exc, UsageError) else 1
    channel.send(
        wire.Kind.READY,
        {
            "protocol": wire.PROTOCOL,
            "facts": model.facts(),
            "inputs": [[t.name, list(t.shape), t.dtype] for t in model.inputs],
            "outputs": [[t.name, list(t.shape), t.dtype] for t in model.outputs],
            "pid": os.getpid(),
            "python": sys.executable,
            "machine": platform.machine(),
            "warnings": warning_meta(caught),
        },
    )
    try:
        return serve(channel, model)
    finally:
        model.close()


def serve(channel: Channel, model: LoadedModel) -> int:
    while True:
        frame = wire.read_frame(channel.reader)
        if frame is None or frame.kind == wire.Kind.CLOSE:
            return 0
        if frame.kind != wire.Kind.RUN:
            raise wire.ProtocolError(f"expected a RUN frame, got {frame.kind.name}")
        if not run_once(channel, model, frame):
            return 0


def run_once(channel: Channel, model: LoadedModel, frame: wire.Frame) -> bool:
    """Answer one RUN frame; False when the client went away in the middle."""
    meta = frame.meta
    channel.drop(meta.get("drop", []))
    request = channel.segment(meta["request"]).buffer if "request" in meta else None
    feeds = {t.name: t.value_in(request) for t in frame.tensors}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outputs = model.run(feeds, meta.get("outputs"))
        except Exception as exc:
            del feeds
            channel.send(wire.Kind.ERROR, error_meta(exc, caught))
            return True
    del feeds  # views of the request segment: none may outlive the call
    payloads = [wire.Payload.of(name, value) for name, value in outputs.items()]
    offsets, needed = wire.placements(payloads, meta.get("inline", wire.INLINE_LIMIT))
    response = meta.get("response")
    if needed and (response is None or response["size"] < needed):
        channel.send(wire.Kind.NEED, {"bytes": needed})
        reply = wire.read_frame(channel.reader)
        if reply is None or reply.kind != wire.Kind.SPACE:
            return False
        channel.drop(reply.meta.get("drop", []))
        response = reply.meta["response"]
    segment = channel.segment(response).buffer if needed and response else None
    result = {"warnings": warning_meta(caught)}
    if segment is not None:
        result["segment"] = response["name"]
    channel.send(wire.Kind.RESULT, result, payloads=payloads, offsets=offsets, segment=segment)
    return True
