"""How one prefill or decode worker is split across GPUs and nodes: `spec.<role>.parallelism`.

A worker is a group of ranks, one per GPU (tensor parallel). `tensor` is the group's size and
`nodes` the number of pods (one per node) it spans; each pod runs tensor / nodes ranks on that
many GPUs. One node: one pod (a Deployment's). More: a LeaderWorkerSet, whose groups start, fail,
restart and scale as one. The names follow KServe's LLMInferenceService and llm-d (`tensor`), and
LeaderWorkerSet's group size (`nodes`); docs/parallelism.md says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.operator.spec.fields import Rule, api_field

# A node label key (a qualified name with an optional DNS prefix), as topologyKey takes.
LABEL_KEY = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
             r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX_TENSOR = 64
MAX_NODES = 16


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """The tensor-parallel group of one worker and the nodes it spans."""

    tensor: int = api_field(
        "tensor", minimum=1, maximum=MAX_TENSOR, default=1,
        description="Tensor-parallel size: the ranks (GPUs) one {role} worker's model is split across. The "
        "model's attention heads, KV heads and experts must divide by it (checked against its config.json).")
    nodes: int = api_field(
        "nodes", minimum=1, maximum=MAX_NODES, default=1,
        description="Nodes one {role} group spans. 1: the group is one pod with tensor GPUs. More: a "
        "LeaderWorkerSet whose groups of `nodes` pods (tensor / nodes GPUs each) are scheduled on the "
        "role's node pool together, restart together and count ready only when every pod is.")
    topology_key: str | None = api_field(
        "topologyKey", max_length=317, pattern=LABEL_KEY,
        description="A node label (a rack or an NVLink domain, e.g. nvidia.com/gpu.clique) whose value "
        "every pod of one {role} group must share. Only for groups that span nodes.")

    RULES: ClassVar[tuple[Rule, ...]] = (
        # has(): the API server also checks the rules against the declared default ({}), undefaulted.
        Rule("!has(self.tensor) || !has(self.nodes) || self.tensor % self.nodes == 0",
             "{role}.parallelism: tensor must be a multiple of nodes (every node of a group runs "
             "tensor / nodes ranks)",
             check=lambda p: p.tensor % p.nodes == 0,
             # format(), not string() + '...': the API server's cost estimate refuses concatenation.
             message_expression="'{role}.parallelism: tensor %d is not a multiple of nodes %d (every node "
             "of a group runs tensor / nodes ranks)'.format([self.tensor, self.nodes])",
             explain=lambda p: f"{{role}}.parallelism: tensor {p.tensor} is not a multiple of nodes "
             f"{p.nodes} (every node of a group runs tensor / nodes ranks)"),
        Rule("!has(self.topologyKey) || self.nodes > 1",
             "{role}.parallelism.topologyKey applies only to a group that spans nodes (nodes > 1)"),
    )

    @property
    def ranks_per_pod(self) -> int:
        """Ranks (GPUs) each pod of a group runs."""
        return self.tensor // self.nodes

    @property
    def spans_nodes(self) -> bool:
        """Whether a group is several pods (a LeaderWorkerSet) rather than one."""
        return self.nodes > 1


def gpus_rule() -> Rule:
    """On WorkerRole: GPUs per pod must be what the group's ranks need (or 0: ranks on CPU).

    The API server's alone (no Python twin): an InferenceService stored before parallelism existed
    (gpus 8, one rank) still reconciles as it did; CEL ratcheting lets it be until gpus changes.
    """
    return Rule(
        "!has(self.gpus) || !has(self.parallelism) || !has(self.parallelism.tensor) || "
        "!has(self.parallelism.nodes) || self.gpus == 0 || "
        "self.gpus * self.parallelism.nodes == self.parallelism.tensor",
        "{role}.gpus must equal parallelism.tensor / parallelism.nodes (one GPU per rank), or 0 to "
        "run the ranks on CPU",
        message_expression="'{role}.gpus is %d but parallelism tensor %d over %d node(s) needs %d GPUs per "
        "pod (one per rank); set {role}.gpus to that, or 0 to run the ranks on CPU'.format([self.gpus, "
        "self.parallelism.tensor, self.parallelism.nodes, self.parallelism.tensor / self.parallelism.nodes])")
