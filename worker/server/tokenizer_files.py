"""GET /internal/tokenizer: the served model's tokenizer and chat template, for the router.

The files are what this worker's own tokenizer writes with `save_pretrained`, so they are what it
tokenizes with, whatever the model came from (a folder, a hub cache, a slow tokenizer converted to
a fast one). They are exported once, off the event loop; /internal/info carries their digest
(`tokenizer_sha256`, "" until the export finished) so the router can check that every worker
serves the same before it sends them token ids.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web
from tandem.contracts.protocol import openai_error
from tandem.contracts.tokenizer_files import TOKENIZER_FILES, TokenizerFiles, tokenizer_digest

log = logging.getLogger("tandem.worker.server")


def export_tokenizer(tokenizer: Any) -> TokenizerFiles:
    """The TOKENIZER_FILES a transformers tokenizer saves; ValueError without a fast tokenizer."""
    with tempfile.TemporaryDirectory(prefix="tandem-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {name: (Path(tmp) / name).read_text(encoding="utf-8") for name in TOKENIZER_FILES
                 if (Path(tmp) / name).is_file()}
    if "tokenizer.json" not in files:
        raise ValueError("this model's tokenizer has no fast (tokenizers) form, so the router cannot load it")
    return TokenizerFiles(tokenizer_digest(files), files)


class TokenizerExport:
    """The export of one worker's tokenizer: started by the first reader once the engine is loaded."""

    def __init__(self, state: Any) -> None:
        self._state = state  # WorkerState: its engine appears once the model is loaded
        self._task: asyncio.Task[TokenizerFiles] | None = None

    def _tokenizer(self) -> Any | None:
        engine = self._state.engine.engine if self._state.engine is not None and self._state.ready else None
        return getattr(engine, "tokenizer", None)

    def _start(self) -> asyncio.Task[TokenizerFiles] | None:
        if self._task is None and (tok := self._tokenizer()) is not None:
            self._task = asyncio.get_running_loop().create_task(asyncio.to_thread(export_tokenizer, tok))
            self._task.add_done_callback(self._logged)
        return self._task

    @staticmethod
    def _logged(task: asyncio.Task[TokenizerFiles]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("cannot export the tokenizer for the router: %s", task.exception())
        else:
            log.info("tokenizer exported for the router (sha256 %s)", task.result().sha256[:16])

    def digest(self) -> str:
        """The files' digest once exported, else "" (and the export starts, if it can)."""
        task = self._start()
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return ""
        return task.result().sha256

    async def files(self) -> TokenizerFiles | None:
        """The files (None before the model is loaded); raises what the export raised."""
        task = self._start()
        return None if task is None else await asyncio.shield(task)


EXPORT_KEY: web.AppKey[TokenizerExport] = web.AppKey("tandem_tokenizer_export", TokenizerExport)


def digest(app: web.Application) -> str:
    """For /internal/info: what `tokenizer_sha256` says."""
    return app[EXPORT_KEY].digest()


async def tokenizer(request: web.Request) -> web.Response:
    try:
        files = await request.app[EXPORT_KEY].files()
    except ValueError as e:
        return web.json_response(openai_error(str(e), "not_found", None, "no_fast_tokenizer"), status=404)
    if files is None:
        return web.json_response(openai_error("the model is still loading", "service_unavailable", None,
                                              "not_ready"), status=503)
    return web.json_response(files.to_dict(), headers={"ETag": f'"{files.sha256}"'})


def add_routes(app: web.Application, state: Any) -> None:
    app[EXPORT_KEY] = TokenizerExport(state)
    app.router.add_get("/internal/tokenizer", tokenizer)
