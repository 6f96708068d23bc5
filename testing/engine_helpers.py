"""Small helpers for driving a tandem Engine from tests and benchmarks (no HTTP)."""

from __future__ import annotations

from typing import Any

from tandem.contracts.protocol import GenerateRequest
from tandem.contracts.sampling import SamplingParams


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


def submit(engine: Any, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[Any]:
    """Add a request to a (synchronous) Engine; returns the list its outputs are appended to."""
    outs: list[Any] = []
    seq = engine.make_sequence(GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=params))
    seq.sink = outs.append
    engine.add(seq)
    return outs


def run_to_completion(engine: Any, max_steps: int = 10_000) -> int:
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps > max_steps:
            raise RuntimeError("engine did not finish")
    return steps


class OfflineEngine:
    """Tandem's engine in this process, without HTTP, recording every step's (seconds, tokens): the
    one driver of the benchmarks that time the engine itself and of `tandem plan`'s calibration.
    Give an EngineConfig's fields, and `loaded` to reuse a model already in memory."""

    def __init__(self, *, loaded: Any = None, **config: Any) -> None:
        from tandem.worker.engine.config import EngineConfig
        from tandem.worker.engine.engine import Engine

        self.steps: list[tuple[float, int]] = []
        self.engine = Engine(EngineConfig(**config), loaded=loaded, on_step=lambda s, n: self.steps.append((s, n)))

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> list[Any]:
        """A greedy request that runs exactly max_tokens (EOS ignored); the list its outputs go to."""
        return submit(self.engine, request_id, prompt_ids, greedy(max_tokens))

    def run(self) -> list[tuple[float, int]]:
        """Steps until nothing is left to do: the (seconds, tokens) of each step this call ran."""
        first = len(self.steps)
        run_to_completion(self.engine)
        return self.steps[first:]

    def generate(self, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
        """Every prompt at once, to the end: the tokens of each."""
        outs = [self.submit(f"{tag}-{i}", p, max_tokens) for i, p in enumerate(prompts)]
        self.run()
        return [tokens_of(o) for o in outs]


def tokens_of(outs: list[Any]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def text_of(outs: list[Any]) -> str:
    return "".join(o.text for o in outs)


def reference_generate(hf_model: Any, prompt_ids: list[int], max_new_tokens: int, *, pad_token_id: int = 0,
                       ignore_eos: bool = True) -> list[int]:
    """transformers' greedy generate for one prompt, alone (no padding): the tests' ground truth."""
    import torch

    ids = torch.tensor([prompt_ids])
    kw = {"eos_token_id": None, "min_new_tokens": max_new_tokens} if ignore_eos else {}
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=pad_token_id, **kw)
    return out[0, len(prompt_ids):].tolist()


async def ndjson_events(resp: Any) -> list[dict[str, Any]]:
    """All NDJSON lines of an aiohttp response from /internal/generate, parsed."""
    import json

    events = []
    async for line in resp.content:
        if line.strip():
            events.append(json.loads(line))
    return events


async def events_until(resp: Any, after_tokens: int, action: Any) -> list[dict[str, Any]]:
    """All NDJSON events of a /internal/generate stream; `action()` is called once, as soon as
    `after_tokens` tokens have arrived (a drain, a kill: what the stream should live through)."""
    import json

    events: list[dict[str, Any]] = []
    done = False
    async for line in resp.content:
        if not line.strip():
            continue
        events.append(json.loads(line))
        if not done and len(stream_tokens(events)) >= after_tokens:
            action()
            done = True
    return events


def stream_tokens(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events if e["type"] == "token" for t in e.get("token_ids", [])]


def stream_text(events: list[dict[str, Any]]) -> str:
    return "".join(e.get("text", "") for e in events if e["type"] == "token")


def check_blocks_accounted(engine: Any) -> None:
    """The KV pool's books balance: every block's reference count equals the block tables (running,
    waiting, leased) that hold it; in use + cached-free + never-cached-free = total; a block two
    tables share is a cached block named by the same prefix hash in both (so an evicted block,
    which loses its name, is in no table)."""
    alloc = engine.allocator
    holders: dict[int, list[Any]] = {}
    seqs = list(engine.seqs.values()) + [lease.seq for lease in engine.leases.values()]
    for seq in seqs:
        for i, b in enumerate(seq.block_table):
            holders.setdefault(b, []).append((seq, i))
    for b in range(alloc.num_blocks):
        held = holders.get(b, [])
        assert alloc.refcount(b) == len(held), f"block {b}: refcount {alloc.refcount(b)}, {len(held)} holders"
        if len(held) > 1:
            for seq, i in held:
                assert i < len(seq.block_hashes) and alloc.hash_of(b) == seq.block_hashes[i], \
                    f"block {b} shared by {seq.request_id} at {i} without its prefix hash"
    plain_free = alloc.num_free - alloc.num_cached_free
    assert alloc.num_used + alloc.num_cached_free + plain_free == alloc.num_blocks
    assert alloc.num_used == sum(1 for b in range(alloc.num_blocks) if alloc.refcount(b) > 0)
    assert alloc.num_cached_free == sum(1 for b in range(alloc.num_blocks)
                                        if alloc.refcount(b) == 0 and alloc.hash_of(b) is not None)
