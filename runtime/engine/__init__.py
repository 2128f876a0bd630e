"""The engine floor of the runtime: the one decode loop (continuous batching under the memory budget, sessions,
sampling), run receipts and their replay, the budget plan, the model's small signed files, and the provider that
maps the split layout onto the verifying store (`VerifiedWeights`, the model's `WeightProvider` and `Prefetcher`).
It stands on the store and the model below it; nothing below imports it.
"""

from ._engine import Engine, ErrorEvent, Event, FinishEvent, Ticket, TokenEvent
from ._plan import MIN_ACTIVATION_RESERVE, BudgetPlan, plan_budget
from ._provider import VerifiedWeights
from ._record import RunRecord, SignedReceipt, make_receipt
from ._replay import Tolerances, check_request, check_weights, replay_engine, replay_receipt
from ._sampling import SamplingParams
from ._session import Session, encode_prompt
from ._signed import load_tokenizer, verified_config

__all__ = ["MIN_ACTIVATION_RESERVE", "BudgetPlan", "Engine", "ErrorEvent", "Event", "FinishEvent", "RunRecord",
           "SamplingParams", "Session", "SignedReceipt", "Ticket", "TokenEvent", "Tolerances", "VerifiedWeights",
           "check_request", "check_weights", "encode_prompt", "load_tokenizer", "make_receipt", "plan_budget",
           "replay_engine", "replay_receipt", "verified_config"]
