"""A sequence: one sample of one request, with its tokens, progress and cache blocks; a request: its samples."""

from __future__ import annotations

import itertools
from enum import Enum, auto

import torch

from compiled_llm.outputs import Logprob, RequestMetrics
from compiled_llm.sampling_params import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, arrival_time: float, generator: torch.Generator | None = None):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.generator = generator
        self.bad_words_ids: list[list[int]] = []  # SamplingParams.bad_words as token sequences (input processor)
        self.status = Status.WAITING
        self.priority = 0  # scheduling_policy "priority": lower runs first (the request's, set at admission)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, tokens that came from the prefix cache at admission
        self.pending_token = False  # the last token is a placeholder for one still on the device (async scheduling)
        self.block_tables: dict[int | None, list[int]] = {}  # kv group -> block ids (-1: released)
        self.released_to: dict[int | None, int] = {}  # windowed group -> blocks before this index are released
        self.block_hashes: list[int] = []  # hash chain of the full blocks of token_ids
        self.state_slot: int | None = None  # recurrent-state slot (hybrid models) while it holds blocks
        # prefix caching of hybrid models (block_manager.py): the snapshot slot its scheduled step saves to and
        # the number of blocks it will end at; the (hash, slot) of its latest snapshot past the prompt's cut
        self.pending_snapshot: tuple[int, int] | None = None
        self.tail_snapshot: tuple[bytes, int] | None = None
        self.snapshot_branch = 0  # where its cached KV ended past its snapshot hit at admission (0: nowhere)
        self.mm = None  # multimodal.MultiModalInputs of a prompt with media (None: text only)
        self.grammar = None  # structured_output.GrammarState when params.structured_output is set
        # sparse KV (runtime/sparse_kv.py): keys attended vs tokens cached, summed over decode steps and layers
        self.sparse_attended_tokens = 0
        self.sparse_cached_tokens = 0
        self.logprobs: list[dict[int, Logprob]] = []
        # params.prompt_logprobs: one entry per prompt token (None for the first), filled as its chunks run
        self.prompt_logprobs: list[dict[int, Logprob] | None] = [None]
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        self.detokenizer = None
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED


class Request:
    """One request: its prompt and its n sequences (samples), from admission until all of them end."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], seqs: list[Sequence],
                 arrival_time: float, mm=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.mm = mm  # multimodal.MultiModalInputs that its sequences share (None: text only)

    @property
    def has_media(self) -> bool:
        return self.mm is not None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
