"""The NPU worker process: ``connect()`` from another process runs a real release like ``load()``.

Every test starts real worker interpreters (``python -m qnn_ctx_runtime serve``) on a release the
real stages built (``release_fixtures``), and runs it on the HTP simulator or the CPU fallback.
Deaths and hangs are real: a ``sitecustomize`` hook, given only to the worker through ``env=``,
makes it exit 127, abort (C ``abort()``), or block forever at a chosen point, as many times as
asked. Timeouts are only ever raced by a worker that really blocks.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from release_fixtures import cached_build

import qnn_ctx_runtime
from pipeline.core.config import load_config
from pipeline.publish.release import publish_model
from qnn_ctx_runtime import FeedError, ReleaseError, UsageError, WorkerError, WorkerTimeout, wire
from qnn_ctx_runtime.client import describe_exit

X_ELITE = "snapdragon-x-elite"
NO_VARIANT = "snapdragon-888"  # v68: no variant of the release runs there
RNG = np.random.default_rng(7)
FEED = {"x": RNG.standard_normal((1, 3, 16, 16)).astype(np.float32)}
OTHER = {"x": RNG.standard_normal((1, 3, 16, 16)).astype(np.float32)}
RUNTIME_DIR = Path(os.path.abspath(qnn_ctx_runtime.__file__)).parent.parent  # as imported here
REPO_DIR = Path(__file__).resolve().parent.parent
HANG_S = 5.0  # the deadline a really blocked worker runs into (a normal call takes milliseconds)

pytestmark = [
    pytest.mark.qnn,
    pytest.mark.skipif(sys.platform != "linux", reason="the checks read /proc and /dev/shm"),
]


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """A published release of the fixtures' two-variant build."""
    build = cached_build(tmp_path_factory)
    copy = build.copy(tmp_path_factory.mktemp("worker-release") / "project")
    return publish_model(load_config(copy.config), copy.artifacts).folder


@pytest.fixture(scope="module")
def local(release: Path):
    """The same release loaded in this process: the reference."""
    with qnn_ctx_runtime.load(release, target=X_ELITE) as model:
        yield model


def worker_env(*first: Path) -> dict[str, str]:
    """The worker imports this checkout's runtime (the one this test imports); ``first`` goes
    before it (a hook folder)."""
    paths = [*map(str, first), str(RUNTIME_DIR), str(REPO_DIR)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def connect(release: Path, **kw):
    kw.setdefault("target", X_ELITE)
    kw.setdefault("env", worker_env())
    return qnn_ctx_runtime.connect(release, **kw)


def is_alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def segment_files() -> list[str]:
    folder = Path("/dev/shm")
    prefix = f"{wire.SEGMENT_PREFIX}{os.getpid()}-"
    return sorted(p.name for p in folder.glob(prefix + "*")) if folder.is_dir() else []


# -- the same model, the same answers --------------------------------------------------------------


@pytest.mark.parametrize("inline_limit", [wire.INLINE_LIMIT, 0], ids=["pipe", "shared-memory"])
def test_worker_runs_like_load(release: Path, local, inline_limit: int):
    expected, other = local.run(FEED)["y"], local.run(OTHER)["y"]
    with connect(release, inline_limit=inline_limit) as model:
        facts, reference = model.facts(), local.facts()
        assert set(facts) - {"worker"} == set(reference)
        for key in ("model", "version", "variant", "provider", "qnn_sdk_version", "htp_arch"):
            assert facts[key] == reference[key], key
        assert facts["worker"]["pid"] == model.pid != os.getpid()
        assert facts["worker"]["python"] == sys.executable and facts["worker"]["restarts"] == 0
        assert [(t.name, t.shape, t.dtype) for t in model.inputs] == [
            (t.name, t.shape, t.dtype) for t in local.inputs
        ]
        first = model.run(FEED)
        assert set(first) == {"y"} and first["y"].dtype == np.float32
        np.testing.assert_array_equal(first["y"], expected)
        # A later call must not overwrite arrays the caller still holds (shared memory is only
        # reused once nothing views it).
        second = model.run(OTHER)
        np.testing.assert_array_equal(first["y"], expected)
        np.testing.assert_array_equal(second["y"], other)
        np.testing.assert_array_equal(model.run(FEED, ["y"])["y"], expected)
        if inline_limit == 0:
            assert first["y"].base is not None  # a view of the response segment, not a copy
        del first, second
        assert model.run(FEED)["y"].flags.writeable


def test_shared_memory_is_reused_and_freed(release: Path, local):
    expected = local.run(FEED)["y"]
    with connect(release, inline_limit=0) as model:
        segments = model._state.segments  # the client's shared memory
        names = set()
        for _ in range(5):  # nothing held: the same two segments (request, response) each time
            np.testing.assert_array_equal(model.run(FEED)["y"], expected)
            names |= {segments.request.name, *(slot.segment.name for slot in segments.slots)}
        assert len(names) == 2
        held = [model.run(FEED)["y"] for _ in range(3)]  # held: each call gets its own
        assert all(np.array_equal(h, expected) for h in held)
        assert len({slot.segment.name for slot in segments.slots}) == 3
        del held[1:]
        model.run(FEED)  # two were let go: one is reused, the other one kept as a spare
        assert len(segments.slots) == 3 and segments.drops == []
        # POSIX: each name is unlinked once the worker has mapped it; nothing is left behind.
        assert segment_files() == []
        pid = model.pid
    assert not is_alive(pid)
    np.testing.assert_array_equal(held[0], expected)  # still readable after close
    assert segment_files() == []


def test_bad_feeds_raise_the_same_errors(release: Path, local):
    bad_feeds = [
        {"x": FEED["x"].astype(np.float64), "z": 1},
        {},
        {"x": FEED["x"][:, :, :8]},
        {"x": FEED["x"][0]},
        {"x": None},  # an object array: pickled, refused by the same dtype check
        {"x": [[1.0, 2.0]]},  # a list becomes an array on the way, as in load()
    ]
    with connect(release) as model:
        for feeds in bad_feeds:
            with pytest.raises(FeedError) as here:
                local.run(feeds)
            with pytest.raises(FeedError) as there:
                model.run(feeds)
            assert str(there.value) == str(here.value)
            assert there.value.tip == here.value.tip
        with pytest.raises(FeedError) as here:
            local.run(FEED, ["nope"])
        with pytest.raises(FeedError) as there:
            model.run(FEED, ["nope"])
        assert str(there.value) == str(here.value)
        np.testing.assert_array_equal(model.run(FEED)["y"], local.run(FEED)["y"])  # still serves
        assert model.restarts == 0


def test_warnings_and_load_options_cross_the_process(release: Path, local):
    """The worker's warnings are re-issued here with their text; any load() option passes
    (here ``nonfinite=``, which turns the NaN warning into a FeedError)."""
    bad = {"x": FEED["x"].copy()}
    bad["x"][0, 0, 0, :3] = np.nan
    with pytest.warns(RuntimeWarning) as here:
        local.run(bad)
    with connect(release) as model, pytest.warns(RuntimeWarning) as there:
        model.run(bad)
    assert [str(w.message) for w in here]
    assert [str(w.message) for w in there] == [str(w.message) for w in here]
    strict = qnn_ctx_runtime.load(release, target=X_ELITE, nonfinite="error")
    with strict, pytest.raises(FeedError) as here_error:
        strict.run(bad)
    with connect(release, nonfinite="error") as model, pytest.raises(FeedError) as there_error:
        model.run(bad)
    assert str(there_error.value) == str(here_error.value)


def test_load_errors_come_back_as_the_same_errors(release: Path):
    for options, kind in [({"target": NO_VARIANT}, ReleaseError), ({"target": "nope"}, UsageError)]:
        with pytest.raises(kind) as here:
            qnn_ctx_runtime.load(release, **options)
        with pytest.raises(kind) as there:
            connect(release, **options)
        assert str(there.value) == str(here.value)
    with pytest.raises(UsageError, match=r"'--targt' \(did you mean '--target'\?\)"):
        connect(release, targt=X_ELITE)
    with pytest.raises(UsageError, match="call_timeout=0: a worker call needs a deadline"):
        connect(release, call_timeout=0)
    assert segment_files() == []


def test_cpu_fallback_warning_crosses_the_process(release: Path):
    with pytest.warns(RuntimeWarning, match="on the CPU, not the NPU"):
        local = qnn_ctx_runtime.load(release, target=NO_VARIANT, allow_cpu_fallback=True)
    with pytest.warns(RuntimeWarning, match="on the CPU, not the NPU"):
        model = connect(release, target=NO_VARIANT, allow_cpu_fallback=True)
    with model, local:
        assert model.on_cpu and model.facts()["fallback_reason"] == local.facts()["fallback_reason"]
        np.testing.assert_array_equal(model.run(FEED)["y"], local.run(FEED)["y"])


def test_close_stops_the_worker(release: Path):
    model = connect(release)
    pid = model.pid
    model.close()
    model.close()
    assert not is_alive(pid)
    with pytest.raises(UsageError, match="was closed"):
        model.run(FEED)


# -- deaths and hangs: a real worker that really dies or blocks ------------------------------------

HOOK = """\
import functools, os, sys, threading
import qnn_ctx_runtime.loader, qnn_ctx_runtime.wire


def _take_over(where):
    with open({marker!r}, "a") as handle:
        handle.write(f"{{os.getpid()}}\\n")
    with open({marker!r}) as handle:
        count = len(handle.read().split())
    if not {skip} < count <= {skip} + {times}:
        return
    print(f"[test hook] {action} in {{where}}, time {{count}}", file=sys.stderr, flush=True)
    if {action!r} == "exit127":
        os._exit(127)
    if {action!r} == "abort":
        os.abort()
    if {action!r} == "hang":
        threading.Event().wait()  # never set
    return {action!r}


def _hooked(real, where):
    @functools.wraps(real)
    def hooked(*args, **kwargs):
        if _take_over(where) == "garble":  # bytes that are not a frame, then the frame
            args[0].write(b"not a frame, just bytes")
        return real(*args, **kwargs)
    return hooked


if {where!r} == "load":
    qnn_ctx_runtime.loader.load = _hooked(qnn_ctx_runtime.loader.load, "load")
elif {where!r} == "run":
    qnn_ctx_runtime.loader.LoadedModel.run = _hooked(qnn_ctx_runtime.loader.LoadedModel.run, "run")
elif {where!r} == "read":  # before the worker reads its first request
    qnn_ctx_runtime.wire.read_frame = _hooked(qnn_ctx_runtime.wire.read_frame, "read")
else:  # each frame the worker writes, READY first
    qnn_ctx_runtime.wire.write_frame = _hooked(qnn_ctx_runtime.wire.write_frame, "write")
"""


def hooked_env(
    tmp_path: Path, action: str, where: str, times: int, skip: int = 0
) -> tuple[dict, Path]:
    """The worker's env with a hook that does ``action`` at ``where`` ``times`` times after
    letting ``skip`` passes by; returns it and the file where each pass writes its pid."""
    folder = tmp_path / "hook"
    folder.mkdir()
    marker = tmp_path / "hook.pids"
    hook = HOOK.format(marker=str(marker), action=action, where=where, times=times, skip=skip)
    (folder / "sitecustomize.py").write_text(hook)
    return worker_env(folder), marker


def pids(marker: Path) -> list[int]:
    return [int(p) for p in marker.read_text().split()] if marker.is_file() else []


def test_exit_127_at_start_is_reported_and_restarted_once(release: Path, local, tmp_path: Path):
    env, marker = hooked_env(tmp_path, "exit127", "load", times=1)
    with pytest.warns(RuntimeWarning) as caught:
        model = connect(release, env=env)
    (warning,) = [w for w in caught if "Restarting" in str(w.message)]
    message = str(warning.message)
    assert "died before it was ready: exit code 127" in message
    assert "[test hook] exit127 in load, time 1" in message  # the last stderr lines
    with model:
        assert model.restarts == 1 and model.facts()["worker"]["restarts"] == 1
        np.testing.assert_array_equal(model.run(FEED)["y"], local.run(FEED)["y"])
        first, second = pids(marker)
        assert model.pid == second != first and not is_alive(first)


def test_exit_127_every_time_gives_up_after_one_restart(release: Path, tmp_path: Path):
    env, marker = hooked_env(tmp_path, "exit127", "load", times=99)
    with pytest.warns(RuntimeWarning, match="Restarting"), pytest.raises(WorkerError) as info:
        connect(release, env=env)
    error = info.value
    assert error.returncode == 127 and "ARM64" in (error.tip or "")
    assert "exit code 127" in error.message and "giving up" in error.message
    assert "[test hook] exit127 in load, time 2" in error.message
    assert len(pids(marker)) == 2 and not any(map(is_alive, pids(marker)))
    assert segment_files() == []


def test_native_abort_in_a_run_is_restarted_and_the_call_retried(
    release: Path, local, tmp_path: Path
):
    env, _ = hooked_env(tmp_path, "abort", "run", times=1)
    with connect(release, env=env, inline_limit=0) as model:
        first_pid = model.pid
        with pytest.warns(RuntimeWarning, match=r"killed by signal 6 \(SIGABRT\)") as caught:
            out = model.run(FEED)
        (message,) = [str(w.message) for w in caught if "Restarting" in str(w.message)]
        assert "[test hook] abort in run, time 1" in message
        np.testing.assert_array_equal(out["y"], local.run(FEED)["y"])
        assert model.restarts == 1 and model.pid != first_pid and not is_alive(first_pid)
        np.testing.assert_array_equal(model.run(OTHER)["y"], local.run(OTHER)["y"])


def test_a_worker_that_keeps_dying_is_given_up(release: Path, tmp_path: Path):
    env, marker = hooked_env(tmp_path, "abort", "run", times=99)
    with connect(release, env=env) as model:
        with pytest.warns(RuntimeWarning, match="SIGABRT"), pytest.raises(WorkerError) as info:
            model.run(FEED)
        assert "giving up" in info.value.message and info.value.returncode == -signal.SIGABRT
        assert "[test hook] abort in run, time 2" in info.value.message
        assert len(pids(marker)) == 2
        with pytest.raises(WorkerError) as again:  # no third worker
            model.run(FEED)
        assert again.value is info.value and len(pids(marker)) == 2


def test_a_worker_killed_from_outside_is_restarted(release: Path, local):
    with connect(release) as model:
        np.testing.assert_array_equal(model.run(FEED)["y"], local.run(FEED)["y"])
        victim = model.pid
        os.kill(victim, signal.SIGKILL)
        with pytest.warns(RuntimeWarning, match=r"killed by signal 9 \(SIGKILL\)"):
            out = model.run(OTHER)
        np.testing.assert_array_equal(out["y"], local.run(OTHER)["y"])
        assert model.restarts == 1 and not is_alive(victim)


def test_a_hung_run_times_out_and_the_next_call_gets_a_new_worker(
    release: Path, local, tmp_path: Path
):
    env, marker = hooked_env(tmp_path, "hang", "run", times=1, skip=1)
    # The first call arms the watchdog for 600 s; the hung second one must still end at its own
    # deadline (the watchdog is woken for an earlier one), not 600 s later.
    with connect(release, env=env, call_timeout=600) as model:
        model.run(FEED)
        started = time.monotonic()
        with pytest.raises(WorkerTimeout) as info:
            model.run(FEED, timeout=HANG_S)
        assert time.monotonic() - started < 300
        hung = pids(marker)[-1]
        assert not is_alive(hung), "the hung worker was left running"
        assert f"gave no answer within {HANG_S:g} s" in info.value.message
        assert "[test hook] hang in run, time 2" in info.value.message
        np.testing.assert_array_equal(model.run(FEED)["y"], local.run(FEED)["y"])
        assert model.pid != hung and model.restarts == 1


def test_a_hung_start_times_out(release: Path, tmp_path: Path):
    env, marker = hooked_env(tmp_path, "hang", "load", times=99)
    with pytest.raises(WorkerTimeout, match=f"sent no READY within start_timeout={HANG_S:g} s"):
        connect(release, env=env, start_timeout=HANG_S)
    (hung,) = pids(marker)
    assert not is_alive(hung)


def test_a_write_into_a_worker_that_stopped_reading_times_out(release: Path, tmp_path: Path):
    """The worker blocks before reading; a request larger than the pipe's buffer blocks the
    client's write, and the watchdog still ends the call at its deadline."""
    env, marker = hooked_env(tmp_path, "hang", "read", times=1)
    big = np.zeros(4 << 20, np.uint8)  # inline: 4 MiB into a pipe that holds 64 KiB
    with connect(release, env=env, inline_limit=8 << 20) as model:
        with pytest.raises(WorkerTimeout, match=f"within {HANG_S:g} s"):
            model.run({"x": FEED["x"], "big": big}, timeout=HANG_S)
        assert not is_alive(pids(marker)[0])


def test_bytes_that_are_not_a_frame_count_as_a_death(release: Path, local, tmp_path: Path):
    """A worker that writes garbage where a frame belongs is stopped (it may be alive and
    waiting), reported and restarted."""
    env, marker = hooked_env(tmp_path, "garble", "write", times=1)
    with pytest.warns(RuntimeWarning, match="Restarting") as caught:
        model = connect(release, env=env)
    (message,) = [str(w.message) for w in caught if "Restarting" in str(w.message)]
    assert "after its output stream broke (bad frame start b'not '" in message
    with model:
        np.testing.assert_array_equal(model.run(FEED)["y"], local.run(FEED)["y"])
        assert not is_alive(pids(marker)[0]) and model.restarts == 1


def test_exit_status_in_words():
    assert describe_exit(-signal.SIGKILL) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(3) == "exit code 3"
    assert "x86/x64 Python under emulation" in describe_exit(127)
    assert describe_exit(0xC0000005) == "exit status 0xc0000005 (access violation)"


def test_the_worker_goes_when_its_client_is_killed(release: Path, tmp_path: Path):
    code = textwrap.dedent(
        f"""
        import sys, numpy as np, qnn_ctx_runtime
        model = qnn_ctx_runtime.connect(sys.argv[1], target={X_ELITE!r}, inline_limit=0)
        model.run({{"x": np.zeros((1, 3, 16, 16), np.float32)}})
        print(model.pid, flush=True)
        sys.stdin.read()  # until killed
        """
    )
    client = subprocess.Popen(
        [sys.executable, "-c", code, str(release)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=worker_env(),
    )
    try:
        worker = int(client.stdout.readline())
        assert is_alive(worker)
        client.kill()
        client.wait()
        waited = time.monotonic()
        while is_alive(worker) and time.monotonic() - waited < 60:  # it reads EOF and exits
            time.sleep(0.05)
        assert not is_alive(worker), "the worker outlived its client"
        leaked = list(Path("/dev/shm").glob(f"{wire.SEGMENT_PREFIX}{client.pid}-*"))
        assert leaked == []
    finally:
        client.kill()
        client.stdin.close()
        client.stdout.close()


# -- the client needs no onnxruntime -------------------------------------------------------------

CLIENT_MODULES = ("client.py", "wire.py")
CLIENT_LOCAL = {"errors", "manifest", "typed", "wire"}  # standard library only themselves


def test_client_modules_import_only_the_standard_library_and_numpy():
    package = Path(qnn_ctx_runtime.__file__).parent
    for name in (*CLIENT_MODULES, *(f"{m}.py" for m in CLIENT_LOCAL)):
        tree = ast.parse((package / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # from .x import y / from . import x
                    local = [node.module] if node.module else [a.name for a in node.names]
                    assert set(local) <= CLIENT_LOCAL, f"{name} imports .{local}"
                    continue
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                assert root in sys.stdlib_module_names or root == "numpy", f"{name}: {root}"


NO_ONNXRUNTIME = """
import json, sys
sys.path[:0] = sys.argv[1:3]
try:
    import onnxruntime
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("onnxruntime is importable here")
import numpy as np
import qnn_ctx_runtime
release, python, runtime = sys.argv[3:6]
env = {"PYTHONPATH": runtime, "PATH": "/usr/bin:/bin"}
with qnn_ctx_runtime.connect(release, python=python, env=env, target="snapdragon-x-elite",
                             inline_limit=0) as model:
    x = np.load(sys.argv[6])
    y = model.run({"x": x})["y"]
    facts = model.facts()
np.save(sys.argv[7], y)
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"onnxruntime", "onnxruntime_qnn", "onnx"})
print(json.dumps({"heavy": heavy, "provider": facts["provider"], "pid": facts["worker"]["pid"]}))
"""


def test_a_python_without_onnxruntime_drives_the_worker(release: Path, local, tmp_path: Path):
    """The client side in an interpreter that has numpy and nothing else (no site-packages):
    ``import onnxruntime`` fails there, and connect + run still work."""
    numpy_only = tmp_path / "numpy-only"
    numpy_only.mkdir()
    numpy_dir = Path(np.__file__).resolve().parent
    for item in (numpy_dir, numpy_dir.with_name("numpy.libs")):
        if item.exists():
            (numpy_only / item.name).symlink_to(item)
    x, y = tmp_path / "x.npy", tmp_path / "y.npy"
    np.save(x, FEED["x"])
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            NO_ONNXRUNTIME,
            str(numpy_only),
            str(RUNTIME_DIR),
            str(release),
            sys.executable,
            worker_env()["PYTHONPATH"],
            str(x),
            str(y),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    import json

    result = json.loads(done.stdout.splitlines()[-1])
    assert result["heavy"] == [] and result["provider"] == "QNNExecutionProvider"
    np.testing.assert_array_equal(np.load(y), local.run(FEED)["y"])
