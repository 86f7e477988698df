"""Tier keys: weak secrets refused with a message naming what is valid (never the secret), strong
ones turned into one 32-byte key per purpose; a passphrase is stretched with scrypt."""

from __future__ import annotations

import hashlib
import os
import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlib.storage.tiers.tier_keys import SCRYPT_N, SCRYPT_R, SCRYPT_SALT, check_secret, subkey, tier_master_key


@pytest.mark.parametrize(
    "weak", ["team", "password1234", "a" * 40, "abababababababababababab", b"short", b"\0" * 16, b"0123456789abcde", 42, None]
)
def test_weak_or_wrong_secrets_are_refused_naming_what_is_valid(weak: object) -> None:
    with pytest.raises(ValueError, match=r"remote_key .*os\.urandom\(16\).*secrets\.token_hex\(16\)") as refused:
        check_secret(weak, "remote_key")
    if isinstance(weak, (str, bytes)):
        assert str(weak) not in str(refused.value) and repr(weak) not in str(refused.value)


def test_strong_secrets_give_one_key_per_purpose() -> None:
    raw, phrase = os.urandom(16), secrets.token_hex(16)
    for secret in (raw, bytearray(raw), phrase, "correct horse battery staple 42"):
        master = tier_master_key(secret, "key")
        assert len(master) == 32 and subkey(master, "a") != subkey(master, "b") and len(subkey(master, "a")) == 32
    assert tier_master_key(raw, "key") == tier_master_key(bytearray(raw), "key") != tier_master_key(os.urandom(16), "key")
    stretched = hashlib.scrypt(phrase.encode(), salt=SCRYPT_SALT, n=SCRYPT_N, r=SCRYPT_R, p=1, dklen=32, maxmem=64 << 20)
    assert tier_master_key(phrase, "key") == stretched  # scrypt, not a fast hash of the passphrase


@given(st.binary(min_size=16, max_size=64).filter(lambda key: len(set(key)) >= 8), st.binary(min_size=16, max_size=64))
def test_distinct_raw_keys_never_share_a_subkey(first: bytes, second: bytes) -> None:
    if len(set(second)) < 8:
        with pytest.raises(ValueError):
            tier_master_key(second, "key")
        return
    same = subkey(tier_master_key(first, "key"), "remote record tag") == subkey(tier_master_key(second, "key"), "remote record tag")
    assert same == (first == second)
