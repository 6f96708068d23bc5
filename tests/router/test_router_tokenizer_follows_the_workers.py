"""Where the router's tokenizer comes from and when it is used (TokenizerSync, with an in-process
stand-in for the workers' GET /internal/tokenizer): fetched from a ready worker whose digest it
matches, used only while every ready worker agrees, reloaded after a rollout changes it, retried
later after a failed fetch, never with `off`, and from a folder without asking the workers."""

from __future__ import annotations

import pytest
from tandem.contracts.names import Role
from tandem.contracts.tokenizer_files import TokenizerFiles, tokenizer_digest
from tandem.router.policies.base import WorkerView
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.tokenizer_sync import OFF, TokenizerSync, read_dir
from tandem.router.validation import Endpoint, Limits, parse_request
from tandem.router.worker_client import WorkerFailed

CHAT = [{"role": "user", "content": "Hello there, router"}]


class Workers:
    """Each worker URL serves some TokenizerFiles, or fails; every fetch is recorded."""

    def __init__(self, served: dict[str, TokenizerFiles | Exception]) -> None:
        self.served = served
        self.fetched: list[str] = []

    async def tokenizer(self, url: str) -> TokenizerFiles:
        self.fetched.append(url)
        answer = self.served[url]
        if isinstance(answer, Exception):
            raise answer
        return answer


def view(url: str, digest: str, ready: bool = True) -> WorkerView:
    return WorkerView(url=url, role=Role.DECODE, ready=ready, tokenizer_sha256=digest)


def chat_request():
    return parse_request({"model": "m", "messages": CHAT}, Endpoint.CHAT, Limits())


@pytest.fixture(scope="module")
def files(toy_model_dir) -> TokenizerFiles:
    return read_dir(toy_model_dir)


@pytest.fixture(scope="module")
def other(files) -> TokenizerFiles:
    """Another tokenizer: the same vocabulary with another chat template."""
    changed = dict(files.files) | {"chat_template.jinja": "{% for m in messages %}{{ m['content'] }}|{% endfor %}"}
    return TokenizerFiles(tokenizer_digest(changed), changed)


async def settle(sync: TokenizerSync) -> None:
    await sync.wait_loaded(30)


async def test_fetched_from_a_ready_worker_and_used_while_all_agree(files, other):
    workers = Workers({"w1": files, "w2": files})
    sync = TokenizerSync(workers)
    assert await sync.token_ids(chat_request()) is None  # nothing loaded yet: the workers tokenize
    sync.refresh([view("w0", files.sha256, ready=False), view("w1", files.sha256), view("w2", "")])
    await settle(sync)
    assert sync.active and workers.fetched == ["w1"]
    want = RouterTokenizer.from_files(files.files).encode_chat(CHAT)
    assert await sync.token_ids(chat_request()) == want
    sync.refresh([view("w1", files.sha256), view("w2", other.sha256)])  # a worker disagrees
    assert not sync.active and await sync.token_ids(chat_request()) is None
    sync.refresh([view("w1", files.sha256), view("w2", files.sha256)])
    assert sync.active and workers.fetched == ["w1"]  # agreement again: nothing to fetch


async def test_a_rollout_that_changes_the_tokenizer_loads_the_new_one(files, other):
    workers = Workers({"old": files, "new": other})
    sync = TokenizerSync(workers)
    sync.refresh([view("old", files.sha256)])
    await settle(sync)
    sync.refresh([view("old", files.sha256, ready=False), view("new", other.sha256)])
    assert not sync.active  # the old tokenizer is not used for the new workers while the new one loads
    await settle(sync)
    assert sync.active and sync.sha256 == other.sha256 and workers.fetched == ["old", "new"]
    assert await sync.token_ids(chat_request()) == RouterTokenizer.from_files(other.files).encode_chat(CHAT)


async def test_a_failed_fetch_is_retried_later_not_at_every_poll(files):
    workers = Workers({"w1": WorkerFailed("connection refused", dead=False)})
    sync = TokenizerSync(workers)
    sync.refresh([view("w1", files.sha256)])
    await settle(sync)
    assert not sync.active and workers.fetched == ["w1"]
    sync.refresh([view("w1", files.sha256)])
    assert sync._task is None and workers.fetched == ["w1"]  # backing off: no new fetch
    sync._retry_at = 0.0  # the back-off is over
    workers.served["w1"] = files
    sync.refresh([view("w1", files.sha256)])
    await settle(sync)
    assert sync.active


async def test_files_that_do_not_match_the_advertised_digest_are_not_used(files, other):
    sync = TokenizerSync(Workers({"w1": other}))
    sync.refresh([view("w1", files.sha256)])
    await settle(sync)
    assert not sync.active and sync.tokenizer is None


async def test_off_never_tokenizes_and_a_folder_needs_no_worker(files, toy_model_dir):
    workers = Workers({"w1": files})
    off = TokenizerSync(workers, OFF)
    off.refresh([view("w1", files.sha256)])
    await settle(off)
    assert not off.active and workers.fetched == []
    folder = TokenizerSync(workers, str(toy_model_dir))
    folder.load_dir()
    folder.refresh([view("w1", "another-digest")])
    assert folder.active and workers.fetched == []
