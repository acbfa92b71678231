"""``python -m pipeline plan``: a release build as a matrix of CI jobs, each one plain CLI call.

M models and T toolchains make M quantize jobs, M x T compile jobs and M publish jobs. A compile
job holds every target of one toolchain (weight sharing and the toolchain's one environment serve
them all), so targets lengthen a job instead of adding one. Each job runs in a fresh checkout
plus the shards of the jobs it ``needs``, and leaves a shard: a folder in the artifacts layout
(``pipeline.core.layout``) holding only what it ``produces``. Its records carry the digests of
what it was built from, so ``publish --from`` can prove that the shards fit together.

The plan is data, not a scheduler: CI runs the jobs. ``--json`` prints one ``{"include": [...]}``
per stage, usable as GitHub Actions' ``strategy.matrix`` through ``fromJSON`` (see
.github/workflows/build.yml); any other CI can read the same fields. The entry function is
``plan_build``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qnn_ctx_runtime.toolchains import load_toolchains, version_key

from .core.config import EXAMPLE_CONFIGS, ModelConfig, load_config
from .core.errors import ConfigError
from .core.layout import ModelPaths, release_dir

HELP = """\
Print the build as a matrix of CI jobs: quantize per model, compile per model x toolchain
(all targets of a toolchain in one job), publish per model.

Each job lists the jobs whose shards it needs, the paths it reads from them and the paths it
produces (relative to an artifacts root). Jobs come in a fixed order: by stage, model name,
toolchain version. --json prints {"quantize": {"include": [...]}, "compile": {...},
"publish": {...}} on one line; each value is a GitHub Actions strategy.matrix (fromJSON).
Config paths are written relative to the current folder (the checkout's root), where every
job runs. With no config, plans the bundled examples. Needs only the standard library.

examples:
  python -m pipeline plan
  python -m pipeline plan configs/shared/*.toml --json
"""

STAGE_ORDER = ("quantize", "compile", "publish")


@dataclass(frozen=True)
class Job:
    """One CI job: what it runs on, which shards it needs, what it reads and leaves behind.

    ``job`` names the job and the shard it leaves (a CI artifact name: no '/', ':' or spaces;
    '@' cannot occur in a model name, so ``<model>@*`` matches one model's shards only).
    """

    job: str
    stage: str
    model: str
    config: str  # posix path relative to the checkout's root
    toolchain: str = ""  # compile: the onnxruntime-qnn pin; "" for the other stages
    targets: list[str] = field(default_factory=list)  # compile: the variants it builds
    needs: list[str] = field(default_factory=list)  # jobs whose shards it starts from
    reads: list[str] = field(default_factory=list)  # artifact paths it reads from them
    produces: list[str] = field(default_factory=list)  # artifact paths of its own shard


@dataclass(frozen=True)
class Plan:
    """Every job of one build, in a fixed order."""

    jobs: list[Job]
    models: list[str]
    toolchains: list[str]  # every toolchain some model compiles with

    def stage(self, name: str) -> list[Job]:
        return [j for j in self.jobs if j.stage == name]

    def matrix(self) -> dict[str, dict[str, list[dict[str, Any]]]]:
        """One ``{"include": [...]}`` per stage: GitHub Actions' strategy.matrix form."""
        return {s: {"include": [dataclasses.asdict(j) for j in self.stage(s)]} for s in STAGE_ORDER}

    def to_json(self) -> str:
        """One line (a GitHub step output is ``name=value``), stable for equal plans."""
        return json.dumps(self.matrix(), separators=(",", ":"))

    def table(self) -> str:
        counts = " + ".join(f"{len(self.stage(s))} {s}" for s in STAGE_ORDER)
        lines = [
            f"{len(self.models)} model(s) x {len(self.toolchains)} toolchain(s) "
            f"({', '.join(self.toolchains)}): {counts} = {len(self.jobs)} jobs",
            "",
        ]
        rows = [("job", "needs", "produces")]
        for j in self.jobs:
            made = ", ".join(j.produces)
            if j.targets:
                made += f"  ({', '.join(j.targets)})"
            rows.append((j.job, ", ".join(j.needs) or "-", made))
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        lines += [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}".rstrip() for r in rows]
        return "\n".join(lines)


def job_id(model: str, stage: str, toolchain: str = "") -> str:
    """``<model>@quantize``, ``<model>@compile-<toolchain>``, ``<model>@publish``."""
    return f"{model}@{stage}-{toolchain}" if toolchain else f"{model}@{stage}"


def _relative_config(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        raise ConfigError(
            f"Config {path} is outside {root.resolve()}, the folder the jobs run in (a fresh "
            "checkout), so no job could find it.",
            tip="Run `plan` from the checkout's root with configs inside it.",
        ) from None


def plan_build(configs: Sequence[ModelConfig], root: Path = Path(".")) -> Plan:
    """The jobs that build and publish ``configs``, in a fixed order."""
    table = load_toolchains()
    seen: dict[str, Path] = {}
    for config in configs:
        name = config.model.name
        if name in seen:
            raise ConfigError(
                f"{seen[name]} and {config.path} both build model {name!r}; their jobs and "
                "artifacts would overwrite each other.",
                tip="Give each config its own model.name.",
            )
        seen[name] = config.path
    quantize, compile_, publish = [], [], []
    toolchains: set[str] = set()
    for config in sorted(configs, key=lambda c: c.model.name):
        model = config.model.name
        where = _relative_config(config.path, root)
        paths = ModelPaths.of(Path(), model)
        quantized = job_id(model, "quantize")
        quantize.append(Job(quantized, "quantize", model, where, produces=[paths.root.as_posix()]))
        pins = sorted(
            {t.onnxruntime_qnn for t in table.selected(config.compile.toolchains)}, key=version_key
        )
        toolchains.update(pins)
        targets = list(dict.fromkeys(config.compile.targets))
        compiled = []
        for pin in pins:
            compiled.append(
                Job(
                    job_id(model, "compile", pin),
                    "compile",
                    model,
                    where,
                    toolchain=pin,
                    targets=targets,
                    needs=[quantized],
                    reads=[paths.record.as_posix(), paths.buckets.as_posix()],
                    produces=[paths.toolchain(pin).as_posix()],
                )
            )
        compile_ += compiled
        shards = [quantize[-1], *compiled]
        publish.append(
            Job(
                job_id(model, "publish"),
                "publish",
                model,
                where,
                needs=[j.job for j in shards],
                reads=[p for j in shards for p in j.produces],
                produces=[release_dir(Path(), model, config.model.version).as_posix()],
            )
        )
    return Plan(
        quantize + compile_ + publish,
        models=sorted(seen),
        toolchains=sorted(toolchains, key=version_key),
    )


# -- CLI ----------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "configs", nargs="*", type=Path, help="model configs (default: the bundled examples)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the matrix as one line of JSON instead of a table",
    )


def run(args: argparse.Namespace) -> int:
    # The sources need not exist yet (the bundled examples are generated by the quantize job).
    configs = [load_config(p, check_files=False) for p in (args.configs or EXAMPLE_CONFIGS)]
    plan = plan_build(configs, Path("."))
    print(plan.to_json() if args.json else plan.table())
    return 0
