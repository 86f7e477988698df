"""The secrets that key the remote and disk tiers: checked for strength, stretched, split by purpose.

A tier key is given as ``bytes`` (a random key: at least :data:`MIN_KEY_BYTES`, 128 bits, e.g.
``os.urandom(16)``) or as a ``str`` (a passphrase: at least :data:`MIN_PASSPHRASE_CHARS`
characters, e.g. ``secrets.token_hex(16)``, stretched with scrypt). Anything shorter, and a
secret of fewer than :data:`MIN_DISTINCT` distinct symbols (``b"\\0" * 16``, ``"a" * 20``), is
refused with a ``ValueError`` that names what is valid; the message never repeats the secret.

Stretching: a passphrase becomes a 32-byte key by ``hashlib.scrypt`` (N = 2**14, r = 8, p = 1:
16 MiB; 0.34-0.47 s a derivation measured here with the machine's two cores loaded ~10x over) with the fixed salt :data:`SCRYPT_SALT`. The salt is
the same in every process, as it must be for processes sharing a server or a directory to derive
one key; it keeps tables computed for other software useless, and scrypt's cost makes each guess
of a passphrase cost an attacker the same 16 MiB and scrypt's time. A random ``bytes`` key
(or a ``token_hex(16)`` passphrase) has 128 bits of entropy and needs neither. A raw key is
hashed to 32 bytes (BLAKE2b, personalised) instead.

Purposes: one key is never used for two jobs. :func:`subkey` derives a 32-byte key per purpose
(BLAKE2b keyed with the master key over the purpose's name): record tags, encryption, server
names (so tenants with different keys use different queue and record names), disk digests.
Derivations are memoised per process (:func:`master_key`), so making many tiers with one
passphrase pays scrypt once.
"""

from __future__ import annotations

import functools
import hashlib

MIN_KEY_BYTES = 16
"""Bytes of a random key at least (128 bits)."""
MIN_PASSPHRASE_CHARS = 20
"""Characters of a passphrase at least (``secrets.token_hex(16)`` gives 32)."""
MIN_DISTINCT = 8
"""Distinct bytes or characters a secret holds at least (a random 16-byte key has about 15)."""
SCRYPT_SALT = b"kvlib tier key v1 / scrypt"
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
KEY_BYTES = 32
"""Bytes of every derived key."""
HOW_TO_MAKE_ONE = "bytes of at least 16 (os.urandom(16)) or a passphrase str of at least 20 characters (secrets.token_hex(16))"
"""What a valid secret is, for error messages."""


def check_secret(secret: object, option: str) -> None:
    """``ValueError`` naming ``option`` and what is valid unless ``secret`` is a key of at least
    128 bits or a passphrase long enough (see the module docstring); never echoes the secret."""
    if isinstance(secret, (bytes, bytearray)):
        size, distinct, unit = len(secret), len(set(secret)), "bytes"
        enough = size >= MIN_KEY_BYTES
    elif isinstance(secret, str):
        size, distinct, unit = len(secret), len(set(secret)), "characters"
        enough = size >= MIN_PASSPHRASE_CHARS
    else:
        raise ValueError(f"{option} must be {HOW_TO_MAKE_ONE}; got {type(secret).__name__}")
    if not enough:
        raise ValueError(f"{option} is too weak: {size} {unit}; a tier key is {HOW_TO_MAKE_ONE}")
    if distinct < MIN_DISTINCT:
        raise ValueError(f"{option} is too weak: only {distinct} distinct {unit}; a tier key is {HOW_TO_MAKE_ONE}")


@functools.lru_cache(maxsize=16)
def master_key(secret: str | bytes) -> bytes:
    """The 32-byte key of ``secret`` (checked with :func:`check_secret` first): a passphrase
    stretched with scrypt, a raw key hashed; memoised (scrypt runs once per passphrase and process)."""
    if isinstance(secret, str):
        return hashlib.scrypt(secret.encode(), salt=SCRYPT_SALT, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=KEY_BYTES, maxmem=64 << 20)
    return hashlib.blake2b(bytes(secret), digest_size=KEY_BYTES, person=b"kvlib raw key").digest()


def subkey(master: bytes, purpose: str) -> bytes:
    """The 32-byte key for ``purpose`` (a fixed name such as ``"remote record tag"``) under ``master``."""
    return hashlib.blake2b(purpose.encode(), key=master, digest_size=KEY_BYTES, person=b"kvlib subkey").digest()


def tier_master_key(secret: str | bytes, option: str) -> bytes:
    """``secret`` checked (``ValueError`` naming ``option``) and turned into its 32-byte master key."""
    check_secret(secret, option)
    return master_key(bytes(secret) if isinstance(secret, bytearray) else secret)
