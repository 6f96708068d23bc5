"""What the pods of a LeaderWorkerSet say about its groups. Pure.

The LWS controller labels every pod with the index of its group; a group is ready when all of its
pods are, and a scale-down removes the groups with the highest indices (the leaders' StatefulSet
removes its highest ordinals first: pod-deletion-cost does not apply to it).
"""

from __future__ import annotations

from typing import Any

from tandem.contracts.names import pod_ready

GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"


def group_index(pod: dict[str, Any]) -> int | None:
    """The index of the group a pod belongs to, None for a pod outside any group."""
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(GROUP_INDEX_LABEL)
    return int(value) if value is not None and str(value).isdigit() else None


def ready_groups(pods: list[dict[str, Any]], size: int) -> int:
    """Groups whose `size` pods are all ready. Judged from the pods themselves: the LeaderWorkerSet's
    own status lags them."""
    ready: dict[int, int] = {}
    for pod in pods:
        group = group_index(pod)
        if group is not None and pod_ready(pod):
            ready[group] = ready.get(group, 0) + 1
    return sum(1 for count in ready.values() if count >= size)


def removed_by_scale_down(leaders: list[dict[str, Any]], keep: int) -> tuple[str, ...]:
    """The leader pods whose groups go when a LeaderWorkerSet drops to `keep` groups, in order."""
    going = [p for p in leaders if (group_index(p) or 0) >= keep]
    going.sort(key=lambda p: -(group_index(p) or 0))
    return tuple(p["metadata"]["name"] for p in going)
