"""Offline builder of QNN EP-context models for Snapdragon NPUs.

Stages: ``quantize`` (float ONNX -> QDQ), ``compile`` (QDQ -> EP-context per target and QNN
toolchain), ``publish`` (versioned, verifiable releases) and the device-side ``runtime`` loader.
This package root imports nothing heavy so that ``pipeline.runtime`` stays light on devices.
"""

__version__ = "0.1.0"
