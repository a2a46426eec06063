"""The soak (benchmarks/acceptance/soak.py): 2 gloo processes, 2,000 steps over loopback HTTP through a capped cache, with
the server stopped and restarted twice, the job signalled and resumed twice and a class corrupted while it was
stopped. It must end with the weights of a run without those faults (bit for bit), every fault counted in
``metrics.jsonl``, the cache under its cap and the ranks' resident memory flat over the last start."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.quick_clock import QuickClock

STEPS = 2000


def _soak_module() -> Any:
    """Imported when a test runs, not when the suite is collected (the soak's module starts nothing, but this
    file's tests are the long ones)."""
    from benchmarks.acceptance import soak

    return soak


@pytest.mark.long  # minutes of 2 ranks: make test-long, which CI runs after make test
@pytest.mark.slow
@pytest.mark.distributed
def test_a_soak_with_faults_ends_where_a_run_without_them_ends(tmp_path: Path) -> None:
    soak = _soak_module()
    result = soak.soak(tmp_path, STEPS)
    faulty, counts = result["faulty"], result["counts"]
    explain = soak.report(result)

    assert result["same_weights"], explain
    # Each outage turned a read away (503 from the restarting server); each such read was retried, not lost.
    assert faulty.outages == 2 and faulty.turned_away >= 2, explain
    assert counts["read_retries"] >= faulty.turned_away, explain
    assert len(faulty.stops) == 2 and counts["stops"] == 2 and faulty.starts == 3, explain
    assert all(0 < s < STEPS for s in faulty.stops), explain
    replaced = counts["replaced_classes"]
    assert replaced > 0 and replaced == result["reference_counts"]["replaced_classes"], explain
    assert counts["bad_shards"] == result["reference_counts"]["bad_shards"] != [], explain
    assert counts["cache_fallbacks"] >= 1 and 0 < result["cache_bytes"] <= result["cache_cap_bytes"], explain
    assert result["memory"]["second_half_growth"] < 0.05, explain


def test_an_outage_turns_a_read_away_and_the_read_is_retried_until_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quick_retries: QuickClock
) -> None:
    """The soak's outage lasts until a read has met it (so it cannot fall between two reads): the read that meets
    it is refused or answered 503, retried by the store's policy, and served once the server is back. The port
    stays closed for a fraction of the soak's outage, met by retries at a tenth of their pauses: the property
    is the order (refused, 503, served), not the wait."""
    soak = _soak_module()
    monkeypatch.setattr(soak, "OUTAGE_S", 0.3)
    from ddp_rank.data.reading.storage import retrying, url_filesystem

    data = bytes(range(256)) * 8
    (tmp_path / "shard.tar").write_bytes(data)
    server = soak.RestartableServer(tmp_path)
    url = f"{server.url}/shard.tar"
    turned_away: list[int] = []
    retries: list[int] = []
    outage = threading.Thread(target=lambda: turned_away.append(server.outage()))
    try:
        outage.start()
        time.sleep(0.2)  # the port is closed now
        fs = url_filesystem(url)
        body = retrying(lambda: fs.cat_file(url, start=16, end=48), url, 30.0, lambda: retries.append(1))
        outage.join(timeout=60)
    finally:
        server.stop()
    assert body == data[16:48]
    assert turned_away and turned_away[0] >= 1  # answered 503 at least once after the closed port
    assert len(retries) >= 1 + turned_away[0]  # refused while the port was closed, then each 503 retried


def test_the_fault_counts_add_up_every_start(tmp_path: Path) -> None:
    """Each start counts its data events from zero: the totals sum the last record of each start."""
    soak = _soak_module()
    records = [
        '{"kind": "data", "step": 0}',
        '{"kind": "train", "step": 1, "data_read_retries": 2, "data_replaced_classes": 0, "data_bad_shards": []}',
        '{"kind": "train", "step": 2, "data_read_retries": 3, "data_replaced_classes": 1, "data_bad_shards": ["a"]}',
        '{"kind": "stop", "step": 2, "signal": "SIGUSR1"}',
        '{"kind": "data", "step": 2}',
        '{"kind": "train", "step": 3, "data_read_retries": 4, "data_replaced_classes": 2, "data_bad_shards": ["b"]}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(records) + "\n")
    assert soak.fault_counts(tmp_path) == {
        "stops": 1,
        "read_retries": 7,
        "replaced_classes": 3,
        "bad_shards": ["a", "b"],
    }
    assert soak.last_step(tmp_path / "metrics.jsonl") == 3
    assert soak.last_step(tmp_path / "missing.jsonl") == 0
