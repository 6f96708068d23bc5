"""The prefix-cache block hash: equal hashes exactly when the token prefixes are equal."""

from __future__ import annotations

import pytest
from tandem.contracts.prefix import HASH_BYTES, block_hashes


def test_one_hash_per_full_block_only():
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(16)), 16)) == 1
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert all(len(h) == HASH_BYTES for h in block_hashes(list(range(64)), 16))


def test_a_block_hash_names_its_whole_prefix():
    a = block_hashes([1] * 16 + [2] * 16, 16)
    b = block_hashes([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same second block, different first: different names
    assert block_hashes([1] * 16 + [2] * 16 + [9] * 5, 16) == a  # a partial tail is never named
    assert block_hashes([1] * 16 + [2] * 16 + [9] * 16, 16)[:2] == a  # extending keeps the prefix names


def test_salt_and_block_size_separate_caches():
    ids = list(range(32))
    assert block_hashes(ids, 16, salt=b"model-a") != block_hashes(ids, 16, salt=b"model-b")
    assert block_hashes(ids, 16)[0] != block_hashes(ids, 8)[1]
    with pytest.raises(ValueError):
        block_hashes(ids, 0)


def test_large_token_ids_are_hashed_exactly():
    assert block_hashes([2**40] * 4, 4) != block_hashes([2**40 + 1] * 4, 4)
