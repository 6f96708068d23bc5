"""`tandem up --model org/name[@revision]`: the hub id is downloaded once into the Hugging Face cache
and served; offline, a cached copy is served, and without one the message says what to do. Against a
local server that speaks the hub's HTTP API (HF_ENDPOINT)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest
from tandem.testing.fake_hub import FakeHub, Repo
from tandem.testing.local_stack import LocalStack
from tandem.weights.hub import HubError, HubProblem
from tandem.weights.local import is_hub_id, model_folder
from tandem.worker.local.processes import free_port

TANDEM = str(Path(sys.executable).parent / "tandem")


@pytest.fixture
def hub(toy_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with FakeHub({"tiny/llama": Repo.from_folder(toy_model_dir, refs=("main", "v1"))}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def test_a_folder_stays_a_folder_and_a_hub_id_is_downloaded_once(hub, toy_model_dir, monkeypatch):
    assert model_folder(str(toy_model_dir)) == toy_model_dir and not is_hub_id(str(toy_model_dir))
    folder = model_folder("tiny/llama@v1")
    assert folder.name == hub.repos["tiny/llama"].commit
    assert (folder / "config.json").read_bytes() == (toy_model_dir / "config.json").read_bytes()
    fetched = hub.downloads("tiny/llama", "model.safetensors")
    assert model_folder("tiny/llama") == folder
    assert hub.downloads("tiny/llama", "model.safetensors") == fetched, "the cache serves the second time"
    # Offline now: the cached copy is served.
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    assert model_folder("tiny/llama") == folder


def test_offline_without_a_cached_copy_says_what_to_do(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(HubError) as err:
        # (huggingface_hub reads HF_HOME once per process: a repo no test here downloaded)
        model_folder("tiny/never-downloaded")
    assert err.value.reason is HubProblem.UNREACHABLE
    assert "looks offline" in str(err.value) and "--model DIR" in str(err.value)
    proc = subprocess.run([TANDEM, "up", "--model", "tiny/llama", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "tandem up: cannot reach http://127.0.0.1:" in proc.stderr and "HF_ENDPOINT" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.e2e
def test_tandem_up_serves_a_hub_id(hub):
    with LocalStack(Path("tiny/llama"), mode="colocated") as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny/llama"], "served by its hub id"
        answer = client.completions.create(model="tiny/llama", prompt="Hello", max_tokens=4, temperature=0)
        assert answer.choices[0].text
    assert hub.downloads("tiny/llama", "model.safetensors") == 1
