"""The tokenizer a worker serves (GET /internal/tokenizer) so the router tokenizes as the workers do:
which files, and the digest that names them (WorkerInfo.tokenizer_sha256)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

# The files a router needs to tokenize as a worker does (tandem.router.tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_digest(files: dict[str, str]) -> str:
    """SHA-256 over the files' names and texts: equal digests mean the same tokenizer and template."""
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name].encode()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@dataclass
class TokenizerFiles:
    """GET /internal/tokenizer: names in TOKENIZER_FILES -> their text, and their tokenizer_digest."""

    sha256: str
    files: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenizerFiles:
        files = d.get("files")
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in files.items()):
            raise ValueError("tokenizer files must be an object of file name -> text")
        sha = d.get("sha256")
        if sha != tokenizer_digest(files):
            raise ValueError("tokenizer files do not match their sha256")
        return cls(sha, dict(files))
