"""The farm waits on its own client's event loop, not on the process's default client.

Dask's ``as_completed`` tracks futures on ``default_client().loop`` unless told otherwise:
with another client current in the process (the newest one, or whichever a context left
current) the farm's completions
were awaited on a foreign loop, which hung the campaign (CI: as_completed stuck for 600 s,
tornado write-buffer assertions). Here the default client's loop is blocked for the whole
campaign: the campaign must finish anyway.
"""

from __future__ import annotations

import threading

from convergent.sim.campaign import run_campaign
from convergent.sim.config import ClusterConfig, SimulateConfig


def test_campaign_does_not_use_the_default_clients_loop(sim_client, tmp_path):
    from distributed import Client, LocalCluster, default_client

    other = Client(LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                dashboard_address=None))
    release = threading.Event()
    blocked = threading.Event()

    def block_loop():
        blocked.set()
        release.wait(timeout=300)  # a safety valve so a regression fails instead of hanging

    try:
        # the current client (a context variable) wins over the newest one; earlier code in
        # the process may have left it pointing anywhere, so set it here explicitly
        with other.as_current():
            assert default_client() is other and other.loop is not sim_client.loop
            other.loop.add_callback(block_loop)
            assert blocked.wait(timeout=30)
            sim = SimulateConfig(frames=30, max_atoms=5, chunk_size=5, flush_every_s=0.0, seed=5)
            s = run_campaign(sim, ClusterConfig(), tmp_path / "ds", progress=False,
                             client=sim_client)
            finished_while_blocked = not release.is_set()
        assert s.done == 30
        assert finished_while_blocked, "the campaign needed the default client's loop"
    finally:
        release.set()
        other.close()
        other.cluster.close()
