"""The engine floor of the runtime: the one decode loop (continuous batching under the memory budget, sessions,
sampling), run receipts and their replay, the budget plan, the model's small signed files, and the provider that
maps the split layout onto the verifying store (`VerifiedWeights`, the model's `WeightProvider` and `Prefetcher`);
and a cluster on Ray: the plan (`_cluster_plan`), a node's expert service (`_cluster_node`) and the coordinator's
side that asks the nodes (`_cluster`).
It stands on the store and the model below it; nothing below imports it.
"""

from ._cluster import ClusterStats, RemoteExperts, connect_cluster, load_plan, load_signed_plan, signature_path
from ._cluster_node import NodeService, NodeSetup, leave_cluster, node_alive, prepare_node, serve_node
from ._cluster_plan import (MAX_PLAN_BYTES, NODE_CONFIG, NODE_NAME_PATTERN, ClusterPlan, NodePlan, check_plan,
                            decode_plan, encode_plan, make_plan, node_files, node_memory_floor, open_signed_plan,
                            sign_plan, summarize)
from ._detok import Detokenizer
from ._engine import Engine, ErrorEvent, Event, FinishEvent, PromptScoresEvent, Ticket, TokenEvent
from ._open import Generation, VerifiedModel, open_model
from ._plan import MIN_ACTIVATION_RESERVE, BudgetPlan, plan_budget
from ._provider import VerifiedWeights
from ._record import RunRecord, SignedReceipt, make_receipt
from ._replay import Tolerances, check_request, check_weights, replay_engine, replay_receipt
from ._sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs, token_logprobs
from ._session import Session, encode_prompt
from ._source import ModelSource, open_source, verify_all
from ._signed import load_tokenizer, verified_config

__all__ = ["NODE_CONFIG", "NODE_NAME_PATTERN", "MAX_PLAN_BYTES", "ClusterPlan", "ClusterStats", "NodePlan",
           "NodeService", "NodeSetup", "RemoteExperts", "check_plan", "connect_cluster", "decode_plan", "encode_plan",
           "leave_cluster", "load_plan", "load_signed_plan", "make_plan", "node_alive", "node_files", "node_memory_floor",
           "open_signed_plan", "prepare_node", "serve_node", "sign_plan", "signature_path", "summarize",
           "MIN_ACTIVATION_RESERVE", "BudgetPlan", "Detokenizer", "Engine", "ErrorEvent", "Event", "FinishEvent", "RunRecord",
           "SamplingParams", "PromptScoresEvent", "MAX_TOP_LOGPROBS", "TokenLogprobs", "token_logprobs", "Session", "SignedReceipt", "Ticket", "TokenEvent", "Tolerances", "VerifiedWeights",
           "check_request", "check_weights", "encode_prompt", "load_tokenizer", "make_receipt", "plan_budget",
           "replay_engine", "replay_receipt", "verified_config", "ModelSource", "open_source", "verify_all",
           "Generation", "VerifiedModel", "open_model"]
