"""Draft-only multi-turn episodes that advance on their own, and the turn pieces they share with
the guided loop: a vLLM completion as a `Turn`, a turn's sampling parameters, an ended turn's
outcome (`follow`), tool calls on a thread pool (`ToolRuns`).

`EpisodeStream` runs episodes on the draft engine, stepped one step at a time
(`vllm_engine.RequestStream`): an episode's next turn joins the engine as soon as its own calls
returned. It is also a pool that outlives one batch: episodes join while others run (the drained
tail of one batch filled with the next one's episodes), and a weight sync interrupts the turns in
flight between two steps and resumes them under the new weights (AReaL's partial rollout), every
token recording the version that sampled it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np

from verl.utils.vision import engine_request
from verl.workers.rollout.context import RolloutContext
from verl.workers.rollout.multi_turn import (
    MultiTurnRuntime,
    ToolCall,
    ToolResult,
    Trajectory,
    TurnOutcome,
)
from verl.workers.rollout.multi_turn.runtime import TurnCalls
from verl.workers.rollout.speculative import GuidedSequence
from verl.workers.rollout.vllm_engine import RequestStream
from verl.workers.rollout.vllm_sessions import SessionEngine, sampled_log_probs

TOOL_GRACE_S = 0.01
"""Seconds the loop waits at most for the threaded calls of the turns that just ended before it
steps the engines on (it goes on as soon as they returned; the built-in tools run inline and
need none): a fast tool's episode (its thread starts in about a millisecond on a busy CPU) then
joins the very next step instead of the one after; a slow tool costs the engines this once per
step that ended turns. Without it the tool task took 44 engine steps a call instead of 42."""
VERSION_SLOT = "sample_version"
"""The policy-token slot of a `versioned` `EpisodeStream`'s episodes: the weight version of the
draft that sampled the token (`EpisodeStream.version`); an interrupted turn holds several."""


@dataclass
class Turn:
    """One policy turn of one episode as a turn function returns it."""

    ids: list[int]
    text: str
    reason: str
    """Why it ended (`runtime.FINISH_REASONS`)."""
    slots: dict[str, list[float]]
    seq: GuidedSequence | None = None
    """The speculative generation behind it (guided turns)."""


def finish_reason(completion, stop_ids: tuple[int, ...] = ()) -> str:
    """The runtime's finish reason of a vLLM completion: `tool_call` when it stopped at a stop
    string or at one of `stop_ids` (`MultiTurnRuntime.stop_token_ids`), `length` at the token
    limit, else `eos`."""
    if completion.finish_reason == "length":
        return "length"
    stop = completion.stop_reason
    return "tool_call" if isinstance(stop, str) or stop in stop_ids else "eos"


def turn_params(ctx: RolloutContext, runtime: MultiTurnRuntime, seed: int, budget: int):
    """The draft's `SamplingParams` of one turn: the rollout's, seeded `seed`, at most `budget`
    tokens, the log-prob of each sampled token, ending where the format's stop strings end it:
    at the ids holding them (`runtime.stop_token_ids`, nothing detokenized), or, for longer stop
    strings, at the strings themselves, kept in the output (detokenized, so vLLM can match them)."""
    stop_ids = runtime.stop_token_ids
    if stop_ids is not None:  # the engine's usual stops (EOS) and these ids
        return ctx.draft_params(budget, 1, seed, stop_token_ids=[*ctx.eos_stop_ids, *stop_ids])
    stops = {"stop": runtime.stop_strings, "include_stop_str_in_output": True}
    return ctx.draft_params(budget, 1, seed, detokenize=True, **stops)


def draft_turn(completion, runtime: MultiTurnRuntime) -> Turn:
    """A vLLM completion as a `Turn`, its sampled log-probs as `rollout_log_probs`; its text as
    the engine would have detokenized it (`runtime.turn_text` where it stopped by id)."""
    ids, log_probs = sampled_log_probs(completion)
    stop_ids = runtime.stop_token_ids
    text = completion.text if stop_ids is None else runtime.turn_text(ids)
    reason = finish_reason(completion, stop_ids or ())
    return Turn(ids, text, reason, {"rollout_log_probs": log_probs})


def follow(episode: Trajectory, outcome: TurnOutcome, reason: str, limit: int) -> tuple[bool, bool]:
    """Append `outcome` (of a turn that ended for `reason`) to `episode`: (whether it goes on to
    another turn, whether it ended cut: at `max_turns` with calls left unanswered, at the
    response budget `limit` (the delta used it up), or at the token limit)."""
    outcome.append_to(episode)
    if outcome.unanswered:
        return False, True
    if outcome.continues:
        return (True, False) if len(episode.response_ids) < limit else (False, True)
    return False, reason == "length"


class ToolRuns:
    """Episodes' tool calls running on a thread pool while the engines step: `start` one answered
    turn's calls (`call_tools(i, calls)`, None: `runtime.run_calls`), `returned` those that came
    back. Threads: one per `max_parallel_tools` (the calls themselves share the runtime's
    `tool_slots`). A `with` block; leaving it drops what is still queued."""

    def __init__(self, runtime: MultiTurnRuntime, call_tools: Callable | None = None) -> None:
        self.runtime, self._own = runtime, call_tools is None
        self.call_tools = call_tools or (lambda _, calls: runtime.run_calls(calls))
        self._pool = ThreadPoolExecutor(runtime.tool_slots.size, thread_name_prefix="turn-tools")
        self._running: dict[Future, tuple[int, TurnCalls]] = {}  # -> (episode, its turn)
        self._fresh: list[Future] = []  # started since the last `returned`

    def __enter__(self) -> ToolRuns:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def start(self, i: int, turn: TurnCalls) -> None:
        """Run episode i's answered `turn`'s calls: here and now when none needs a thread
        (`runtime.runs_inline`: the built-in lookup and calculator), else on the pool."""
        if self._own and self.runtime.runs_inline(turn.calls):
            future = Future()
            future.set_result(self.call_tools(i, turn.calls))
        else:
            future = self._pool.submit(self.call_tools, i, turn.calls)
            self._fresh.append(future)
        self._running[future] = (i, turn)

    @property
    def waiting(self) -> bool:
        """Some calls have not returned yet."""
        return bool(self._running)

    def returned(self, wait_for_one: bool) -> list[tuple[int, TurnCalls, list[ToolResult]]]:
        """(episode, turn, results) of the calls that returned, in episode order: after waiting
        up to `TOOL_GRACE_S` for those started since the last call, and with `wait_for_one` until
        some call returned (when some run)."""
        if self._fresh:
            wait(self._fresh, timeout=TOOL_GRACE_S)
            self._fresh.clear()
        if wait_for_one and self._running:
            wait(self._running, return_when=FIRST_COMPLETED)
        done = sorted((f for f in self._running if f.done()), key=lambda f: self._running[f][0])
        return [(*self._running.pop(f), f.result()) for f in done]


class Outcomes:
    """What `EpisodeStream` and `GuidedEpisodes` share: an ended turn's record and outcome.
    Needs `episodes`, `runtime`, `cut`, `limit`, `finished`, `_turns` and `_tools` (`ToolRuns`)
    on the instance."""

    def _record(self, i: int, turn: Turn) -> None:
        """Append episode i's ended turn; start its calls, or end the episode."""
        self.episodes[i].add_turn(turn.ids, **turn.slots)
        read = self.runtime.read(turn.text, turn.reason, self._turns[i])
        if read.answered:
            self._tools.start(i, read)
        else:
            self._follow(i, read, [])

    def _follow(self, i: int, read: TurnCalls, results: list[ToolResult]) -> bool:
        """Episode i's outcome (`follow`); whether it goes on."""
        goes_on, self.cut[i] = follow(self.episodes[i], self.runtime.answer(read, results),
                                      read.reason, self.limit)  # fmt: skip
        if not goes_on:
            self.finished.append(i)
        return goes_on


def piece_seed(seed: int, turn: int, piece: int) -> int:
    """The seed of piece `piece` (0: the turn's first request) of an episode's turn `turn` (from 1):
    `seed` + turn - 1 for a first piece, as `draft_turns` seeds a turn; for a piece resumed after
    an interruption a seed mixed from all three (`numpy.random.SeedSequence`, 31 bits). It must
    not be the first piece's: vLLM would replay that seed's draws from the start, and a draw
    that already chose an earlier token of the turn is no longer uniform given that token."""
    if piece == 0:
        return seed + turn - 1
    state = np.random.SeedSequence([seed, turn, piece]).generate_state(1, dtype=np.uint32)
    return int(state[0]) >> 1


def chunk_tokens(chunk) -> tuple[list[int], list[float]]:
    """A session chunk's (`vllm_sessions.ChunkOutput`) sampled tokens so far and the log-prob of
    each (column 0 of its rows)."""
    ids = [int(t) for t in chunk.token_ids]
    return ids, np.concatenate(chunk.logprobs)[:, 0].tolist() if ids else []


def session_capacity(sessions: SessionEngine, prompts: list[list[int]], limit: int) -> int:
    """How many episodes of `prompts` and up to `limit` response tokens hold a draft session at
    once (`SessionEngine.capacity`; one slot more for a turn's last sampled token)."""
    return sessions.capacity(max(map(len, prompts)) + limit + 1)


def session_turn(chunk, ctx: RolloutContext, runtime: MultiTurnRuntime, budget: int) -> Turn:
    """A draft session's finished chunk (`vllm_sessions.ChunkOutput`, at most `budget` tokens) as
    a `Turn`, its sampled log-probs as `rollout_log_probs`, ended for the reason vLLM's stop check
    gives first: EOS, a stop id (`runtime.stop_token_ids`: `tool_call`), the token limit."""
    ids, log_probs = chunk_tokens(chunk)
    last = ids[-1] if ids else None
    if last is not None and not ctx.ignore_eos and last == ctx.eos_token_id:
        reason = "eos"
    elif last is not None and last in (runtime.stop_token_ids or ()):
        reason = "tool_call"
    else:
        reason = "length"
    return Turn(ids, runtime.turn_text(ids), reason, {"rollout_log_probs": log_probs})


@dataclass
class EpisodeStream(Outcomes):
    """Draft-only episodes that advance on their own (continuous batching across episodes).

    Every episode's first turn is a request on the draft engine (`RequestStream`); the engine steps
    while requests join. When a turn finishes, its calls are read at once (`runtime.read`) and,
    when answered, run on a thread pool while the engine keeps stepping (`ToolRuns`); once they
    return, the delta is appended and the episode's next turn joins the engine's next step as a
    new request (prompt: the whole episode so far; at most the budget left). Turn k of episode i
    is seeded `seeds[i]` + k - 1 (`turn_params`), as in `draft_turns`, so an episode's tokens do
    not depend on when its turns ran. `call_tools(i, calls)` runs episode i's calls on a pool
    thread (None: `runtime.run_calls`). `submitted` lists (episode, turn) of every turn in the
    order they started, `finished` the episodes in the order they ended.

    With `sessions` (the draft's `SessionEngine`), an episode keeps one session from turn to turn
    instead: a turn is a chunk that computes only what came since the last one (the turn's last
    token and the tool delta), and the session's draws go on from turn to turn (seeded `seeds[i]`
    when it opened), again independent of when the turns ran. Needs turns that end at stop ids;
    a session with images opens on them (`SessionEngine.expect`).

    `run` runs the episodes given to the constructor. As a pool (`with stream:`), episodes are
    `add`ed and `admit`ted at any time and the engine stepped until a condition holds
    (`advance`, which can also admit waiting episodes as others end). `interrupt` aborts the
    turns on the engine between two steps, keeping each one's tokens so far (and closes every
    session: their KV cache holds the old weights' keys and values); the caller reloads the
    weights; `resume(version)` submits each interrupted turn again where it stopped (prompt: the
    episode and the turn's tokens; budget: what is left; its draws seeded anew, `piece_seed`), so
    every token is an exact draw of the weights that sampled it, given everything before it. With
    `versioned` each policy token records that version (`VERSION_SLOT`)."""

    ctx: RolloutContext
    runtime: MultiTurnRuntime
    prompts: list[list[int]]
    seeds: np.ndarray
    limit: int
    call_tools: Callable[[int, list[ToolCall]], list[ToolResult]] | None = None
    submitted: list[tuple[int, int]] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    images: list | None = None
    """Each episode's prompt images (`Job.images`), or None."""
    sessions: SessionEngine | None = None
    """The draft's sessions, one per episode kept from turn to turn; None: a request per turn."""
    versioned: bool = False
    """Record each policy token's weight version (`VERSION_SLOT`)."""
    version: int = 0
    """The engine's weight version (`resume` sets it)."""
    interrupted: int = 0
    """Turns interrupted so far (one turn interrupted twice counts twice)."""

    def __post_init__(self) -> None:
        if self.sessions is not None and self.runtime.stop_token_ids is None:
            raise ValueError("EpisodeStream: sessions need turns that end at stop ids")
        first = (self.prompts, self.seeds, self.images)
        self.prompts, self.seeds, self.images = [], [], None if self.images is None else []
        self.episodes: list[Trajectory] = []
        self.cut: list[bool] = []
        self._turns: list[int] = []  # turns started per episode
        self._breaks: list[int] = []  # interruptions of the turn running
        self._pieces: list[list[tuple[list[int], list[float], int]]] = []  # its tokens so far
        self._sid: list[str | None] = []  # each episode's open session
        self._opened: list[int] = []  # sessions each episode opened
        self._paused: list[int] = []
        self._ended: list[str] = []  # sessions of episodes that ended, to close
        self._owner: dict[str, int] = {}  # running request or session id -> its episode
        self._chunks: dict[str, tuple[object, int]] = {}  # running session -> its output, limit
        self._started = 0
        self._name = f"m{self.ctx.waves.next()}" if self.sessions is not None else ""
        self._exit: ExitStack | None = None
        self.add(*first)

    def add(
        self, prompts: list[list[int]], seeds: Iterable[int], images: list | None = None
    ) -> range:
        """New episodes, not started yet (`admit`); their indices."""
        if (images is None) != (self.images is None):
            raise ValueError("EpisodeStream: images must be given for every episode or for none")
        start, n = len(self.prompts), len(prompts)
        self.prompts += [list(p) for p in prompts]
        self.seeds += [int(s) for s in seeds]
        if images is not None:
            self.images += list(images)
        self.episodes += [Trajectory(list(p)) for p in prompts]
        self.cut += [False] * n
        for attribute, value in (("_turns", 0), ("_breaks", 0), ("_sid", None), ("_opened", 0)):
            getattr(self, attribute).extend([value] * n)
        self._pieces += [[] for _ in range(n)]
        return range(start, start + n)

    @property
    def in_flight(self) -> int:
        """Episodes started and not ended."""
        return self._started - len(self.finished)

    def __enter__(self) -> EpisodeStream:
        self._exit = ExitStack()
        if self.sessions is None:
            self._stream = self._exit.enter_context(RequestStream(self.ctx.engines.draft))
        else:
            self._exit.callback(lambda: self._close(range(len(self.prompts))))
        self._tools = self._exit.enter_context(ToolRuns(self.runtime, self.call_tools))
        return self

    def __exit__(self, *exc) -> None:
        self._exit.__exit__(*exc)

    def run(self) -> tuple[list[Trajectory], list[bool]]:
        """The constructor's episodes run to their ends, and whether each ended cut (`follow`).
        With sessions, at most as many at once as the draft's KV cache holds sessions of a whole
        episode."""
        n = len(self.prompts)
        cap = n
        if self.sessions is not None and n:
            cap = session_capacity(self.sessions, self.prompts, self.limit)
        with self:
            self.admit(range(min(cap, n)))
            self.advance(waiting=list(range(min(cap, n), n)), cap=cap)
        return self.episodes, self.cut

    def admit(self, episodes: Iterable[int]) -> None:
        """Start episodes: their first turns join the engine's next step."""
        episodes = list(episodes)
        self._started += len(episodes)
        self._submit(episodes)

    def advance(
        self, until: Callable[[], bool] | None = None, waiting: list[int] | None = None,
        cap: int = 0,
    ) -> None:  # fmt: skip
        """Step the engine and take the tools' returns until `until()` holds after a step (None:
        until no turn runs and no call is out). After each step, episodes of `waiting` (popped
        from its front) are admitted while fewer than `cap` are in flight."""
        tools = self._tools
        while self._owner or tools.waiting or (waiting and self.in_flight < cap):
            for i, turn in self._step() if self._owner else []:
                self._turn_ended(i, turn)
            admits = bool(waiting) and self.in_flight < cap
            returned = tools.returned(wait_for_one=not self._owner and not admits)
            self._submit([i for i, turn, results in returned if self._follow(i, turn, results)])
            if self._ended:
                self._close()
            while waiting and self.in_flight < cap:
                self.admit([waiting.pop(0)])
            if until is not None and until():
                return

    def _step(self) -> list[tuple[int, Turn]]:
        """One engine step: the turns that ended in it, by episode."""
        if self.sessions is None:
            ended = [(self._owner.pop(o.request_id), draft_turn(o.outputs[0], self.runtime))
                     for o in self._stream.step()]  # fmt: skip
        else:
            ended = []
            for sid in self.sessions.step():
                if sid in self._owner:
                    chunk, budget = self._chunks.pop(sid)
                    ended.append(
                        (self._owner.pop(sid), session_turn(chunk, self.ctx, self.runtime, budget))
                    )
        return sorted(ended, key=lambda pair: pair[0])

    def interrupt(self) -> int:
        """Abort the turns running on the engine (call between steps), keeping each one's tokens
        and log-probs so far; their calls and the episodes waiting on tools are untouched (with
        sessions, every session is closed: the next turn opens a new one). Returns how many
        turns were interrupted."""
        if self.sessions is None:
            cut = [
                (o.request_id, *sampled_log_probs(o.outputs[0])) for o in self._stream.interrupt()
            ]
        else:
            cut = [(sid, *chunk_tokens(chunk)) for sid, (chunk, _) in sorted(self._chunks.items())]
            self._chunks.clear()
            self._close(range(len(self.prompts)))
        for key, ids, log_probs in cut:
            i = self._owner.pop(key)
            if ids:
                self._pieces[i].append((list(ids), list(log_probs), self.version))
            self._breaks[i] += 1
            self._paused.append(i)
        self.interrupted += len(cut)
        return len(cut)

    def resume(self, version: int) -> None:
        """Submit the interrupted turns again, under the engine's weights, now `version`."""
        self.version = version
        paused, self._paused = sorted(self._paused), []
        self._submit(paused)

    def _submit(self, episodes: Iterable[int]) -> None:
        """Each episode's next turn, or its interrupted turn's next piece, as a request (or as its
        session's next chunk)."""
        prompts, params, mine, chunks, fresh = [], [], [], [], {}
        for i in episodes:
            if not self._breaks[i]:
                self._turns[i] += 1
                self.submitted.append((i, self._turns[i]))
            so_far = [t for ids, _, _ in self._pieces[i] for t in ids]
            budget = self.limit - len(self.episodes[i].response_ids) - len(so_far)
            context = self.episodes[i].context_ids() + so_far
            mine.append(i)
            if self.sessions is None:
                seed = piece_seed(self.seeds[i], self._turns[i], self._breaks[i])
                params.append(turn_params(self.ctx, self.runtime, seed, budget))
                opening = self.images[i] if self.images else None
                prompts.append(engine_request(context, opening))
                continue
            if self._sid[i] is None:  # a new session: the first seeded seeds[i], later ones anew
                self._sid[i] = f"{self._name}-{i}.{self._opened[i]}"
                if self.images and self.images[i] is not None:  # it opens with the prompt's images
                    self.sessions.expect({self._sid[i]: self.images[i]})
                seed = (
                    self.seeds[i]
                    if not self._opened[i]
                    else piece_seed(self.seeds[i], 0, self._opened[i])
                )
                fresh[self._sid[i]] = turn_params(self.ctx, self.runtime, seed, budget)
                self._opened[i] += 1
            chunks.append((self._sid[i], context, budget, None))
        if self.sessions is None:
            if prompts:
                self._owner.update(zip(self._stream.add(prompts, params), mine, strict=True))
            return
        outs = self.sessions.add(chunks, lambda sid, _: fresh[sid]) if chunks else []
        for (sid, _, budget, _), out, i in zip(chunks, outs, mine, strict=True):
            self._owner[sid], self._chunks[sid] = i, (out, budget)

    def _close(self, episodes: Iterable[int] = ()) -> None:
        """Close the open sessions of `episodes`, and those of the episodes that ended since the
        last call (one `SessionEngine.close` for all: it walks every open session's state)."""
        episodes = list(episodes)
        sids = [self._sid[i] for i in episodes if self._sid[i] is not None] + self._ended
        for i in episodes:
            self._sid[i] = None
        self._ended = []
        if sids:
            self.sessions.close(sids)

    def _follow(self, i: int, read: TurnCalls, results: list[ToolResult]) -> bool:
        """`Outcomes._follow`; an episode that ended has its session closed with the others that
        ended in the same step (`_close`)."""
        goes_on = super()._follow(i, read, results)
        if not goes_on and self._sid[i] is not None:
            self._ended.append(self._sid[i])
            self._sid[i] = None
        return goes_on

    def _turn_ended(self, i: int, turn: Turn) -> None:
        """Record episode i's finished turn (its pieces joined); start its calls, or end it."""
        pieces = [*self._pieces[i], (turn.ids, turn.slots["rollout_log_probs"], self.version)]
        self._pieces[i], self._breaks[i] = [], 0
        if len(pieces) > 1:
            turn = self._joined(pieces, turn.reason)
        if self.versioned:
            versions = [version for ids, _, version in pieces for _ in ids]
            turn.slots[VERSION_SLOT] = versions[: len(turn.ids)]
        self._record(i, turn)

    def _joined(self, pieces: list[tuple[list[int], list[float], int]], reason: str) -> Turn:
        """The pieces of an interrupted turn as one turn that ended for `reason` (its last
        piece's); where stop strings are matched in text, one may span two pieces, so the turn is
        cut where the engine would have stopped it uninterrupted (`runtime.turn_end`)."""
        ids = [t for piece_ids, _, _ in pieces for t in piece_ids]
        log_probs = [x for _, piece_lps, _ in pieces for x in piece_lps]
        if self.runtime.stop_token_ids is None and self.runtime.stop_strings:
            end = self.runtime.turn_end(ids)
            if end is not None and end < len(ids):
                ids, log_probs, reason = ids[:end], log_probs[:end], "tool_call"
        return Turn(ids, self.runtime.turn_text(ids), reason, {"rollout_log_probs": log_probs})

    def run_batches(
        self, batches: Iterable[tuple[list[list[int]], Iterable[int]]],
        sync: Callable[[], int] | None = None,
    ) -> list[range]:  # fmt: skip
        """Batches of episodes ((prompts, seeds) each) through the pool in order, each batch's
        drained tail filled with the next batch's episodes (admitted as the batch's own end, so
        that at most one batch's worth is in flight), and, between two batches, a weight sync:
        the turns on the engine interrupted, `sync()` (the caller reloads the weights and returns
        their version), the turns resumed. Returns each batch's episode indices."""
        groups = [self.add(prompts, seeds) for prompts, seeds in batches]
        with self:
            for b, group in enumerate(groups):
                self.admit(range(self._started, group.stop))
                ahead = list(groups[b + 1]) if b + 1 < len(groups) else []
                self.advance(until=self._ends(group), waiting=ahead, cap=len(group))
                if sync is not None and b + 1 < len(groups):
                    self.interrupt()
                    self.resume(sync())
        return groups

    def _ends(self, group: range) -> Callable[[], bool]:
        """A check that every episode of `group` has ended (reading `finished` once)."""
        seen, left = 0, len(group)

        def ended() -> bool:
            nonlocal seen, left
            left -= sum(i in group for i in self.finished[seen:])
            seen = len(self.finished)
            return left == 0

        return ended
