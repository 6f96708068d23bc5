"""Issue 29's bench arms: Tandem on vLLM (disaggregated, colocated) planned as `tandem up --runtime vllm`
plans them, skipped with vLLM, compared with vLLM's engine only and held to issue 29's targets."""

import pytest

from bench.lib import peers
from bench.lib.arms import CATALOG, DEFAULT_ARMS, Arm, peers_or_skip
from bench.lib.interference_report import all_targets
from bench.scenarios.interference import by_runtime
from tests.bench.test_report_tables import _run


def test_the_vllm_arms_plan_vllm_servers_on_their_cores_behind_the_router_in_vllm_mode(tmp_path):
    disagg = Arm(CATALOG["tandem-vllm-disagg-bf16"], tmp_path / "model", tmp_path)
    disagg.plan_processes()
    assert [(p.name, p.role, p.cpu) for p in disagg.procs] == [("prefill", "prefill", 0), ("decode", "decode", 1),
                                                               ("router", "router", None)]
    for w in disagg.workers:
        assert w.cmd[w.cmd.index("worker") + 1:][:4] == ["--runtime", "vllm", "--role", w.role]
        assert w.cmd[w.cmd.index("--threads") + 1] == "1" and w.cmd[-2:] == ["--dtype", "bfloat16"]
        assert w.cmd[w.cmd.index("--served-name") + 1] == "model" and w.env["VLLM_CPU_KVCACHE_SPACE"] == peers.KV_GIB
        assert isinstance(w, peers.VllmServerProcess)  # ready on /health
    r = disagg.router.cmd
    assert r[r.index("router") + 1:][:2] == ["--runtime", "vllm"] and "--no-parity-probe" not in r  # probed, as ours
    assert r[r.index("--prefill") + 1] == disagg.workers[0].url and r[r.index("--decode") + 1] == disagg.workers[1].url
    assert r.count("--kv-events") == 2 and r[r.index("--tokenizer") + 1] == str(tmp_path / "model")
    colo = Arm(CATALOG["tandem-vllm-colo-bf16"], tmp_path / "model", tmp_path)
    colo.plan_processes()
    assert [(p.role, p.cpu) for p in colo.procs] == [("colocated", 0), ("router", None)]  # the peer's engine core
    assert "--prefill" not in colo.router.cmd and colo.router.cmd.count("--decode") == 1
    assert {"tandem-vllm-disagg-bf16", "tandem-vllm-colo-bf16"} <= set(DEFAULT_ARMS)
    free = Arm(CATALOG["tandem-vllm-disagg-free-bf16"], tmp_path / "model", tmp_path)
    free.plan_processes()  # the peer's layout per server: engine threads bound, the process not pinned
    assert [(p.cpu, p.env.get("VLLM_CPU_OMP_THREADS_BIND")) for p in free.workers] == [(None, "0"), (None, "1")]
    hop = Arm(CATALOG["tandem-vllm-colo-free-bf16"], tmp_path / "model", tmp_path)
    hop.plan_processes()  # the peer's layout behind the router
    assert [(p.role, p.cpu, p.env.get("VLLM_CPU_OMP_THREADS_BIND")) for p in hop.workers] == [("colocated", None, "0")]


def test_vllm_arms_are_skipped_where_vllm_is_not_installable(monkeypatch):
    monkeypatch.setattr(peers, "available", lambda: "no vLLM here")
    specs = [CATALOG[n] for n in ("disagg-bf16", "vllm-bf16", "tandem-vllm-disagg-bf16")]
    keep, skipped = peers_or_skip(specs)
    assert [s.name for s in keep] == ["disagg-bf16"] and set(skipped) == {"vllm-bf16", "tandem-vllm-disagg-bf16"}


def test_each_runtime_is_compared_within_itself_and_the_vllm_arm_has_issue_29s_targets():
    names = ("disagg-bf16", "colo2-c128-bf16", "vllm-bf16", "tandem-vllm-disagg-bf16", "tandem-vllm-colo-bf16")
    arms = {n: {"dtype": "bfloat16", "peer": CATALOG[n].peer, "runtime": CATALOG[n].runtime,
                "disaggregated": CATALOG[n].disaggregated} for n in names}
    gaps = {"disagg-bf16": 0.02, "colo2-c128-bf16": 0.04, "vllm-bf16": 0.03, "tandem-vllm-disagg-bf16": 0.015,
            "tandem-vllm-colo-bf16": 0.001}
    runs = [_run(n, 0, g, ttft=0.3 if n == "vllm-bf16" else 0.5) for n, g in gaps.items()]
    result = {"arms": arms, "runs": runs, "comparison": by_runtime(runs, arms)}
    c = result["comparison"]
    assert c["disagg-bf16"]["against"] == ["colo2-c128-bf16"]  # not Tandem on vLLM's colocated arm
    assert c["tandem-vllm-disagg-bf16"]["against"] == ["tandem-vllm-colo-bf16"]
    assert list(c["tandem-vllm-disagg-bf16"]["peers"]) == ["vllm-bf16"]
    rows = {(t["arm"], t["target"]): t for t in all_targets(result)}
    ours = {t: r for (a, t), r in rows.items() if a == "tandem-vllm-disagg-bf16"}
    assert set(ours) == {f"{m} Tandem-on-vLLM disaggregated / vllm-bf16" for m in ("itl.p99", "itl.p50", "ttft.p50")}
    assert ours["itl.p99 Tandem-on-vLLM disaggregated / vllm-bf16"]["measured"] == pytest.approx(0.5)  # <= 0.7
    assert ours["itl.p50 Tandem-on-vLLM disaggregated / vllm-bf16"]["met"]
    ttft = ours["ttft.p50 Tandem-on-vLLM disaggregated / vllm-bf16"]
    assert not ttft["met"] and ttft["bound"] == 1.3 and ttft["measured"] == pytest.approx(0.5 / 0.3)
    assert ("disagg-bf16", "itl.p99 disaggregated / vllm-bf16") in rows  # issue 23's, unchanged


def test_a_named_vllm_executable_runs_the_vllm_arms_without_the_cpu_install(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_VLLM", "/opt/vllm/bin/vllm")  # bench/gpu/run_vllm.sh's VLLM
    monkeypatch.setattr(peers, "cpu_available", lambda: pytest.fail("the CPU build was looked for"))
    assert peers.available() is None
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    assert peers.vllm_process(tmp_path, tmp_path / "vllm.log").cmd[:2] == ["/opt/vllm/bin/vllm", "serve"]


def test_the_curves_show_tandem_on_vllm_over_vllm_at_every_point():
    from bench.lib.curves_report import results_markdown
    from tests.bench.test_curves_report import _arm, _result

    r = _result()
    r["arms"]["vllm-bf16"] = _arm("vLLM", {128: 0.04, 8192: 10.0}, {1: (0.010, 0.02, 80.0, 0), 128: (0.1, 1.0, 500.0, 0)})
    r["arms"]["tandem-vllm-disagg-bf16"] = _arm("Tandem on vLLM", {128: 0.05, 8192: 12.0},
                                                {1: (0.011, 0.01, 80.0, 0), 128: (0.1, 0.5, 500.0, 0)})
    md = results_markdown(r, "20260102-000000", "python -m bench curves")
    assert "**tandem-vllm-disagg-bf16** / **vllm-bf16** (issue 29: ITL p99 ≤ 0.7, ITL p50 ≤ 1.1, TTFT ≤ 1.3)" in md
    assert "| 128 | 1.25 |" in md and "| 8192 | 1.20 |" in md  # TTFT p50 ratios
    assert "| 1 | 1.10 | 0.50 |" in md and "| 128 | 1.00 | 0.50 |" in md  # ITL p50, p99 ratios
    del r["arms"]["vllm-bf16"]
    assert "issue 29" not in results_markdown(r, "20260102-000000", "python -m bench curves")
