"""tandem.weights against a local server that speaks the hub's HTTP API (HF_ENDPOINT): a revision
resolves to its commit, config.json is read alone, a model downloads once however many pods ask,
a gated model wants its token and never shows it, and an unreachable hub says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tandem.testing.cluster import free_port
from tandem.testing.fake_hub import FakeHub, Repo
from tandem.weights.cli import EXIT_PERMANENT
from tandem.weights.hub import (
    COMPLETE_MARKER,
    HubError,
    HubProblem,
    download,
    fetch_config,
    resolve_commit,
    snapshot_dir,
    wait_complete,
)

TOKEN = "hf_gated_token_that_must_never_be_printed"
TANDEM = str(Path(sys.executable).parent / "tandem")


@pytest.fixture(scope="module")
def hub(toy_model_dir):
    repos = {"tiny/llama": Repo.from_folder(toy_model_dir, refs=("main", "v1.0")),
             "tiny/gated": Repo.from_folder(toy_model_dir, token=TOKEN)}
    with FakeHub(repos) as server:
        yield server


def test_a_branch_or_tag_resolves_to_the_commit_and_a_commit_to_itself(hub):
    commit = hub.repos["tiny/llama"].commit
    for revision in ("main", "v1.0", commit):
        assert resolve_commit("tiny/llama", revision, endpoint=hub.url) == commit


@pytest.mark.parametrize(("repo", "revision", "reason"), [
    ("tiny/llama", "no-such-branch", HubProblem.REVISION_NOT_FOUND),
    ("tiny/absent", "main", HubProblem.REPO_NOT_FOUND),
    ("tiny/gated", "main", HubProblem.GATED),
])
def test_what_the_hub_refuses_has_a_reason(hub, repo, revision, reason):
    with pytest.raises(HubError) as err:
        resolve_commit(repo, revision, endpoint=hub.url)
    assert err.value.reason is reason
    assert repo in str(err.value)


def test_a_gated_model_needs_its_token_and_no_message_shows_it(hub):
    commit = resolve_commit("tiny/gated", "main", endpoint=hub.url, token=TOKEN)
    assert commit == hub.repos["tiny/gated"].commit
    with pytest.raises(HubError) as err:
        fetch_config("tiny/gated", commit, endpoint=hub.url, token="hf_wrong")
    assert err.value.reason is HubProblem.GATED and TOKEN not in str(err.value) and "hf_wrong" not in str(err.value)


def test_an_unreachable_hub_says_so(free_tcp_port):
    with pytest.raises(HubError) as err:
        resolve_commit("tiny/llama", "main", endpoint=f"http://127.0.0.1:{free_tcp_port}", timeout_s=2)
    assert err.value.reason is HubProblem.UNREACHABLE
    assert f"cannot reach http://127.0.0.1:{free_tcp_port}" in str(err.value)


def test_config_json_is_read_without_the_weights(hub, toy_model_dir):
    before = len(hub.requests)
    config = fetch_config("tiny/llama", hub.repos["tiny/llama"].commit, endpoint=hub.url)
    assert config == json.loads((toy_model_dir / "config.json").read_text())
    fetched = [r.path for r in hub.requests[before:] if r.method == "GET"]
    assert fetched and all(p.endswith("/config.json") for p in fetched), fetched


def test_a_commit_downloads_once_into_its_folder(hub, tmp_path, toy_model_dir):
    commit = hub.repos["tiny/llama"].commit
    dest = snapshot_dir(tmp_path, "tiny/llama", commit)
    assert dest == tmp_path / "tiny" / "llama" / commit
    download("tiny/llama", commit, dest, endpoint=hub.url)
    for f in toy_model_dir.rglob("*"):
        if f.is_file():
            assert (dest / f.relative_to(toy_model_dir)).read_bytes() == f.read_bytes()
    assert json.loads((dest / COMPLETE_MARKER).read_text()) == {"repo": "tiny/llama", "commit": commit}
    gets = hub.downloads("tiny/llama", "config.json")
    download("tiny/llama", commit, dest, endpoint=hub.url)
    assert hub.downloads("tiny/llama", "config.json") == gets, "a complete folder is not fetched again"


def test_pods_sharing_a_node_cache_download_once(hub, tmp_path):
    """Three `tandem model download` processes at once into one folder (init containers of three pods
    on one node): the files are fetched once, all three end complete."""
    commit = hub.repos["tiny/gated"].commit
    dest = tmp_path / "cache" / "tiny" / "gated" / commit
    env = os.environ | {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    before = hub.downloads("tiny/gated", "model.safetensors")
    procs = [subprocess.Popen([TANDEM, "model", "download", "--hub", "tiny/gated", "--revision", commit,
                               "--dest", str(dest)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert hub.downloads("tiny/gated", "model.safetensors") - before == 1
    assert all(TOKEN not in out for out in outputs)


def test_a_refused_download_exits_with_one_line_saying_why(hub, tmp_path):
    """Gated: trying again cannot help (EXIT_PERMANENT, the Job fails at once); unreachable: it may (1)."""
    env = os.environ | {"HF_ENDPOINT": hub.url}
    env.pop("HF_TOKEN", None)
    proc = subprocess.run([TANDEM, "model", "download", "--hub", "tiny/gated", "--revision", "main",
                           "--dest", str(tmp_path / "g")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_PERMANENT == 3
    assert "tiny/gated@main on" in proc.stderr and "is gated" in proc.stderr, proc.stderr
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run([TANDEM, "model", "download", "--hub", "tiny/gated", "--revision", "main",
                           "--dest", str(tmp_path / "g")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot reach" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_waiting_for_a_download_times_out_naming_the_folder(tmp_path):
    with pytest.raises(TimeoutError, match=str(tmp_path)):
        wait_complete(tmp_path, timeout_s=0.3, poll_s=0.1)
    (tmp_path / COMPLETE_MARKER).write_text("{}")
    wait_complete(tmp_path, timeout_s=0.3, poll_s=0.1)


@pytest.fixture
def free_tcp_port() -> int:
    from tandem.worker.local.processes import free_port

    return free_port()
