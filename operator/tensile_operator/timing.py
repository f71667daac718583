"""How long the operator waits before it looks, or tries, again.

Read where used as `timing.NAME` (not imported by name), so that one assignment here (a test's monkeypatch) changes
them for every collaborator at once.
"""

from __future__ import annotations

# the ledger is checked against the statuses at most this often (and after a failed pass); the jobs still booked on a
# GPU that went, whose look failed, are looked at again this often (`Replacement.recheck_forever`)
RESYNC_SECONDS = 30.0
# a deleted job's terminating pod is looked up again this often (its DELETED event may be missed)
POD_CHECK_SECONDS = 5.0
# seconds between attempts at a pod creation or a job's end refused by the API server's trouble (5xx, 429): about a
# minute
RETRY_DELAYS: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
# `dra` mode: while jobs wait, the ResourceSlices, ResourceClaims and DeviceClass are read again at least this often
# (claims of other workloads come and go unseen: the operator does not watch them)
CLAIMS_SECONDS = 10.0
