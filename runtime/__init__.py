"""The verifying runtime: shard store (`_store`: where every weight is verified before use), the
provider that maps the split layout onto it (`_provider`), the numpy MoE forward pass (`_model`), and the
one decode loop (`_engine`: continuous batching under the memory budget, `_plan`); which cached shard is evicted
first (`_cache_policy`); run receipts: what a run
records (`_record`) and the teacher-forced replay that checks one (`_replay`); a cluster: the node that serves its
planned experts (`_cluster_node`) and the coordinator's side that asks the nodes for them (`_cluster`)."""

from shardtool.runtime._cache_policy import DEFAULT_POLICY as DEFAULT_CACHE_POLICY, POLICIES as CACHE_POLICIES
from shardtool.runtime._cluster import (ClusterStats, RemoteExperts, connect_cluster, load_plan, load_signed_plan,
                                       signature_path)
from shardtool.runtime._cluster_node import NodeService, NodeSetup, leave_cluster, node_alive, prepare_node, serve_node
from shardtool.runtime._cluster_plan import (MAX_PLAN_BYTES, NODE_NAME_PATTERN, ClusterPlan, NodePlan, check_plan,
                                             decode_plan, encode_plan, make_plan, open_signed_plan, sign_plan, node_memory_floor, summarize, node_files, NODE_CONFIG)
from shardtool.runtime._model._packed import MAX_THREADS as MAX_KERNEL_THREADS, kernels as native_kernels
from shardtool.runtime._model._packed import set_threads as set_kernel_threads
from shardtool.runtime._engine import (Engine, ErrorEvent, Event, FinishEvent, SamplingParams, Ticket,
                                       TokenEvent)
from shardtool.runtime._plan import BudgetPlan, plan_budget
from shardtool.runtime._provider import VerifiedWeights
from shardtool.runtime._record import RunRecord, SignedReceipt, make_receipt
from shardtool.runtime._replay import Tolerances, check_request, check_weights, replay_engine, replay_receipt
from shardtool.runtime._session import Session, encode_prompt
from shardtool.runtime._signed import load_tokenizer, verified_config
from shardtool.runtime._store import ShardFormatError, ShardStore, StoreStats

__all__ = ["CACHE_POLICIES", "DEFAULT_CACHE_POLICY", "node_files", "NODE_CONFIG", "MAX_PLAN_BYTES", "NODE_NAME_PATTERN", "ClusterPlan", "NodePlan", "check_plan", "decode_plan", "encode_plan", "make_plan", "node_memory_floor",
           "summarize", "BudgetPlan", "Engine", "ErrorEvent", "Event", "FinishEvent", "SamplingParams", "Session", "ShardFormatError",
           "Ticket", "TokenEvent", "plan_budget", "ShardStore", "StoreStats", "VerifiedWeights", "encode_prompt",
           "load_tokenizer", "verified_config", "RunRecord", "SignedReceipt", "make_receipt", "Tolerances", "check_request", "check_weights", "replay_engine", "replay_receipt",
           "ClusterStats", "RemoteExperts", "connect_cluster", "load_plan", "load_signed_plan", "signature_path", "open_signed_plan", "sign_plan", "NodeService", "NodeSetup", "leave_cluster", "node_alive",
           "prepare_node", "serve_node", "set_kernel_threads", "MAX_KERNEL_THREADS", "native_kernels"]
