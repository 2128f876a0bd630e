"""GET /metrics: the engine's figures, read at scrape time, and the HTTP requests served, by route and status,
in the Prometheus text format. A private registry: nothing global, no process-wide default collectors. Every family
is yielded by a collector of ours, so none carries prometheus_client's `*_created` series (in the text format they
would appear as extra gauge families, one per counter)."""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "shardtool_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# engine.metrics() key -> help text. A key ending in _total is a counter, any other a gauge; a key the engine
# adds later is exported too (with a generic help text), so no figure goes missing from a scrape.
ENGINE_HELP = {
    "queue_depth": "Requests waiting for admission (KV cache or batch slot).",
    "running": "Requests in the running batch.",
    "last_batch_size": "Sequences in the most recent decode step.",
    "kv_cache_bytes_capacity": "Bytes of the memory budget set aside for the KV cache.",
    "kv_cache_bytes_reserved": "KV cache bytes reserved by admitted requests (prompt + max_tokens each).",
    "kv_cache_bytes_in_use": "KV cache bytes holding keys and values now.",
    "prompt_tokens_total": "Prompt tokens prefilled.",
    "generation_tokens_total": "Tokens generated.",
    "steps_total": "Batched forward steps run.",
    "step_sequences_total": "Sequences summed over all steps (divide by steps_total for the mean batch size).",
    "step_rows_total": "Token rows summed over all steps (decode tokens plus prefill chunks).",
    "step_seconds_total": "Seconds spent in forward steps.",
    "requests_admitted_total": "Requests admitted to the running batch (their KV cache reserved).",
    "requests_finished_total": "Requests that ended with a finish reason (stop, length).",
    "requests_failed_total": "Requests that ended with an error.",
    "requests_cancelled_total": "Requests cancelled (a client went away, or a stop string was met).",
    "requests_rejected_queue_full_total": "Requests refused with 503 because the wait queue was full.",
    "expert_bytes_read_total": "Routed-expert shard bytes read from disk.",
    "verification_failures_total": "Shards that failed verification (size or BLAKE3) when read.",
    "cache_hits_total": "Verified-shard cache hits.",
    "cache_misses_total": "Verified-shard cache misses (each a read and a verification).",
    "cache_evictions_total": "Shards evicted from the verified-shard cache.",
    "bytes_read_total": "Shard bytes read from disk.",
    "bytes_verified_total": "Shard bytes hashed and compared with the signed manifest.",
    "read_seconds_total": "Reader-thread seconds spent reading shards.",
    "verify_seconds_total": "Reader-thread seconds spent hashing shards.",
    "cluster_node_calls_total": "Calls to cluster nodes (one per node per MoE layer per step).",
    "cluster_wire_bytes_total": "Bytes sent to and received from cluster nodes (hidden states, rows, expert outputs).",
    "cluster_call_seconds_total": "Seconds the engine spent starting and waiting for cluster node calls.",
    "cluster_expert_retries_total": "Experts asked again of another replica after a node failed or refused.",
    "cluster_nodes_dropped": "Cluster nodes no longer asked (died, timed out, refused or answered wrongly).",
    "cluster_nodes_readmitted_total": "Lost cluster nodes taken back after answering as a new, re-verified process.",
    "cluster_expert_calls_total": "Routed experts asked of each cluster node (label node).",
    "cluster_expert_calls_busiest_over_mean": "The busiest cluster node's expert calls over the mean node's.",
}


class EngineCollector(Collector):
    """Calls `read()` (the engine's metrics()) at every scrape: the figures are never stale."""

    def __init__(self, read: Callable[[], Mapping[str, int | float]], help_texts: Mapping[str, str]):
        self._read = read
        self._help = help_texts

    def collect(self) -> Iterator:
        for key, value in sorted(self._read().items()):
            by_node = isinstance(value, Mapping)  # {cluster node: figure}: one sample per node, labelled `node`
            samples = sorted(value.items()) if by_node else [("", value)]
            samples = [(node, v) for node, v in samples if not isinstance(v, bool) and isinstance(v, (int, float))]
            if not samples or (by_node and not all(isinstance(node, str) for node, _ in samples)):
                continue
            help_text = self._help.get(key, f"Engine figure {key}.")
            labels = ["node"] if by_node else None
            if key.endswith("_total"):
                # prometheus_client appends _total to a counter's name itself.
                family = CounterMetricFamily(PREFIX + key[: -len("_total")], help_text, labels=labels)
            else:
                family = GaugeMetricFamily(PREFIX + key, help_text, labels=labels)
            for node, v in samples:
                family.add_metric([node] if by_node else [], v)
            yield family

    def describe(self) -> list:
        return []  # the names are known only at scrape time: no registration-time collision check


class RequestCollector(Collector):
    """HTTP requests answered, by route and status. Counted and scraped on the event loop's thread only."""

    def __init__(self):
        self.counts: dict[tuple[str, str], int] = {}

    def collect(self) -> Iterator:
        family = CounterMetricFamily(PREFIX + "http_requests", "HTTP requests answered, by route and status.",
                                     labels=("route", "status"))
        for labels, value in sorted(self.counts.items()):
            family.add_metric(labels, value)
        yield family

    def describe(self) -> list:
        return []


class Metrics:
    def __init__(self, read_engine: Callable[[], Mapping[str, int | float]], extra_help: Mapping[str, str] = {}):
        """`read_engine`: the engine's figures (and any others merged in, e.g. the receipt store's, whose help
        texts are `extra_help`)."""
        self.read_engine = read_engine  # GET /status.json reads the same figures
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(read_engine, {**ENGINE_HELP, **extra_help}))
        self.http_requests = RequestCollector()
        self.registry.register(self.http_requests)

    def count(self, route: str, status: int) -> None:
        key = (route, str(status))
        self.http_requests.counts[key] = self.http_requests.counts.get(key, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
