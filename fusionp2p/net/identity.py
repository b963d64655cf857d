"""A peer's identity: one RSA key that is both its libp2p PeerID and its record signer.

The libp2p identity file hivemind writes holds an RSA key. Signing DHT records with the
same key lets any reader check that a record claiming PeerID X was signed by X: the
PeerID is the multihash of the signer's public key.
"""

from __future__ import annotations

import functools
import hashlib
import os

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from fusionp2p.errors import ConfigError

__all__ = ["ensure_identity", "load_signing_key", "peer_id_from_public_key"]


def ensure_identity(path: str) -> PeerID:
    """Creates a libp2p identity file at ``path`` unless one exists; returns its PeerID.

    Raises:
        ConfigError: the file exists but is not an RSA libp2p identity, or cannot be written.
    """
    if not os.path.exists(path):
        try:
            P2P.generate_identity(path)
        except OSError as e:
            raise ConfigError(f"cannot write identity file {path!r}: {e}") from e
    try:
        with open(path, "rb") as f:
            return PeerID.from_identity(f.read())
    except Exception as e:
        raise ConfigError(f"{path!r} is not a libp2p RSA identity file: {e}") from e


def load_signing_key(path: str) -> RSAPrivateKey:
    """Loads the RSA key of a libp2p identity file as a hivemind record signer."""
    with open(path, "rb") as f:
        message = crypto_pb2.PrivateKey.FromString(f.read())
    if message.key_type != crypto_pb2.KeyType.RSA:
        raise ConfigError(f"identity {path!r} holds a non-RSA key; fusionp2p needs RSA")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": message.data})
    return key


@functools.lru_cache(maxsize=4096)
def peer_id_from_public_key(ssh_public_key: bytes) -> str:
    """Base58 PeerID of an RSA public key given in OpenSSH form (hivemind's owner marker).

    Raises:
        ValueError: the bytes are not an RSA public key.
    """
    key = serialization.load_ssh_public_key(ssh_public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()
