"""Trusting a release's manifest: a pinned digest, an Ed25519 signature, and what was checked.

Every file of a release is checked against the manifest (``qnn_ctx_runtime.release``), so
whoever can rewrite the manifest can swap a ctx binary and re-hash it, or flip ``passed``. Two
ways close that gap, both optional:

- **pin**: the consumer keeps the manifest's sha256 (``publish`` prints it) from a trusted build
  and passes ``load(..., expect_manifest_sha256=...)``; any other manifest is refused. Needs only
  the standard library.
- **signature**: ``publish --sign-key key.pem`` writes ``manifest.json.sig`` (Ed25519 over the
  manifest's bytes); ``load(..., public_key=...)`` refuses a release that is unsigned, signed by
  another key, or changed after signing. Checking needs the ``cryptography`` package
  (``qnn-ctx-runtime[verify]``); a consumer who asked for a signature check without it is refused
  (fail closed), one who did not ask is told in ``facts()["trust"]`` what was not checked.

Standard library only at import time: ``cryptography`` is imported when a signature is checked.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ReleaseError, UsageError

SIGNATURE_FILE = "manifest.json.sig"
ALGORITHM = "ed25519"
PublicKey = bytes | str | os.PathLike[str]
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TAMPERED = "Do not use this copy: get the release again from where it was published."


@dataclass(frozen=True)
class TrustPolicy:
    """What the consumer demands of the manifest: its digest, and/or a signature by a key."""

    manifest_sha256: str | None = None
    public_key: PublicKey | None = None

    def __post_init__(self) -> None:
        pin = self.manifest_sha256
        if pin is not None and not _HEX64.fullmatch(pin.strip().lower()):
            raise UsageError(
                f"expect_manifest_sha256={pin!r} is not a sha256 (64 hex digits).",
                tip="Pass the digest `python -m pipeline publish` printed for the release.",
            )


@dataclass(frozen=True)
class TrustReport:
    """What was checked about the manifest itself; ``facts()["trust"]`` of a loaded model."""

    manifest_sha256: str
    pinned: bool
    signature: str  # verified ... | unsigned | signed ..., not checked: ...
    archive_checksum: str  # matched ... | missing ... | not an archive

    def facts(self) -> dict[str, Any]:
        return {
            "manifest_sha256": self.manifest_sha256,
            "manifest_pinned": self.pinned,
            "signature": self.signature,
            "archive_checksum": self.archive_checksum,
        }


def check_manifest(
    raw: bytes, signature: bytes | None, policy: TrustPolicy, where: str
) -> tuple[str, str]:
    """(manifest sha256, signature status) of a manifest's bytes, or a ReleaseError."""
    digest = hashlib.sha256(raw).hexdigest()
    pin = policy.manifest_sha256
    if pin is not None and digest != pin.strip().lower():
        raise ReleaseError(
            f"{where}: manifest.json has sha256 {digest}, not the pinned {pin.strip().lower()}: "
            "it was changed (or it is another release).",
            tip=_TAMPERED,
        )
    return digest, _check_signature(raw, signature, policy.public_key, where)


def _parse_signature(signature: bytes, where: str) -> tuple[str, bytes]:
    try:
        data = json.loads(signature)
        if data["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {data['algorithm']!r}")
        return str(data["public_key_sha256"]), base64.b64decode(data["signature"], validate=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise ReleaseError(
            f"{where}: {SIGNATURE_FILE} is not an {ALGORITHM} signature file ({exc}).",
            tip=_TAMPERED,
        ) from None


def _check_signature(
    raw: bytes, signature: bytes | None, public_key: PublicKey | None, where: str
) -> str:
    if public_key is None:
        if signature is None:
            return "unsigned"
        key_id, _ = _parse_signature(signature, where)
        return f"signed by key {key_id[:16]}, not checked: pass public_key= to check it"
    if signature is None:
        raise ReleaseError(
            f"{where} is not signed ({SIGNATURE_FILE} is missing), but a public_key was given.",
            tip="Publish it with `python -m pipeline publish --sign-key KEY.pem`, or get the "
            "signed copy.",
        )
    key_id, sig = _parse_signature(signature, where)
    try:
        from cryptography.exceptions import InvalidSignature
    except ImportError:
        raise ReleaseError(
            f"{where} is signed, and a public_key was given, but the signature cannot be checked: "
            "the cryptography package is not installed.",
            tip="pip install 'qnn-ctx-runtime[verify]' (cryptography), or pin the manifest with "
            "expect_manifest_sha256= instead.",
        ) from None
    key = load_public_key(public_key)
    raw_key = _raw_public(key)
    wanted = hashlib.sha256(raw_key).hexdigest()
    if key_id != wanted:
        raise ReleaseError(
            f"{where} is signed by key {key_id[:16]}, not by the given key {wanted[:16]}.",
            tip=_TAMPERED,
        )
    try:
        key.verify(sig, raw)
    except InvalidSignature:
        raise ReleaseError(
            f"{where}: the {ALGORITHM} signature does not match manifest.json: the manifest was "
            "changed after it was signed.",
            tip=_TAMPERED,
        ) from None
    return f"verified ({ALGORITHM}, key {wanted[:16]})"


def load_public_key(value: PublicKey) -> Any:
    """An Ed25519 public key from raw 32 bytes, PEM text or bytes, or a PEM file's path."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    data: bytes
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        data = value.encode()
    else:
        try:
            data = Path(value).read_bytes()
        except OSError as exc:
            raise UsageError(
                f"public_key={value!s}: cannot read it ({exc.strerror or exc}).",
                tip="Pass the Ed25519 public key (PEM file path, PEM text or 32 raw bytes).",
            ) from None
    try:
        if len(data) == 32:
            return Ed25519PublicKey.from_public_bytes(data)
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise UsageError(
            f"public_key is not a readable public key ({exc}).",
            tip="Pass the Ed25519 public key (PEM file path, PEM text or 32 raw bytes).",
        ) from None
    if not isinstance(key, Ed25519PublicKey):
        raise UsageError(
            f"public_key is a {type(key).__name__}, not an Ed25519 key.",
            tip="Releases are signed with Ed25519 (openssl genpkey -algorithm ed25519).",
        )
    return key


def _raw_public(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def signature_file(raw_manifest: bytes, private_key: Any) -> bytes:
    """The bytes of ``manifest.json.sig`` for a manifest, signed with an Ed25519 private key
    (for the builder; needs cryptography)."""
    public = _raw_public(private_key.public_key())
    return (
        json.dumps(
            {
                "algorithm": ALGORITHM,
                "public_key_sha256": hashlib.sha256(public).hexdigest(),
                "signature": base64.b64encode(private_key.sign(raw_manifest)).decode(),
            },
            indent=2,
        )
        + "\n"
    ).encode()
