"""The verifying runtime, in three floors that import only downward: the store (`store/`: every weight verified
before use, the reader threads, the cache and its eviction policy), the model (`model/`: config, stored formats,
packing, the numpy forward pass and its native kernels), and the engine (`engine/`: the one decode loop, continuous
batching under the memory budget, sessions, sampling, run receipts and their replay, and the provider that maps the
split layout onto the store; and a cluster on Ray: the plan, a node's expert service and the coordinator's side)."""

from shardtool.errors import ShardFormatError
from shardtool.runtime.engine import (NODE_CONFIG, NODE_NAME_PATTERN, MAX_PLAN_BYTES, ClusterPlan, ClusterStats, NodePlan,
                                      NodeService, NodeSetup, RemoteExperts, check_plan, connect_cluster, decode_plan,
                                      encode_plan, leave_cluster, load_plan, load_signed_plan, make_plan, node_alive,
                                      node_files, node_memory_floor, open_signed_plan, prepare_node, serve_node,
                                      sign_plan, signature_path, summarize,
                                      BudgetPlan, Detokenizer, Engine, ErrorEvent, Event, FinishEvent, RunRecord, SamplingParams,
                                      Session, SignedReceipt, Ticket, TokenEvent, Tolerances, VerifiedWeights,
                                      MAX_TOP_LOGPROBS, PromptScoresEvent, TokenLogprobs,
                                      check_request, check_weights, encode_prompt, load_tokenizer, make_receipt,
                                      plan_budget, replay_engine, replay_receipt, verified_config,
                                      ModelSource, open_source, verify_all, Generation, VerifiedModel, open_model)
from shardtool.runtime.model import MAX_THREADS as MAX_KERNEL_THREADS, kernels as native_kernels
from shardtool.runtime.model import set_threads as set_kernel_threads
from shardtool.runtime.store import (DEFAULT_PAGE_CACHE, DEFAULT_POLICY as DEFAULT_CACHE_POLICY, PAGE_CACHE_CHOICES,
                                     POLICIES as CACHE_POLICIES, ShardStore, StoreStats)

__all__ = ["CACHE_POLICIES", "DEFAULT_CACHE_POLICY", "DEFAULT_PAGE_CACHE", "PAGE_CACHE_CHOICES", "node_files", "NODE_CONFIG", "MAX_PLAN_BYTES", "NODE_NAME_PATTERN", "ClusterPlan", "NodePlan", "check_plan", "decode_plan", "encode_plan", "make_plan", "node_memory_floor",
           "summarize", "BudgetPlan", "Detokenizer", "Engine", "ErrorEvent", "Event", "FinishEvent", "SamplingParams", "Session", "ShardFormatError",
           "Ticket", "TokenEvent", "MAX_TOP_LOGPROBS", "PromptScoresEvent", "TokenLogprobs", "plan_budget", "ShardStore", "StoreStats", "VerifiedWeights", "encode_prompt",
           "load_tokenizer", "verified_config", "RunRecord", "SignedReceipt", "make_receipt", "Tolerances", "check_request", "check_weights", "replay_engine", "replay_receipt",
           "ClusterStats", "RemoteExperts", "connect_cluster", "load_plan", "load_signed_plan", "signature_path", "open_signed_plan", "sign_plan", "NodeService", "NodeSetup", "leave_cluster", "node_alive",
           "prepare_node", "serve_node", "ModelSource", "open_source", "verify_all", "Generation", "VerifiedModel", "open_model", "set_kernel_threads", "MAX_KERNEL_THREADS", "native_kernels"]
