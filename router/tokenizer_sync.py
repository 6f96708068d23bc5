"""The router's copy of the workers' tokenizer, and the token ids it sends them.

Where it comes from (`tokenizer` setting): `workers` (the default) fetches GET /internal/tokenizer
from a ready worker, so a router pod needs no model volume; `off` never tokenizes; a folder loads
the files there, and is trusted as configured (the workers' digests are of the files their
tokenizer saves, which need not be byte-equal to a model folder's). With `workers`, every poll
checks the workers' `tokenizer_sha256`: the router tokenizes only while every ready worker that
reports one reports the digest of the files it loaded (after a rollout that changed the
tokenizer it loads the new one). Tokenized, a request reaches the workers
as `prompt_token_ids` (every worker sees the same ids), and its size is exact where the router
decides: `maxPromptTokens` is refused before any worker computes, the short-prompt bypass and
prefix-aware routing count real tokens.

Degraded (no tokenizer yet, a load failure, workers that disagree, `off`): requests go out as
`prompt`/`messages` for the workers to tokenize, sizes are estimated (characters / 4),
`maxPromptTokens` is checked once a worker tokenized the prompt, and prefix-aware routing has no
ids to match (it balances load). Each change of state is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tandem.contracts.tokenizer_files import TOKENIZER_FILES, TokenizerFiles, tokenizer_digest
from tandem.router.policies.base import WorkerView
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.validation import ParsedRequest

log = logging.getLogger("tandem.router.tokenizer")

WORKERS, OFF = "workers", "off"
INLINE_CHARS = 16_384  # longer prompts are tokenized off the event loop
MESSAGE_CHARS = 64  # what one chat message counts for in that size, content aside (its template work)
POLLS_BEFORE_WARNING = 10  # a worker reports its digest a poll or two after it is ready
DEGRADED = ("requests go to the workers as text, token counts are estimates, maxPromptTokens is "
            "checked once a worker tokenized the prompt, prefix-aware routing balances load only")


class TokenizerClient(Protocol):
    async def tokenizer(self, url: str) -> TokenizerFiles:
        """GET /internal/tokenizer; raises WorkerFailed."""
        ...


def read_dir(path: str | Path) -> TokenizerFiles:
    path = Path(path)
    files = {n: (path / n).read_text(encoding="utf-8") for n in TOKENIZER_FILES if (path / n).is_file()}
    return TokenizerFiles(tokenizer_digest(files), files)


class TokenizerSync:
    def __init__(self, client: TokenizerClient, source: str = WORKERS) -> None:
        self.client = client
        self.source = source
        self.tokenizer: RouterTokenizer | None = None
        self.sha256 = ""
        self.active = False  # tokenize requests: loaded, and no ready worker disagrees
        self._why = "no tokenizer loaded yet"
        self._task: asyncio.Task | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._polls_without = 0  # polls in a row with ready workers but no digest

    def load_dir(self) -> None:
        """`source` is a folder: load it now (at start-up; a broken folder is a configuration error)."""
        files = read_dir(self.source)
        self.tokenizer, self.sha256 = RouterTokenizer.from_files(files.files), files.sha256
        self._set_active(True, f"loaded from {self.source}")

    def _set_active(self, active: bool, why: str) -> None:
        if active != self.active or (not active and why != self._why):
            if active:
                log.info("tokenizing requests in the router (sha256 %s, %s)", self.sha256[:16], why)
            else:
                log.warning("not tokenizing in the router: %s; %s", why, DEGRADED)
        self.active, self._why = active, why

    def refresh(self, views: Sequence[WorkerView]) -> None:
        """After each poll: check the ready workers' digests; start loading theirs if it is new."""
        if self.source != WORKERS:
            return
        ready = [v for v in views if v.ready and v.tokenizer_sha256]
        digests = {v.tokenizer_sha256 for v in ready}
        if not digests:  # nothing to compare with: keep what we have
            self._polls_without += any(v.ready for v in views)
            if self._polls_without == POLLS_BEFORE_WARNING and not self.active:
                self._set_active(False, "no ready worker offers its tokenizer (an older worker?)")
            return
        self._polls_without = 0
        if len(digests) > 1:
            self._set_active(False, f"the ready workers serve {len(digests)} different tokenizers")
            return
        digest = digests.pop()
        if digest == self.sha256:
            self._set_active(True, "every ready worker serves it")
            return
        if self.sha256:
            self._set_active(False, "the workers serve another tokenizer now")
        if self._task is None and time.monotonic() >= self._retry_at:
            log.info("fetching the served model's tokenizer from %s", ready[0].url)
            self._task = asyncio.get_running_loop().create_task(self._load(ready[0].url, digest))

    async def _load(self, url: str, digest: str) -> None:
        try:
            files = await self.client.tokenizer(url)
            if files.sha256 != digest:
                raise ValueError("the worker's tokenizer changed while the router fetched it")
            tokenizer = await asyncio.to_thread(RouterTokenizer.from_files, files.files)
        except Exception as exc:  # noqa: BLE001 - a fetch or a broken file fails in many ways, all the same here
            self._failures += 1
            self._retry_at = time.monotonic() + min(60.0, 2.0 ** self._failures)
            self._set_active(False, f"cannot load the tokenizer from {url}: {exc}")
        else:
            self.tokenizer, self.sha256, self._failures = tokenizer, digest, 0
            self._set_active(True, f"fetched from {url}")
        finally:
            self._task = None

    async def wait_loaded(self, timeout_s: float) -> None:
        """Until a load in progress ends, at most `timeout_s` (start-up, when a worker is already ready)."""
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=timeout_s)

    async def token_ids(self, req: ParsedRequest) -> list[int] | None:
        """The prompt's token ids as the workers would make them; None when the router does not
        tokenize (or the client sent ids). Raises ChatTemplateError for messages the template refuses."""
        if not self.active or self.tokenizer is None or req.prompt_token_ids is not None:
            return None
        tok = self.tokenizer
        if req.messages is not None:  # each message costs template work, even an empty one
            size = sum(len(m.get("content") or "") + MESSAGE_CHARS for m in req.messages)
            args: tuple = (req.messages, req.chat_options)
            encode: Any = tok.encode_chat
        else:
            size, encode, args = len(req.prompt or ""), tok.encode_prompt, (req.prompt or "",)
        if size <= INLINE_CHARS:
            return encode(*args)
        return await asyncio.to_thread(encode, *args)
