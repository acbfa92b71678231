"""Planning shape buckets: which static shapes a config asks of a model, and how they relate.

QNN HTP needs static shapes. A build is a set of one or more static shapes ("buckets") that share
one set of weights: the quantize stage prepares one static graph per bucket, the compile stage puts
them in one context, and the runtime pads each input into the smallest bucket that holds it and
crops the outputs back (``qnn_ctx_runtime.buckets``, which this module's plans feed). A model
without ``[buckets]`` is a plan of one bucket (``single_bucket``) with nothing to pad or crop.

A bucket dim is named by a key of ``[buckets] dims``: a ``dim_param`` of the source model (every
input axis with that name follows it) or ``"input:axis"`` for a dim without a usable name.
Pure functions over plain data.
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qnn_ctx_runtime.buckets import Bucket, CropRule, PadRule
from qnn_ctx_runtime.manifest import SINGLE_BUCKET

from ..core.config import is_axis_key
from ..core.errors import ConfigError

# A model input's dims as the source model declares them: an int (static), a str (dim_param) or
# None (dynamic without a name).
Signature = Mapping[str, Sequence[int | str | None]]


@dataclass(frozen=True)
class AxisRef:
    """One axis of one graph input."""

    input: str
    axis: int

    def describe(self) -> str:
        return f"{self.input}[{self.axis}]"


@dataclass(frozen=True)
class BucketPlan:
    """The buckets of one config, smallest first, and the rules to pad into and crop out of them."""

    buckets: list[Bucket]
    pads: list[PadRule]
    crops: list[CropRule] = field(default_factory=list)

    @property
    def largest(self) -> Bucket:
        return self.buckets[-1]

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.buckets]

    def bucket(self, name: str) -> Bucket:
        return next(b for b in self.buckets if b.name == name)


def single_bucket(shapes: Mapping[str, Sequence[int]]) -> BucketPlan:
    """The plan of a model with one static shape: one bucket, nothing to pad or crop."""
    return BucketPlan(
        [Bucket(SINGLE_BUCKET, {n: tuple(int(d) for d in s) for n, s in shapes.items()})], []
    )


# -- planning (quantize stage) ---------------------------------------------------------------------


def _label(key: str) -> str:
    """A file-name-safe label for a dim key: ``frames`` -> ``frames``, ``x:3`` -> ``x_3``."""
    label = re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_") or "dim"
    return label if label[-1].isalpha() else label + "_"


def _dynamic_axes(signatures: Signature) -> list[str]:
    """How each dynamic input dim of the model can be named in [buckets] dims."""
    keys = []
    for name, dims in signatures.items():
        for axis, dim in enumerate(dims):
            if isinstance(dim, str):
                keys.append(f"{dim!r} or '{name}:{axis}'")
            elif dim is None:
                keys.append(f"'{name}:{axis}'")
    return keys


def resolve_dim(key: str, signatures: Signature, file: Any = "config") -> list[AxisRef]:
    """The input axes a [buckets] dim key names; a ConfigError says which keys exist."""
    refs = [
        AxisRef(name, axis)
        for name, dims in signatures.items()
        for axis, dim in enumerate(dims)
        if isinstance(dim, str) and dim == key
    ]
    if refs:
        return refs
    if is_axis_key(key):
        name, _, axis_text = key.rpartition(":")
        axis = int(axis_text)
        if name not in signatures:
            close = difflib.get_close_matches(name, list(signatures), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"inputs: {', '.join(signatures)}."
            raise ConfigError(f"{file}: [buckets] dim {key!r} names input {name!r}; {hint}")
        dims = signatures[name]
        if axis >= len(dims):
            raise ConfigError(
                f"{file}: [buckets] dim {key!r}: input {name!r} has rank {len(dims)}, "
                f"so axis {axis} does not exist."
            )
        if isinstance(dims[axis], int):
            raise ConfigError(
                f"{file}: [buckets] dim {key!r}: input {name!r} has the static size "
                f"{dims[axis]} on axis {axis}; only a dynamic dim can have buckets.",
                tip="Dynamic dims of the model: "
                + (", ".join(_dynamic_axes(signatures)) or "none"),
            )
        return [AxisRef(name, axis)]
    names = sorted({d for dims in signatures.values() for d in dims if isinstance(d, str)})
    close = difflib.get_close_matches(key, names, n=1)
    raise ConfigError(
        f"{file}: [buckets] dim {key!r} is neither a dim_param of the model nor 'input:axis'"
        + (f"; did you mean {close[0]!r}?" if close else "."),
        tip="Dynamic dims of the model: " + (", ".join(_dynamic_axes(signatures)) or "none"),
    )


def _base_shape(
    name: str,
    dims: Sequence[int | str | None],
    fixed_dims: Mapping[str, int],
    fixed_shapes: Mapping[str, Sequence[int]],
    bucketed: set[int],
    file: Any,
) -> list[int | None]:
    """An input's shape with [inputs] applied; bucketed axes stay None for the bucket to fill."""
    if name in fixed_shapes:
        shape: list[int | None] = [int(d) for d in fixed_shapes[name]]
        if len(shape) != len(dims):
            raise ConfigError(
                f"{file}: [inputs] shapes.{name} has rank {len(shape)}, the model's input has "
                f"rank {len(dims)}."
            )
    else:
        shape = []
        for axis, dim in enumerate(dims):
            if axis in bucketed:
                shape.append(None)
            elif isinstance(dim, int):
                shape.append(dim)
            elif isinstance(dim, str) and dim in fixed_dims:
                shape.append(int(fixed_dims[dim]))
            else:
                key = f"{dim!r}" if isinstance(dim, str) else f"'{name}:{axis}'"
                raise ConfigError(
                    f"{file}: input {name!r} axis {axis} is dynamic and neither [inputs] nor "
                    f"[buckets] gives it a size.",
                    tip=f"Add it to [buckets] dims ({key} = [sizes]) or fix it in [inputs] dims.",
                )
    for axis in bucketed:
        shape[axis] = None
    return shape


def plan_buckets(
    section: Any,
    signatures: Signature,
    outputs: Mapping[str, Sequence[int | str | None] | None] | None = None,
    fixed_dims: Mapping[str, int] | None = None,
    fixed_shapes: Mapping[str, Sequence[int]] | None = None,
    file: Any = "config",
) -> BucketPlan:
    """The buckets a ``[buckets]`` section (``config.BucketsSection``) asks of this model.

    ``signatures`` maps each real graph input to its declared dims, ``outputs`` each graph output
    to its dims (or None when its rank is unknown). Buckets are sorted smallest first.
    """
    fixed_dims = fixed_dims or {}
    fixed_shapes = fixed_shapes or {}
    outputs = outputs or {}
    if section.shapes:
        buckets, axes = _explicit_buckets(section, signatures, fixed_dims, fixed_shapes, file)
    else:
        buckets, axes = _product_buckets(section, signatures, fixed_dims, fixed_shapes, file)
    buckets.sort(key=lambda b: (b.elements, [b.shapes[n] for n in sorted(b.shapes)]))
    pads = []
    for key, refs in axes.items():
        rule = section.pad.get(key)
        value = float(rule.value) if rule is not None else 0.0
        side = rule.side if rule is not None else "end"
        pads += [PadRule(r.input, r.axis, key, value, side) for r in refs]
    unused = sorted(set(section.pad) - set(axes))
    if unused:
        raise ConfigError(
            f"{file}: buckets.pad names {unused}, which no bucket varies "
            f"(bucket dims: {', '.join(axes) or 'none'})."
        )
    crops = []
    for output, follow in section.outputs.items():
        if output not in outputs:
            close = difflib.get_close_matches(output, list(outputs), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"outputs: {', '.join(outputs)}."
            raise ConfigError(f"{file}: buckets.outputs names {output!r}, not an output; {hint}")
        dims = outputs[output]
        if dims is not None and follow.axis >= len(dims):
            raise ConfigError(
                f"{file}: buckets.outputs.{output}.axis = {follow.axis}, but the output has rank "
                f"{len(dims)}."
            )
        refs = axes.get(follow.follows)
        if not refs:
            raise ConfigError(
                f"{file}: buckets.outputs.{output}.follows = {follow.follows!r} is not a dim the "
                f"buckets vary (bucket dims: {', '.join(axes) or 'none'})."
            )
        crops.append(CropRule(output, follow.axis, refs[0].input, refs[0].axis, follow.follows))
    return BucketPlan(buckets, pads, crops)


def _product_buckets(
    section: Any,
    signatures: Signature,
    fixed_dims: Mapping[str, int],
    fixed_shapes: Mapping[str, Sequence[int]],
    file: Any,
) -> tuple[list[Bucket], dict[str, list[AxisRef]]]:
    axes: dict[str, list[AxisRef]] = {}
    owner: dict[AxisRef, str] = {}
    for key in section.dims:
        refs = resolve_dim(key, signatures, file)
        for ref in refs:
            if ref in owner:
                raise ConfigError(
                    f"{file}: [buckets] dims {owner[ref]!r} and {key!r} both name "
                    f"{ref.describe()}; keep one."
                )
            owner[ref] = key
        axes[key] = refs
    bucketed = {name: {r.axis for r in owner if r.input == name} for name in signatures}
    base = {
        name: _base_shape(name, dims, fixed_dims, fixed_shapes, bucketed[name], file)
        for name, dims in signatures.items()
    }
    keys = list(section.dims)
    buckets = []
    for sizes in itertools.product(*(sorted(section.dims[k]) for k in keys)):
        shapes = {name: list(shape) for name, shape in base.items()}
        for key, size in zip(keys, sizes, strict=True):
            for ref in axes[key]:
                shapes[ref.input][ref.axis] = int(size)
        name = "-".join(f"{_label(k)}{s}" for k, s in zip(keys, sizes, strict=True))
        buckets.append(Bucket(name, {n: tuple(int(d) for d in s) for n, s in shapes.items()}))
    return buckets, axes


def _explicit_buckets(
    section: Any,
    signatures: Signature,
    fixed_dims: Mapping[str, int],
    fixed_shapes: Mapping[str, Sequence[int]],
    file: Any,
) -> tuple[list[Bucket], dict[str, list[AxisRef]]]:
    given = set(section.shapes[0])
    unknown = sorted(given - set(signatures))
    if unknown:
        raise ConfigError(
            f"{file}: buckets.shapes names {unknown}, which are not model inputs "
            f"({', '.join(signatures)})."
        )
    full: list[dict[str, tuple[int, ...]]] = []
    for index, entry in enumerate(section.shapes):
        shapes = {}
        for name, dims in signatures.items():
            if name in entry:
                shape = tuple(int(d) for d in entry[name])
                if len(shape) != len(dims):
                    raise ConfigError(
                        f"{file}: buckets.shapes[{index}].{name} = {list(shape)} has rank "
                        f"{len(shape)}, the model's input has rank {len(dims)}."
                    )
                for axis, (want, got) in enumerate(zip(dims, shape, strict=True)):
                    if isinstance(want, int) and want != got:
                        raise ConfigError(
                            f"{file}: buckets.shapes[{index}].{name} sets axis {axis} to {got}, "
                            f"but the model fixes it to {want}."
                        )
            else:
                base = _base_shape(name, dims, fixed_dims, fixed_shapes, set(), file)
                shape = tuple(int(d) for d in base if d is not None)
            shapes[name] = shape
        full.append(shapes)
    axes: dict[str, list[AxisRef]] = {}
    for name in signatures:
        for axis in range(len(full[0][name])):
            if len({shapes[name][axis] for shapes in full}) > 1:
                axes[f"{name}:{axis}"] = [AxisRef(name, axis)]
    buckets = []
    for shapes in full:
        varying = [shapes[r.input][r.axis] for refs in axes.values() for r in refs]
        label = "x".join(str(v) for v in varying) if varying else "0"
        buckets.append(Bucket(f"s{label}", shapes))
    return buckets, axes


def fit_length_rule(lengths: Mapping[int, int], num: int, den: int) -> tuple[int, int] | None:
    """(add, shift) such that ``max(1, (n * num + add) // den + shift)`` gives every measured
    ``lengths[n]``, the smallest such offsets; None when no rule of that form fits."""
    reach = 4 * (num + den)
    candidates = sorted(
        ((add, shift) for add in range(-reach, reach + 1) for shift in range(-4, 5)),
        key=lambda pair: (abs(pair[1]), abs(pair[0])),
    )
    for add, shift in candidates:
        if all(max(1, (n * num + add) // den + shift) == m for n, m in lengths.items()):
            return add, shift
    return None
