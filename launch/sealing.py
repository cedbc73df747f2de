"""Sealed boxes for the secrets `serve --cluster ray` hands to its hosts.

The secrets are the cluster secret and the API key. A box uses X25519 key agreement with a fresh
key per box, HKDF-SHA256 and AES-256-GCM.

Ray keeps an actor's constructor arguments in its control store. It sends method arguments over its
RPC, which is unencrypted by default. Neither ever sees a secret in clear. Each host makes a key
pair when it starts and hands out the public half. Only it can open what is sealed to it.
"""

from __future__ import annotations

import os

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fabric.errors import AuthError

INFO = b"moe-fabric sealed box v1"


def _raw(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _key(shared: bytes, sender: bytes, recipient: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=sender + recipient, info=INFO).derive(shared)


class Opener:
    """The recipient, with a key pair of its own. `public` goes to whoever seals."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = _raw(self._private.public_key())  # 32 bytes

    def open(self, box: bytes) -> bytes:
        if len(box) < 32 + 12 + 16:
            raise AuthError("a sealed box too short to be one")
        sender, nonce, body = box[:32], box[32:44], box[44:]
        key = _key(self._private.exchange(X25519PublicKey.from_public_bytes(sender)), sender, self.public)
        try:
            return AESGCM(key).decrypt(nonce, body, None)
        except Exception as exc:  # cryptography's InvalidTag: not sealed to us, or altered
            raise AuthError("a sealed box that does not open with this host's key") from exc


def seal(recipient: bytes, data: bytes) -> bytes:
    """`data` sealed to the holder of the private half of `recipient`, 32 bytes of raw X25519."""
    ephemeral = X25519PrivateKey.generate()
    sender = _raw(ephemeral.public_key())
    key = _key(ephemeral.exchange(X25519PublicKey.from_public_bytes(recipient)), sender, recipient)
    nonce = os.urandom(12)
    return sender + nonce + AESGCM(key).encrypt(nonce, data, None)
