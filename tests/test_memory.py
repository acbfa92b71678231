"""Freed heap memory goes back to the OS between phases (pipeline.core.memory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import memory

_FREED = """
from pipeline.core.memory import release_freed_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
held = [bytearray(4000) for _ in range(60_000)]  # ~240 MB of malloc heap blocks
pinned = held[::64]  # a few stay alive, as some objects of a phase do: the heap cannot shrink
grown = rss()
del held
kept = rss()
release_freed_memory()
print(grown, kept, rss())
"""


@pytest.mark.skipif(
    memory._libc_function("malloc_trim") is None, reason="this libc has no malloc_trim"
)
def test_freed_small_blocks_leave_the_process() -> None:
    """Freed heap blocks between live ones stay resident (glibc keeps them for reuse)
    until released."""
    done = subprocess.run(
        [sys.executable, "-c", _FREED], capture_output=True, text=True, check=True
    )
    grown, kept, released = (float(v) for v in done.stdout.split())
    assert kept > grown - 100  # freed, still resident: what piled up between phases
    assert released < kept - 150


_LARGE_RUN = """
import sys
import numpy as np
from pipeline.core.memory import adapt_heap_to
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
adapted = adapt_heap_to(int(sys.argv[1]))
first = np.ones(16 << 18, np.float32)  # a 16 MiB activation, mapped and freed: glibc then
del first                              # serves every block below 16 MiB from the heap
before = rss()
held, pins = [], []
for _ in range(40):  # a run's 4 MiB activations, with small live objects between them
    held.append(np.ones(1 << 20, np.float32))
    pins.append(bytearray(200_000))
del held
print(adapted, before, rss())
"""


@pytest.mark.skipif(memory._libc_function("mallopt") is None, reason="this libc has no mallopt")
@pytest.mark.parametrize("sample_bytes", [memory.LARGE_SAMPLE_BYTES, 64 << 10])
def test_large_samples_free_their_activations_at_once(sample_bytes: int) -> None:
    """After the first run, glibc keeps a large model's freed activations on its heap (here
    160 MiB); for large samples each block of 1 MiB or more is mapped on its own instead."""
    done = subprocess.run(
        [sys.executable, "-c", _LARGE_RUN, str(sample_bytes)],
        capture_output=True,
        text=True,
        check=True,
    )
    adapted, before, after = done.stdout.split()
    large = sample_bytes >= memory.LARGE_SAMPLE_BYTES
    assert adapted == str(large)
    if large:
        assert float(after) < float(before) + 30  # only the 8 MiB of pins stay
    else:
        assert float(after) > float(before) + 120  # the default: freed, still resident


_PEAK = """
def _status_mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
def peak_from_here():
    open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
    return _status_mib("VmRSS")
def peak_mib():
    return _status_mib("VmHWM")
"""


def _figure_of(script: str, *args: str) -> float:
    """The last figure ``script`` prints, run in a fresh interpreter (a peak of its own)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


_END_TO_END = (
    _PEAK
    + """
import sys
from pathlib import Path
from types import SimpleNamespace
import numpy as np
import onnx
from onnx import TensorProto, helper
from pipeline.graph.buckets import single_bucket
from pipeline.graph.source import SourceModel
from pipeline.quantize.evaluate import end_to_end

folder = Path(sys.argv[1])
shape = [1, 32, 1024, 1024]  # a 128 MiB output from a one-value input
graph = helper.make_graph(
    [
        helper.make_node("Expand", ["x", "shape"], ["wide"]),
        helper.make_node("Mul", ["wide", "one"], ["y"]),
    ],
    "wide_output",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 1, 1])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    [
        helper.make_tensor("shape", TensorProto.INT64, [4], shape),
        helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
    ],
)
model = folder / "wide.onnx"
onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), model)
heldout = folder / "heldout"
heldout.mkdir()
for index in range(3):
    np.savez(heldout / f"sample_{index:04d}.npz", x=np.full((1, 1, 1, 1), index + 1, np.float32))
config = SimpleNamespace(inputs=SimpleNamespace(constants={}))
plan = single_bucket({"x": [1, 1, 1, 1]})
before = peak_from_here()
result = end_to_end(config, SourceModel(model), plan, {plan.names[0]: model}, {plan.names[0]: model}, heldout)
assert result.samples == 3, result
print((peak_mib() - before) / 128)
"""
)


def test_end_to_end_holds_one_model_outputs_beside_the_source(tmp_path: Path) -> None:
    """The end-to-end check runs the source, QDQ and float models on each held-out sample. A
    19-class 1024x2048 map is 152 MiB a model: only the source's outputs and one other model's
    may be alive at a time, not all three under the next sample's runs."""
    outputs_alive = _figure_of(_END_TO_END, str(tmp_path))
    assert outputs_alive < 2.8, f"{outputs_alive:.1f} outputs of 128 MiB alive at the peak"


_HEAVY = (
    _PEAK
    + """
import sys
from pathlib import Path
from types import SimpleNamespace
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from pipeline.core.memory import release_freed_memory
from pipeline.graph.buckets import single_bucket
from pipeline.graph.source import SourceModel
from pipeline.quantize.evaluate import end_to_end, evaluate

folder = Path(sys.argv[1])
weight = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)  # 64 MiB
graph = helper.make_graph(  # a table lookup: the session holds the table as it is
    [helper.make_node("Gather", ["w", "x"], ["y"])],
    "heavy_weights",
    [helper.make_tensor_value_info("x", TensorProto.INT64, [1])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])],
    [numpy_helper.from_array(weight, "w")],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
paths = [folder / f"{name}.onnx" for name in ("source", "float", "qdq")]  # as a build has
for path in paths:
    model.doc_string = path.stem  # three files, three digests: no run is shared between them
    onnx.save(model, path)
del weight, graph, model
heldout = folder / "heldout"
heldout.mkdir()
for index in range(3):
    np.savez(heldout / f"sample_{index:04d}.npz", x=np.array([index], np.int64))
config = SimpleNamespace(inputs=SimpleNamespace(constants={}))
plan = single_bucket({"x": [1]})
release_freed_memory()
before = peak_from_here()
name = plan.names[0]
if sys.argv[2] == "end_to_end":
    result = end_to_end(
        config, SourceModel(paths[0]), plan, {name: paths[1]}, {name: paths[2]}, heldout
    )
    assert result.samples == 3, result
else:
    assert evaluate(paths[1], paths[2], heldout)
print((peak_mib() - before) / 64)
"""
)


@pytest.mark.parametrize("check", ["end_to_end", "evaluate"])
def test_checks_open_one_session_at_a_time(tmp_path: Path, check: str) -> None:
    """A heavy model's CPU session holds its weights (a 1024x1024 U-Net's: 495 MB): the
    end-to-end check's source, QDQ and float sessions, and the float and QDQ ones of the
    held-out evaluation, run one after another, not side by side."""
    weights_alive = _figure_of(_HEAVY, str(tmp_path), check)
    assert weights_alive < 3.0, f"{weights_alive:.1f} x 64 MiB of weights at the peak"


_UPGRADE = (
    _PEAK
    + """
import numpy as np
from onnx import TensorProto, helper, numpy_helper
from pipeline.graph import edit, transforms

weight = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)  # 64 MiB
graph = helper.make_graph(
    [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Clip", ["m"], ["y"], min=-1.0, max=1.0),
    ],
    "heavy_old_opset",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])],
    [numpy_helper.from_array(weight, "w")],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=7)
del weight, graph
before = peak_from_here()
with edit.checks_deferred():  # as in preparation: the checker's own copies are not this step's
    upgraded, change = transforms.upgrade_opset(model)
assert change.changed
print((peak_mib() - before) / 64)
"""
)


def test_the_opset_upgrade_does_not_copy_the_weights_through_cpp() -> None:
    """onnx's version converter serializes the model, parses it in C++ and back: with the
    weights' bytes that is several copies of them at once (the quantize stage's peak on a
    176 MB U-Net); without them, only the result's own copy."""
    copies = _figure_of(_UPGRADE)
    assert copies < 1.6, f"{copies:.1f} x 64 MiB of weights at the peak"


def test_resident_memory_is_read_here_and_zero_where_it_cannot_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The figure a variant's record carries: this process's RSS on Linux; 0 (never an error)
    where neither /proc nor the resource module exists, as on Windows."""
    import builtins

    from pipeline.core.memory import rss_bytes

    assert rss_bytes() > 10 << 20  # this interpreter with numpy loaded
    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise OSError("no /proc here")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setitem(sys.modules, "resource", None)  # as if it did not exist
    assert rss_bytes() == 0
