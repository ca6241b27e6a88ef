"""The Ray cluster under the pool: how the driver joins or starts it, and a watch on its head.

Joining: `address` (or $RAY_ADDRESS) names a running cluster ("auto": the one `ray start --head` made
on this machine); its network settings are its own. Starting: a local Ray that listens on 127.0.0.1
only and has no dashboard unless asked. Ray's default binds every server (GCS, raylet, object
manager, workers) to all interfaces, so a laptop or shared box would serve unauthenticated RPC to
its network; asked for 127.0.0.1, Ray 2.x swaps in the machine's outward address on Linux
(services.resolve_ip_for_localhost), so `_loopback_only` switches that off for the one ray.init call.

The watch: when the cluster's head (the GCS) dies, Ray's client code ends this process once it has
been unreachable for gcs_rpc_server_reconnect_timeout_s (60 s by default) with one C++ log line: no
Python exception, no finally block, no checkpoint. Meanwhile actor calls keep working (they go from
worker to worker), so the pool would not notice by itself. ClusterWatch probes the GCS from a daemon
thread; the first failed probe logs an ERROR that says what is happening and what to do; once the
head has been unreachable for `lost_after_s` the pool's current or next call raises
RolloutBackendLost, leaving the rest of Ray's timeout to the trainer for its checkpoint. A head that
answers again in time (GCS fault tolerance restarts it) is forgiven. docs/distributed.md#ray-faults.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import ray

from rlspec.rollout.errors import RolloutBackendLost

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Ray ends a driver whose head has been unreachable this long (its gcs_rpc_server_reconnect_timeout_s)
RAY_EXIT_S = int(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", "60"))


def connect(address: str | None = None, *, dashboard: bool = False, num_cpus: int | None = None) -> None:
    """Join the cluster at `address` (or $RAY_ADDRESS), else start a local Ray on 127.0.0.1 (see above).

    dashboard: start Ray's dashboard with a local cluster (on 127.0.0.1:8265; off by default: it is
    one more open port and process). num_cpus: a local cluster's CPUs (None: every core). Does
    nothing when this process is already connected."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    with _loopback_only():
        ray.init(num_cpus=num_cpus, include_dashboard=dashboard, _node_ip_address=LOOPBACK, log_to_driver=True)
    if ray.util.get_node_ip_address() != LOOPBACK:  # a Ray that changed how it resolves the address
        log.warning("the local Ray cluster listens on %s, not only on %s", ray.util.get_node_ip_address(), LOOPBACK)


@contextlib.contextmanager
def _loopback_only():
    """Let ray.init keep 127.0.0.1 as the node address (Ray resolves it to the outward one unless its
    cluster mode is off, as on macOS/Windows); restored at once, so nothing else in the process sees it."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # another Ray: connect() warns if it listens wider
        yield
        return
    old = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old


def gcs_address() -> str:
    return ray.get_runtime_context().gcs_address if ray.is_initialized() else ""


def gcs_unreachable(timeout_s: float) -> str | None:
    """None when the cluster's head answers a tiny key-value read within timeout_s, else why not.
    (ray.nodes() would do, but it has no timeout: it blocks until Ray ends the process.)"""
    if not ray.is_initialized():
        return "this process is not connected to Ray"
    try:
        client = ray._private.worker.global_worker.gcs_client
        client.internal_kv_get(b"rlspec-probe", b"rlspec", timeout=timeout_s)
    except AttributeError:  # a Ray without this client: no way to tell, so never cry wolf
        return None
    except Exception as err:  # noqa: BLE001 - RpcError and kin: whatever stops the read is the reason
        return f"{type(err).__name__}: {err}"
    return None


class ClusterWatch:
    """A daemon thread probing the cluster's head every interval_s; check() raises once it is lost."""

    def __init__(self, lost_after_s: float = 15.0, interval_s: float = 2.0):
        self.lost_after_s, self.interval_s = lost_after_s, interval_s
        self.address = gcs_address()
        self.down_since: float | None = None
        self.reason = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlspec-ray-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        """One probe; logs the head going away (ERROR, once) and coming back."""
        reason = gcs_unreachable(min(self.interval_s, 5.0))
        if reason is None:
            if self.down_since is not None:
                log.warning("the Ray cluster's head at %s answers again after %.0f s", self.address,
                            time.monotonic() - self.down_since)
            self.down_since = None
        elif self.down_since is None:
            self.down_since, self.reason = time.monotonic(), reason
            log.error("the Ray cluster's head (GCS at %s) does not answer (%s). If it does not come back, Ray "
                      "ends this process about %d s from now; the pool raises RolloutBackendLost after %.0f s "
                      "so the trainer can save a checkpoint; resume with resume=auto.", self.address, reason,
                      RAY_EXIT_S, self.lost_after_s)

    def check(self) -> None:
        """Raise RolloutBackendLost if this process left the cluster or its head has been gone too long."""
        if not ray.is_initialized() or gcs_address() != self.address:
            raise RolloutBackendLost(f"this process is no longer connected to the Ray cluster at {self.address} "
                                     "(ray.shutdown() was called, or Ray was restarted with a new ray.init)")
        down = self.down_since
        if down is not None and time.monotonic() - down >= self.lost_after_s:
            raise RolloutBackendLost(
                f"the Ray cluster's head (GCS at {self.address}) has not answered for "
                f"{time.monotonic() - down:.0f} s ({self.reason}); Ray ends this process once it has been gone "
                f"for {RAY_EXIT_S} s (RAY_gcs_rpc_server_reconnect_timeout_s, set on every node, gives longer)")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 6.0)


def get(refs, check, poll_s: float = 1.0):
    """ray.get(refs), calling check() every poll_s while they are not ready (raises instead of hanging)."""
    pending = list(refs) if isinstance(refs, list) else [refs]
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        if pending:
            check()
    return ray.get(refs)
