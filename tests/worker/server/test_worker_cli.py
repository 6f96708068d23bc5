"""`tandem worker` as a real process: flags and a --config YAML, /health before /ready, a streamed
generation, JSON logs with the request id, a clean exit on SIGTERM; bad settings exit non-zero
with a message."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tandem.worker.local.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _tandem() -> list[str]:
    return [sys.executable, "-m", "tandem.cli.main"]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _hub_cache(toy_model_dir: Path, hf_home: Path, repo: str) -> None:
    """Lay the toy model out as the Hugging Face hub cache would after a download of `repo`."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in toy_model_dir.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, snap / f.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)


def test_worker_process_serves_and_stops(toy_model_dir: Path, tmp_path: Path):
    """Also loads the model by hub id from HF_HOME's cache, as a pod without the folder would."""
    port = free_port()
    _hub_cache(toy_model_dir, tmp_path / "hf", "tandem-test/toy-llama")
    cfg = tmp_path / "worker.yaml"
    cfg.write_text("model: tandem-test/toy-llama\nrole: colocated\nnum-blocks: 64\nblock_size: 8\n"
                   "threads: 1\nmax_num_seqs: 4\nmax_batched_tokens: 64\nserved_name: toy-from-config\n")
    log = (tmp_path / "worker.log").open("w+")
    env = dict(os.environ, POD_NAME="pod-a", TANDEM_KV_COMPAT="kv-7", HF_HOME=str(tmp_path / "hf"),
               HF_HUB_OFFLINE="1")
    env.pop("TANDEM_INTERNAL_SECRET", None)
    proc = subprocess.Popen(
        [*_tandem(), "worker", "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
         "--log-format", "json"], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while _get(f"{base}/ready") != 200:
            assert proc.poll() is None, f"worker exited: {Path(log.name).read_text()}"
            assert time.monotonic() < deadline, "worker not ready in 120 s"
            time.sleep(0.2)
        assert _get(f"{base}/health") == 200
        with urllib.request.urlopen(f"{base}/internal/info", timeout=5) as r:
            info = json.load(r)
        assert info["model"] == "toy-from-config" and info["kv_compat"] == "kv-7"
        assert info["engine_id"].startswith("pod-a-") and info["kv_blocks_total"] == 64
        req = urllib.request.Request(
            f"{base}/internal/generate", method="POST",
            data=json.dumps({"request_id": "cli-1", "prompt": "Hello",
                             "sampling": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            events = [json.loads(line) for line in r.read().decode().splitlines()]
        assert events[-1]["type"] == "finish" and events[-1]["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(x) for x in Path(log.name).read_text().splitlines() if x.startswith("{")]
    assert any(x.get("request_id") == "cli-1" and x["message"] == "generate finished" for x in lines)
    # No internal secret in this worker's environment: it serves, and says at start-up that it is open.
    assert any(x["level"] == "warning" and x["message"].startswith("no internal secret") for x in lines)


def test_unknown_config_key_exits_2(tmp_path: Path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: /nowhere\nmax_seqs: 4\n")
    r = subprocess.run([*_tandem(), "worker", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown setting 'max_seqs'" in r.stderr


def test_missing_model_exits_1_with_a_message(tmp_path: Path):
    r = subprocess.run([*_tandem(), "worker", "--model", str(tmp_path / "none"), "--host", "127.0.0.1",
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "no Hugging Face model at" in r.stderr


def test_internal_secret_on_argv_exits_2():
    r = subprocess.run([*_tandem(), "worker", "--model", "/m", "--internal-secret", "x" * 32],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "never a flag" in r.stderr
