"""``/metrics``: the coordinator's status in Prometheus text format (prometheus_client, collected per scrape).

Per-rank counters restart at zero in a new epoch (a new world); Prometheus treats that as a counter reset.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from paramplane.protos import coordinator_pb2 as pb


class _StatusCollector(Collector):
    def __init__(self, status: pb.StatusResponse) -> None:
        self._s = status

    def describe(self) -> list[Metric]:
        return []  # collected per scrape from one status: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        s = self._s
        live = [r for r in s.ranks if not r.left]
        yield _gauge("paramplane_world_size", "Ranks the world expects (--world-size).", s.world_size)
        joined = len(live) if s.formed else s.num_waiting
        yield _gauge("paramplane_ranks_joined", "Ranks joined (and not left) in the current epoch.", joined)
        yield _gauge("paramplane_epoch", "The coordinator's current epoch.", s.epoch)
        yield _gauge(
            "paramplane_world_formed", "1 once every rank of the current epoch joined.", int(s.formed)
        )
        yield _gauge("paramplane_world_aborted", "1 while the current world is aborted.", int(s.aborted))
        age = GaugeMetricFamily(
            "paramplane_heartbeat_age_seconds",
            "Seconds since each rank's last heartbeat (-1: none yet).",
            labels=["rank", "host"],
        )
        for r in live:
            age.add_metric([str(r.rank), r.host_id], r.since_heartbeat_s)
        yield age
        issued = CounterMetricFamily(
            "paramplane_collectives_issued",
            "Collectives issued per group and rank.",
            labels=["group", "rank"],
        )
        completed = CounterMetricFamily(
            "paramplane_collectives_completed",
            "Collectives completed per group and rank.",
            labels=["group", "rank"],
        )
        for g in s.groups:
            for rank, i, c in zip(g.ranks, g.issued, g.completed):
                issued.add_metric([g.group, str(rank)], i)
                completed.add_metric([g.group, str(rank)], c)
        yield issued
        yield completed
        moved: dict[str, int] = {}
        ops: dict[str, int] = {}
        for r in s.ranks:
            for k, v in r.stats.bytes_by_transport.items():
                moved[k] = moved.get(k, 0) + v
            for k, v in r.stats.ops_by_transport.items():
                ops[k] = ops.get(k, 0) + v
        yield _by_transport("paramplane_transport_bytes", "Payload bytes of collectives and messages.", moved)
        yield _by_transport("paramplane_transport_ops", "Collectives and messages, summed over ranks.", ops)
        calls = CounterMetricFamily(
            "paramplane_coordinator_calls", "Calls the coordinator answered, by method.", labels=["method"]
        )
        for method, count in sorted(s.num_calls.items()):
            calls.add_metric([method], count)
        yield calls
        yield _gauge(
            "paramplane_heartbeat_callers",
            "Heartbeat callers heard within the timeout: host agents, plus ranks that beat themselves.",
            s.num_heartbeat_callers,
        )
        yield _counter("paramplane_aborts", "Worlds aborted since the coordinator started.", s.num_aborts)
        yield _counter(
            "paramplane_restarts", "Worlds formed by new processes after an abort.", s.num_restarts
        )
        yield _counter("paramplane_reforms", "Worlds re-formed by surviving processes.", s.num_reforms)
        commits = SummaryMetricFamily(
            "paramplane_checkpoint_commit_seconds",
            "Checkpoints committed in this epoch and the seconds their saves took.",
            count_value=sum(r.stats.num_checkpoint_commits for r in s.ranks),
            sum_value=sum(r.stats.checkpoint_commit_s for r in s.ranks),
        )
        yield commits
        yield _counter(
            "paramplane_checkpoint_commits",
            "Checkpoints committed in this epoch.",
            sum(r.stats.num_checkpoint_commits for r in s.ranks),
        )
        reporting = [r for r in s.ranks if r.stats.reported]
        if reporting:
            ref = reporting[0].stats
            yield _gauge("paramplane_train_step", "The lowest reporting rank's last step.", ref.step)
            yield _gauge("paramplane_train_loss", "The lowest reporting rank's last loss.", ref.loss)
        yield _counter(
            "paramplane_train_tokens", "Tokens reported by every rank.", sum(r.stats.tokens for r in s.ranks)
        )
        yield _gauge("paramplane_train_steps_per_second", "Steps/s over the last ~10 s.", s.steps_per_s)
        yield _gauge(
            "paramplane_train_tokens_per_second", "Tokens/s of all ranks, last ~10 s.", s.tokens_per_s
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _by_transport(name: str, doc: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["transport"])
    for transport, value in sorted(values.items()):
        family.add_metric([transport], value)
    return family


def metrics_text(status: pb.StatusResponse) -> bytes:
    """The Prometheus text exposition of ``status``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(status))
    return generate_latest(registry)
