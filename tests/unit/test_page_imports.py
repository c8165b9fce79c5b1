"""With --ray the page's process holds no model: building the whole page (the app's flags parsed, the cluster's
client, every tab) imports neither torch nor transformers, which would cost it about 200 MiB of resident memory for
nothing (issue 62's target: at most 500 MiB at rest, docs/scaling.md)."""

import subprocess
import sys
from pathlib import Path

PAGE_WITHOUT_A_MODEL = """
import sys
import app
from pqcache.cluster.client import ClusterDocuments
from studio import Studio, build_ui


class Away(ClusterDocuments):  # no replicas: what the page asks of them is answered here
    def about(self):
        return {"model": "a model on the replicas", "device": "cpu", "methods": ["full", "pqcache"]}


args = app.parse_args(["--ray", "local"])
studio = Studio(None, None, None, app.server_settings(args), documents=Away([]), concurrency=2)
build_ui(studio)
print(",".join(sorted(name for name in ("torch", "transformers", "faiss") if name in sys.modules)) or "none")
"""


def test_the_page_with_ray_imports_no_model_code():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", PAGE_WITHOUT_A_MODEL], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "none"
