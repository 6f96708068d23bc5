"""The router (and the CLI that starts it) must run where torch and transformers are not installed."""

from __future__ import annotations

import subprocess
import sys


def test_router_modules_do_not_import_torch_or_transformers():
    code = (
        "import sys\n"
        "import tandem.cli.main as m\n"
        "m.build_parser()\n"
        "import tandem.router.app, tandem.router.cli, tandem.router.orchestrator\n"
        "import tandem.router.discovery.kubernetes, tandem.router.discovery.static\n"
        "import tandem.worker.local.up\n"
        "heavy = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers', 'tokenizers'))\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"heavy modules imported: {out.stdout} {out.stderr}"
