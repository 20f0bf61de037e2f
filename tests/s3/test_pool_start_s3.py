"""A threaded caller's scan of a bucket: its workers are a helper's (engine._in_helper), fresh
processes that must be told where the buckets live (--endpoint-url, a SimpleTuner config's
backends), which forked workers inherit."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

from s3_helpers import Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)

from cachedoctor.fixtures import BUILDERS
from cachedoctor.fixtures.clean import build as clean

from conftest import run_in_group

SCRIPT = textwrap.dedent("""
    import json
    import sys
    import threading

    from cachedoctor import engine
    from cachedoctor.options import ScanOptions
    from cachedoctor.remote.client import set_endpoint_url

    if __name__ == "__main__":
        set_endpoint_url(sys.argv[2])  # as --endpoint-url does: nothing in the environment
        engine.BATCH = 2
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        start = engine.pool_start()
        pooled = engine.scan([sys.argv[1]], ScanOptions(jobs=2, index=False))
        stop.set()
        alone = engine.scan([sys.argv[1]], ScanOptions(jobs=1, index=False))
        print(json.dumps({"start": start, "pooled": sorted(map(repr, pooled.findings)),
                          "alone": sorted(map(repr, alone.findings)),
                          "files": [pooled.files, alone.files]}))
""")


def test_a_helpers_workers_are_told_where_the_bucket_is(s3: Bucket, tmp_path: Path,
                                                         monkeypatch) -> None:
    tree = tmp_path / "tree"
    clean(tree, n=6)
    BUILDERS["CD102"](tree)
    s3.upload(tree, "runs")
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT)
    out, _ = run_in_group([sys.executable, str(script), s3.url("runs"), endpoint], 90,
                          "the pooled scan of a bucket did not finish")
    result = json.loads(out.splitlines()[-1])
    assert result["start"] == "helper"
    assert result["files"] == [7, 7]
    assert result["pooled"] == result["alone"] and any("CD102" in f for f in result["pooled"])
