"""A KVSource may carry one digest per block and KV head (issue 28 item 11): the decode side (each of
its ranks, for the heads it holds) recomputes them over the blocks it wrote and recomputes the prompt
when they differ. The contract keeps the digests in step with the blocks: one per block and head,
block-major, named by an algorithm, narrowed with the blocks when the decode side pulls only those
its prefix cache lacks, and absent from old sources."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tandem.contracts.kv_source import DIGEST_ALGORITHMS, KVSource


def _source(**kw) -> KVSource:
    base = dict(url="http://p", engine_id="p-1", backend="tcp", block_ids=[7, 3, 9], num_tokens=40,
                lease_token="t")
    return KVSource(**(base | kw))


def test_a_source_without_digests_is_what_it_was():
    src = _source()
    assert src.block_digests == [] and src.digest_algorithm == ""
    assert not src.has_digests


def test_digests_cross_a_process_boundary_unchanged():
    src = _source(digest_algorithm="crc32", digest_heads=1, block_digests=[1, 2**32 - 1, 0])
    again = KVSource(**json.loads(json.dumps(dataclasses.asdict(src))))
    assert again == src and again.has_digests


def test_wsum64_digests_use_all_64_bits():
    src = _source(digest_algorithm="wsum64", digest_heads=1, block_digests=[2**64 - 1, 0, 12345])
    assert KVSource(**json.loads(json.dumps(dataclasses.asdict(src)))).block_digests[0] == 2**64 - 1


@pytest.mark.parametrize(("kw", "words"), [
    ({"digest_algorithm": "crc32", "digest_heads": 1, "block_digests": [1, 2]}, "one digest per block"),
    ({"digest_algorithm": "crc32", "digest_heads": 1, "block_digests": [1, 2, 3, 4]}, "one digest per block"),
    ({"digest_algorithm": "crc32", "digest_heads": 2, "block_digests": [1, 2, 3]}, "one digest per block"),
    ({"digest_algorithm": "crc32", "block_digests": [1, 2, 3]}, "digest_heads"),
    ({"digest_algorithm": "crc32", "digest_heads": 0, "block_digests": [1, 2, 3]}, "digest_heads"),
    ({"digest_algorithm": "", "digest_heads": 1, "block_digests": [1, 2, 3]}, "algorithm"),
    ({"digest_algorithm": "md5", "digest_heads": 1, "block_digests": [1, 2, 3]}, "algorithm"),
    ({"digest_algorithm": "crc32", "digest_heads": 1, "block_digests": []}, "one digest per block"),
    ({"digest_algorithm": "crc32", "digest_heads": 1, "block_digests": [1, -2, 3]}, "unsigned"),
    ({"digest_algorithm": "crc32", "digest_heads": 1, "block_digests": [1, 2**32, 3]}, "unsigned"),
    ({"digest_algorithm": "wsum64", "digest_heads": 1, "block_digests": [1, 2**64, 3]}, "unsigned"),
    ({"digest_algorithm": "crc32", "digest_heads": 1, "block_digests": [1, True, 3]}, "unsigned"),
])
def test_digests_that_cannot_describe_the_blocks_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        _source(**kw)


def test_the_known_algorithms():
    assert set(DIGEST_ALGORITHMS) == {"crc32", "wsum64"}


def test_narrowing_to_the_blocks_pulled_keeps_their_digests():
    src = _source(digest_algorithm="crc32", digest_heads=2, block_digests=[11, 21, 12, 22, 13, 23])
    rest = src.without_leading_blocks(2, block_size=16)
    assert (rest.block_ids, rest.num_tokens, rest.block_digests) == ([9], 8, [13, 23])
    assert rest.digest_algorithm == "crc32" and rest.lease_token == "t"
    assert src.block_ids == [7, 3, 9], "the original is left as it was"
    assert src.without_leading_blocks(0, block_size=16) == src


def test_narrowing_a_source_without_digests():
    rest = _source().without_leading_blocks(1, block_size=16)
    assert (rest.block_ids, rest.num_tokens, rest.block_digests) == ([3, 9], 24, [])
