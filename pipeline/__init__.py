"""Offline builder of QNN EP-context models for Snapdragon NPUs.

Stages, one subpackage each with one entry function: ``quantize`` (float ONNX -> QDQ models),
``compile`` (QDQ -> EP-context variants per target and QNN toolchain), ``publish`` (versioned,
verifiable releases). Below them: ``core`` (config, records, artifact layout, files, reports),
``graph`` (transforms and shape planning) and ``calibration`` (samples and range rules). The
device side is the separate ``qnn_ctx_runtime`` package, which this one depends on and which
imports nothing from here. See ARCHITECTURE.md.
"""

__version__ = "0.2.0"
