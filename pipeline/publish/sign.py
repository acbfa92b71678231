"""Signing a release's manifest with Ed25519, so a consumer holding the public key can tell the
published release from any other (``qnn_ctx_runtime.trust`` checks it).

The key is a PEM Ed25519 private key (``openssl genpkey -algorithm ed25519 -out key.pem``; the
public half: ``openssl pkey -in key.pem -pubout -out key.pub.pem``), given with
``publish --sign-key`` or the ``QNN_CTX_SIGN_KEY`` environment variable (a CI secret's file); an
encrypted key takes its password from ``QNN_CTX_SIGN_KEY_PASSWORD``. Signing needs the
``cryptography`` package (``pip install 'qnn-ctx-pipeline[sign]'``): well kept, with wheels for
every platform the builder runs on, where a hand-written Ed25519 would be neither.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qnn_ctx_runtime.trust import signature_file

from ..core.errors import PublishError

SIGN_KEY_ENV = "QNN_CTX_SIGN_KEY"
PASSWORD_ENV = "QNN_CTX_SIGN_KEY_PASSWORD"


def signing_key_path(explicit: Path | None = None) -> Path | None:
    """The key to sign with: the argument, else $QNN_CTX_SIGN_KEY, else None (unsigned)."""
    if explicit is not None:
        return Path(explicit)
    value = os.environ.get(SIGN_KEY_ENV, "").strip()
    return Path(value) if value else None


def load_signing_key(path: Path) -> Any:
    """The Ed25519 private key in ``path``, or a PublishError naming the file and the fix."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    except ImportError:
        raise PublishError(
            f"Signing with {path} needs the cryptography package, which is not installed.",
            tip="pip install 'qnn-ctx-pipeline[sign]' (or cryptography) in the publish "
            "environment, or publish without --sign-key.",
        ) from None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise PublishError(
            f"Cannot read the signing key {path}: {exc.strerror or exc}.",
            tip=f"Pass --sign-key (or ${SIGN_KEY_ENV}) the path of a PEM Ed25519 private key.",
        ) from None
    password = os.environ.get(PASSWORD_ENV)
    try:
        key = serialization.load_pem_private_key(
            data, password=password.encode() if password else None
        )
    except (ValueError, TypeError) as exc:
        raise PublishError(
            f"{path} is not a readable PEM private key ({exc}).",
            tip="Make one with `openssl genpkey -algorithm ed25519 -out key.pem`; an encrypted "
            f"key takes its password from ${PASSWORD_ENV}.",
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise PublishError(
            f"{path} holds a {type(key).__name__}, not an Ed25519 private key.",
            tip="Releases are signed with Ed25519: `openssl genpkey -algorithm ed25519`.",
        )
    return key


def sign_manifest(raw_manifest: bytes, key_path: Path) -> bytes:
    """The bytes of manifest.json.sig for these manifest bytes."""
    return signature_file(raw_manifest, load_signing_key(key_path))
