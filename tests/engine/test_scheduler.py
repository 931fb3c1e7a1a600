"""Scheduler and KV cache manager with fake requests and no model: every step is checked, and every
test ends by asserting that no block leaked."""

from __future__ import annotations

import pytest

from app.engine.kv_cache import KVCacheConfig, KVCacheManager
from app.engine.params import SamplingParams
from app.engine.request import FinishReason, Request, Status
from app.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from app.engine.step_cost import StepCost

BLOCK = 4
EOS = 0


class Harness:
    """A scheduler whose "model" samples token 7 for every sequence (or what a test scripts)."""

    def __init__(self, blocks: int = 64, seqs: int = 8, budget: int = 32, chunked: bool = True,
                 prefix: bool = True, max_len: int = 256, cost: StepCost | None = None):
        self.kv = KVCacheManager(KVCacheConfig(blocks, BLOCK, prefix_caching=prefix), "test-model")
        self.sched = Scheduler(SchedulerConfig(seqs, budget, max_len, chunked), self.kv, cost)
        self.finished: list[Request] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> Request:
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), EOS)
        self.sched.add(request)
        return request

    def step(self, tokens: dict[str, int] | None = None) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_step(out)
        sampled = {r.request_id: (tokens or {}).get(r.request_id, 7) for r in out.requests if r.sample}
        self.finished += self.sched.update(out, sampled)
        return out

    def check_step(self, out: SchedulerOutput) -> None:
        cfg = self.sched.cfg
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(out.requests) <= cfg.max_num_seqs
        for r in out.requests:  # every scheduled token has a cache slot in the request's own blocks
            assert len(r.block_ids) * BLOCK >= r.num_computed + len(r.token_ids)
        used = [b for r in self.sched.running for b in self.kv.block_ids(r.request_id)]
        shared = {b for b in used if used.count(b) > 1}
        for b in set(used):
            assert self.kv.pool.ref_count[b] == used.count(b)  # one reference per holder
        assert not shared & set(self.kv.pool.free)

    def run(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("did not finish")

    def assert_no_leaks(self) -> None:
        assert not self.sched.running and not self.sched.waiting
        assert all(c == 0 for c in self.kv.pool.ref_count)
        assert self.kv.num_free_blocks() == self.kv.num_blocks


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.assert_no_leaks()


def make(blocks=64, **kw):
    return Harness(blocks, **kw)


def test_decode_goes_one_token_a_step_and_stops_at_max_tokens(h):
    h.add("a", [1, 2, 3, 4, 5], max_tokens=3)
    first = h.step()
    assert [(r.token_ids, r.num_computed, r.sample) for r in first.requests] == [((1, 2, 3, 4, 5), 0, True)]
    second = h.step()
    assert [(r.token_ids, r.num_computed) for r in second.requests] == [((7,), 5)]
    h.run()
    assert h.finished[0].output_ids == [7, 7, 7] and h.finished[0].finish_reason == FinishReason.LENGTH


def test_token_budget_and_sequence_limit():
    h = make(seqs=2, budget=10)
    for i in range(4):
        h.add(f"r{i}", list(range(1, 7)), max_tokens=2)  # 6 tokens each
    out = h.step()
    assert [r.request_id for r in out.requests] == ["r0", "r1"] and out.num_tokens == 10  # r1 chunked to 4
    assert [len(r.token_ids) for r in out.requests] == [6, 4] and [r.sample for r in out.requests] == [True, False]
    h.run()
    assert sorted(r.request_id for r in h.finished) == ["r0", "r1", "r2", "r3"]
    h.assert_no_leaks()


def test_chunked_prefill_splits_and_resumes_with_decodes_first():
    h = make(budget=8)
    h.add("short", [1, 2, 3], max_tokens=5)
    h.step()  # short's prompt
    h.add("long", list(range(10, 30)), max_tokens=1)  # 20 tokens: 7 + 8 + 5
    chunks = []
    for _ in range(3):
        out = h.step()
        assert out.requests[0].request_id == "short" and len(out.requests[0].token_ids) == 1  # decode first
        chunks.append([(r.num_computed, len(r.token_ids), r.sample) for r in out.requests if r.request_id == "long"][0])
    assert chunks == [(0, 7, False), (7, 7, False), (14, 6, True)]
    h.run()
    h.assert_no_leaks()


def test_without_chunked_prefill_a_prompt_waits_for_a_big_enough_budget():
    h = make(budget=8, chunked=False)
    h.add("fits", [1, 2, 3, 4, 5, 6], max_tokens=3)
    h.add("too-long-now", list(range(21, 28)), max_tokens=1)  # 7 tokens > 8 - 6 left this step
    out = h.step()
    assert [r.request_id for r in out.requests] == ["fits"]
    out = h.step()
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("fits", 1), ("too-long-now", 7)]
    h.run()
    h.assert_no_leaks()


def test_prefix_blocks_are_shared_and_reference_counted(h):
    prefix = list(range(100, 112))  # three full blocks
    h.add("a", prefix + [1, 2], max_tokens=5)
    h.step()
    a_blocks = h.kv.block_ids("a")
    h.add("b", prefix + [3, 4, 5], max_tokens=2)
    out = h.step()
    b = next(r for r in out.requests if r.request_id == "b")
    assert b.num_computed == 12 and b.token_ids == (3, 4, 5)  # only the tail is computed
    assert h.kv.block_ids("b")[:3] == a_blocks[:3]
    assert all(h.kv.pool.ref_count[x] == 2 for x in a_blocks[:3])
    assert h.kv.hits == 12
    h.sched.finish("a", FinishReason.ABORT)
    assert all(h.kv.pool.ref_count[x] == 1 for x in a_blocks[:3])
    h.run()


def test_a_fully_cached_prompt_still_computes_its_last_token(h):
    prompt = list(range(200, 208))  # exactly two blocks
    h.add("a", prompt, max_tokens=1)
    h.run()
    h.add("b", prompt, max_tokens=1)
    out = h.step()
    assert [(r.num_computed, r.token_ids) for r in out.requests] == [(4, (204, 205, 206, 207))]  # block 2 redone


def test_cached_blocks_outlive_their_request_and_are_evicted_least_recently_used_first():
    h = make(blocks=6)
    h.add("old", list(range(10, 18)), max_tokens=1)  # fills 2 blocks (+1 for the output token)
    h.run()
    h.add("new", list(range(30, 38)), max_tokens=1)
    h.run()
    assert h.kv.num_free_blocks() == 6
    # both prefixes are still findable
    assert h.kv.find_prefix(Request("q1", list(range(10, 19)), SamplingParams())).num_tokens == 8
    assert h.kv.find_prefix(Request("q2", list(range(30, 39)), SamplingParams())).num_tokens == 8
    h.add("big", list(range(50, 63)), max_tokens=1)  # needs 4 blocks: the 4 least recently used go
    h.run()
    assert h.kv.find_prefix(Request("q3", list(range(10, 19)), SamplingParams())).num_tokens == 0  # "old" evicted
    assert h.kv.find_prefix(Request("q4", list(range(30, 39)), SamplingParams())).num_tokens == 8  # "new" kept
    h.assert_no_leaks()


def test_preemption_frees_the_latest_request_and_recomputes_it():
    h = make(blocks=6, budget=64)
    h.add("first", [1] * 8, max_tokens=12)  # grows to 20 tokens = 5 blocks
    h.add("second", [2] * 8, max_tokens=12)
    h.step()
    assert len(h.kv.block_ids("first")) == 2 and len(h.kv.block_ids("second")) == 2  # 8 tokens: 2 blocks each
    preempted = []
    for _ in range(60):
        if not h.sched.has_work():
            break
        out = h.step()
        preempted += out.preempted
    assert preempted and preempted[0] == "second"  # the most recently started one
    second = next(r for r in h.finished if r.request_id == "second")
    assert second.output_ids == [7] * 12 and second.finish_reason == FinishReason.LENGTH
    h.assert_no_leaks()


def test_a_prompt_in_progress_never_preempts_a_request_already_in_the_step():
    """A long prompt started first, a short request after it now decoding: when the prompt's next chunk needs blocks
    that are not free, the decode (running last, but already chosen: decodes go first) keeps them, and the prompt
    gives its own up. It had taken the decode's, leaving it in the step without blocks (its step then failed)."""
    kv = KVCacheManager(KVCacheConfig(12, 16))
    cost = StepCost(overhead=0.001, per_token=0.001, per_pair=0.0, budget=0.1)
    sched = Scheduler(SchedulerConfig(8, 512, 1024, True, 0.1), kv, cost)
    sched.add(Request("prompt", list(range(1, 181)), SamplingParams(max_tokens=50)))  # chunked: ~99 tokens a step
    sched.add(Request("short", list(range(300, 310)), SamplingParams(max_tokens=50)))
    for _ in range(6):
        out = sched.schedule()
        for r in out.requests:
            assert len(r.block_ids) * 16 >= r.num_computed + len(r.token_ids), (r.request_id, out.preempted)
        sched.update(out, {r.request_id: 7 for r in out.requests if r.sample})
    assert sched.num_preemptions and len(sched.requests["short"].output_ids) == 5


def test_preempted_request_resumes_with_its_output_so_far():
    h = make(blocks=5, budget=64, prefix=False)
    h.add("a", [1] * 7, max_tokens=10)
    h.add("b", [2] * 7, max_tokens=10)
    seen_resume = False
    for _ in range(80):
        if not h.sched.has_work():
            break
        out = h.step()
        for r in out.requests:
            if r.request_id == "b" and r.num_computed == 0 and len(r.token_ids) > 7:
                seen_resume = True  # recomputes prompt + the tokens it had produced
                assert r.token_ids[:7] == (2,) * 7 and set(r.token_ids[7:]) == {7}
    assert seen_resume
    h.assert_no_leaks()


def test_abort_frees_everything_at_any_point(h):
    h.add("a", list(range(1, 20)), max_tokens=50)
    h.add("b", list(range(1, 20)), max_tokens=50)
    h.add("c", list(range(1, 5)), max_tokens=50)
    h.step()
    h.step()
    for rid in ("a", "b", "c"):
        assert h.sched.finish(rid, FinishReason.ABORT).finish_reason == FinishReason.ABORT
    assert h.sched.finish("a", FinishReason.ABORT) is None  # unknown now: ignored


def test_abort_while_waiting_and_update_after_abort(h):
    h.add("a", [1, 2, 3], max_tokens=3)
    out = h.sched.schedule()
    h.sched.finish("a", FinishReason.ABORT)  # the client left while the step ran
    assert h.sched.update(out, {"a": 9}) == []
    h.add("w", [1, 2], max_tokens=1)
    h.sched.finish("w", FinishReason.ABORT)


def test_stop_conditions(h):
    h.add("eos", [1, 2], max_tokens=10)
    h.add("min", [1, 2], max_tokens=10, min_tokens=2)
    h.add("ignore", [1, 2], max_tokens=2, ignore_eos=True)
    h.add("stopid", [1, 2], max_tokens=10, stop_token_ids=(5,))
    h.step({"eos": EOS, "min": EOS, "ignore": EOS, "stopid": 5})
    assert {r.request_id: r.finish_reason for r in h.finished} == {"eos": FinishReason.STOP, "stopid": FinishReason.STOP}
    h.step({"min": EOS, "ignore": EOS})
    assert {r.request_id for r in h.finished} == {"eos", "stopid", "min", "ignore"}
    assert next(r for r in h.finished if r.request_id == "ignore").finish_reason == FinishReason.LENGTH


def test_context_length_ends_a_request(h):
    short = make(max_len=8)
    short.add("a", [1, 2, 3, 4, 5, 6], max_tokens=None)
    short.run()
    assert short.finished[0].output_ids == [7, 7] and short.finished[0].finish_reason == FinishReason.LENGTH
    short.assert_no_leaks()


def test_sibling_waits_for_the_first_prompt_then_shares_its_blocks(h):
    prompt = list(range(40, 53))  # 13 tokens: 3 full blocks
    h.add("x-0", prompt, max_tokens=4)
    h.sched.add(Request("x-1", prompt, SamplingParams(max_tokens=2), EOS, wait_for="x-0"))
    out = h.step()
    assert [r.request_id for r in out.requests] == ["x-0"]
    out = h.step()
    sibling = next(r for r in out.requests if r.request_id == "x-1")
    assert sibling.num_computed == 12 and h.kv.block_ids("x-1")[:3] == h.kv.block_ids("x-0")[:3]
    h.run()


def test_status_moves_through_the_life_cycle(h):
    r = h.add("a", [1, 2, 3], max_tokens=1)
    assert r.status == Status.WAITING
    h.sched.schedule()
    assert r.status == Status.RUNNING
    h.sched.finish("a", FinishReason.ABORT)
    assert r.status == Status.FINISHED and r.finished


def test_a_request_that_keeps_waiting_is_counted_once_for_the_prefix_cache():
    h = make(blocks=4, budget=64)
    h.add("big", list(range(1, 13)), max_tokens=3)  # 12 tokens: 3 blocks, plus growth
    h.add("blocked", list(range(50, 62)), max_tokens=1)  # cannot fit until "big" is done
    for _ in range(3):
        h.step()
    assert h.kv.queries == 12  # "big" only: "blocked" was looked up but never admitted yet
    h.run()
    assert h.kv.queries == 24
    h.assert_no_leaks()


# --- the step-time budget ---


def test_a_duplicate_request_id_is_refused_and_changes_nothing():
    h = Harness()
    first = h.add("a", [1, 2, 3])
    with pytest.raises(ValueError, match="'a' is already in the engine"):
        h.add("a", [4, 5, 6])
    assert h.sched.requests["a"] is first and len(h.sched.waiting) == 1
    h.run()
    h.assert_no_leaks()


def test_prompt_chunks_follow_the_time_budget_and_its_quadratic_attention_cost():
    # 1 ms a token and 1 us an attention pair, 100 ms a step: a chunk after p cached tokens is the
    # largest n with 1e-3 n + 1e-6 (n p + n (n + 1) / 2) <= 0.1
    cost = StepCost(overhead=0.0, per_token=1e-3, per_pair=1e-6, budget=0.1)
    h = Harness(blocks=2000, budget=4096, max_len=8192, cost=cost)
    h.add("long", [5] * 4000, max_tokens=1)
    chunks, starts = [], []
    while h.sched.has_work():
        out = h.step()
        starts.append(out.requests[0].num_computed)
        chunks.append(len(out.requests[0].token_ids))
    assert sum(chunks) == 4000
    for p, n in zip(starts[:-1], chunks[:-1], strict=True):
        assert 1e-3 * n + 1e-6 * (n * p + n * (n + 1) / 2) <= 0.1 + 1e-9  # fits
        m = n + 1
        assert 1e-3 * m + 1e-6 * (m * p + m * (m + 1) / 2) > 0.1  # and is the largest that does
    assert chunks[0] == 95 and chunks[-2] < chunks[0] / 2  # later chunks shrink as the context grows
    h.assert_no_leaks()


def test_a_short_request_gets_in_while_a_long_prompt_is_prefilled():
    cost = StepCost(overhead=0.0, per_token=1e-3, per_pair=1e-6, budget=0.1)
    h = Harness(blocks=2000, budget=4096, max_len=8192, cost=cost)
    h.add("long", [5] * 4000, max_tokens=1)
    h.step()
    h.step()
    h.add("short", [6] * 10, max_tokens=2)
    out = h.step()  # the long prompt leaves room: the short one is prefilled in this very step
    ids = {r.request_id: r for r in out.requests}
    assert set(ids) == {"long", "short"} and ids["short"].sample
    assert cost.predict(out.shape()) <= 0.1 + 1e-9
    out = h.step()  # and decodes next to the long prompt's next chunk
    assert {r.request_id for r in out.requests} == {"long", "short"}
    h.run(500)
    assert [r.request_id for r in h.finished][0] == "short"
    h.assert_no_leaks()


def test_a_short_request_gets_in_while_one_request_of_many_prompts_is_prefilled():
    """A client request of 16 prompts (its engine requests "cmpl-a-0" .. "cmpl-a-15") queued before a short
    request: the short one is admitted in the first step after it came, with the next of them, not after all 16
    (they had queued ahead of it, and it had waited for every one's prefill); the batch goes on in its order.
    Preempted requests still resume first."""
    cost = StepCost(overhead=0.0, per_token=1e-3, per_pair=1e-6, budget=0.1)
    h = Harness(blocks=4000, seqs=64, budget=4096, max_len=8192, cost=cost)
    for i in range(16):
        h.add(f"cmpl-a-{i}", [5 + i] * 600, max_tokens=1)
    h.step()
    h.add("cmpl-b-0", [3] * 10, max_tokens=2)
    admitted = []
    for _ in range(3):
        out = h.step()
        admitted += [r.request_id for r in out.requests if r.num_computed == 0]
        if "cmpl-b-0" in admitted:
            break
    assert "cmpl-b-0" in admitted and len(admitted) <= 3, admitted
    h.run(500)
    batch = [r.request_id for r in h.finished if r.request_id.startswith("cmpl-a-")]
    assert batch == [f"cmpl-a-{i}" for i in range(16)]
    h.assert_no_leaks()


def test_fair_order_puts_preempted_requests_first_then_takes_client_requests_in_turn():
    from app.engine.scheduler import fair_order

    requests = [Request(rid, [1], SamplingParams()) for rid in
                ("cmpl-a-0", "cmpl-a-1", "cmpl-a-2", "cmpl-b-0", "chat-c-0", "chat-c-1", "cmpl-a-3", "7-0")]
    requests[6].status = Status.PREEMPTED
    assert [r.request_id for r in fair_order(requests)] == [
        "cmpl-a-3", "cmpl-a-0", "cmpl-b-0", "chat-c-0", "7-0", "cmpl-a-1", "chat-c-1", "cmpl-a-2"]


def test_an_empty_step_always_makes_progress_whatever_the_budget():
    # a token alone is over budget
    cost = StepCost(overhead=1e-3, per_token=1.0, per_pair=1e-6, budget=0.1)
    h = Harness(blocks=200, budget=4096, max_len=8192, cost=cost)
    h.add("a", [5] * 100, max_tokens=2)
    out = h.step()
    assert len(out.requests[0].token_ids) == 16  # MIN_CHUNK
    h.run(50)
    h.assert_no_leaks()


@pytest.mark.parametrize(("overhead", "chunk"), [(0.15, 474), (0.04, 144), (0.01, 82)])
def test_prompts_get_what_the_decodes_leave_of_the_budget_or_three_times_the_decodes_time(overhead, chunk):
    # 8 decodes cost 158 ms (over the 100 ms budget) or 48 ms (half of it): prompts still get 3x that, not what is
    # left of the budget (nothing, or 52 ms); at 18 ms they get what is left (82 ms; 3x would be 54)
    cost = StepCost(overhead=overhead, per_token=1e-3, per_pair=0.0, budget=0.1)
    h = Harness(blocks=400, seqs=16, budget=4096, max_len=8192, cost=cost)
    for i in range(8):
        h.add(f"d{i}", [5], max_tokens=50)
    h.step()
    h.add("new", [6] * 1000, max_tokens=1)
    out = h.step()
    chunks = {r.request_id: len(r.token_ids) for r in out.requests}
    assert all(chunks[f"d{i}"] == 1 for i in range(8))
    assert abs(chunks["new"] - chunk) <= 1  # (float rounding)
    decodes = overhead + 8e-3
    assert cost.predict(out.shape()) <= max(0.1, 4 * decodes) + 1e-9
    h.run(500)
    h.assert_no_leaks()


def test_scheduled_tokens_say_how_many_are_the_prompts():
    """The runner runs prompt tokens and generated ones their own ways (kernels.widens_prompts), whatever the
    chunking: a prompt's chunks are all prompt tokens, a decode none, a prompt's last token alone after a
    prefix-cache hit one."""
    h = Harness(budget=32)
    h.add("a", [5] * 40, max_tokens=3)
    rows = [(len(r.token_ids), r.prompt_rows) for r in h.step().requests]
    rows += [(len(r.token_ids), r.prompt_rows) for r in h.step().requests]
    assert rows == [(32, 32), (8, 8)]
    assert [(len(r.token_ids), r.prompt_rows) for r in h.step().requests] == [(1, 0)]  # a decode
    h.run()
    h.add("b", [5] * 33, max_tokens=2)  # its first 32 tokens are a's cached blocks
    out = h.step()
    assert [(r.num_computed, len(r.token_ids), r.prompt_rows) for r in out.requests] == [(32, 1, 1)]
    h.run()


def test_the_step_carries_new_and_finished_requests_to_the_runner(h):
    """The runner learns of a request in the step that first schedules it, and forgets it in the next step
    after it finished or was aborted (also when it was aborted before ever running, it is never sent)."""
    h.add("a", [1, 2, 3], max_tokens=2)
    first = h.step()
    assert [n.request_id for n in first.new_requests] == ["a"]
    assert first.new_requests[0].prompt_ids == (1, 2, 3) and first.new_requests[0].eos_token_id == EOS
    assert first.finished_ids == ()
    h.add("b", [4, 5])
    h.add("never-ran", [6, 7])
    h.sched.finish("never-ran", FinishReason.ABORT)
    second = h.step()  # a's last token: it finishes in this step's update
    assert [n.request_id for n in second.new_requests] == ["b"] and second.finished_ids == ()
    h.sched.finish("b", FinishReason.ABORT)
    h.add("a", [1, 2, 3], max_tokens=1)  # the same id again, once the first "a" is gone
    third = h.step()
    assert set(third.finished_ids) == {"a", "b"}  # first the old ones are forgotten...
    assert [n.request_id for n in third.new_requests] == ["a"]  # ...then the new "a" is created
    h.run()
    h.add("c", [9])
    assert h.step().finished_ids == ("a",)
    h.run()


def test_requests_do_not_queue_for_their_first_token_where_decodes_take_half_the_budget():
    """The c32 serving benchmark (32 clients, 96 requests of 256 prompt tokens and 128 answer tokens, each client
    sending its next when one finishes) on a virtual clock, with a 2-core Zen 1's step times: 3.2 ms a prompt token
    (widened weights), 8.1 ms a decode, so 32 decodes take half the 0.5 s budget. Prompts given only what the decodes
    left measured a median TTFT of 15.4 s there (14.7 s here, at 5.1 ms a prompt token); with PREFILL_PER_DECODE,
    3.3 s. With the decodes costed as prompt tokens (one per-token term, as before the calibration's decode pass),
    the floor under-sized prompts once they became faster than decodes: 6.5 s there (4.0 s here); with their
    own term, 2.0 s here."""
    def seconds(out: SchedulerOutput) -> float:
        prompt = sum(len(r.token_ids) for r in out.requests if len(r.token_ids) > 1)
        decodes = sum(1 for r in out.requests if len(r.token_ids) == 1)
        return 0.010 + 0.0032 * prompt + 0.0081 * decodes

    cost = StepCost(overhead=0.010, per_token=0.0032, per_pair=2.5e-9, budget=0.5, per_decode=0.0081)  # as calibrated
    kv = KVCacheManager(KVCacheConfig(4096, 16, prefix_caching=False), "test-model")
    sched = Scheduler(SchedulerConfig(64, 2048, 8192, True), kv, cost)
    now, arrived, first, done = 0.0, {}, {}, 0

    def send():
        rid = f"r{len(arrived)}"
        prompt = [len(arrived) * 7 + i for i in range(256)]  # no two alike: nothing comes from the prefix cache
        sched.add(Request(rid, prompt, SamplingParams(max_tokens=128, ignore_eos=True), EOS))
        arrived[rid] = now

    for _ in range(32):
        send()
    while sched.has_work():
        out = sched.schedule()
        took = seconds(out)
        now += took
        cost.observe(out.shape(), took)
        sampled = {r.request_id: 7 for r in out.requests if r.sample}
        for rid in sampled:
            first.setdefault(rid, now)
        for _ in sched.update(out, sampled):
            done += 1
            if len(arrived) < 96:
                send()
    ttft = sorted(first[r] - arrived[r] for r in arrived)
    assert done == 96
    assert ttft[48] < 3.0, f"median TTFT {ttft[48]:.1f} s"
    assert 96 * 128 / now > 60  # output tokens/s: the same as without the floor or the decode term (67.4)
    assert all(c == 0 for c in kv.pool.ref_count)


def test_a_request_whose_grammar_failed_or_is_compiling_is_not_admitted():
    """Its compilation failed (a matcher in the error state, cancelled, or raised: the engine aborts such a request
    before the next step, EngineCore._failed_grammars), or is not done: it waits, and its prompt is not computed."""
    from concurrent.futures import Future

    from app.engine.structured import FailedMatcher

    h = make()
    futures = [Future() for _ in range(4)]
    futures[0].set_result(FailedMatcher("no tokenizer"))
    futures[1].cancel()
    futures[2].set_exception(RuntimeError("broken"))
    for i, future in enumerate(futures):
        h.add(str(i), [1, 2, 3], grammar="start: /a/").compiling = future
    h.add("plain", [4, 5, 6])
    out = h.step()
    assert [r.request_id for r in out.requests] == ["plain"]
    assert [r.grammar_state() for r in h.sched.waiting] == ["failed"] * 3 + ["pending"]
    futures[3].set_result(None)  # done: the runner compiles it itself
    out = h.sched.schedule()
    assert [r.request_id for r in out.requests] == ["plain", "3"] and out.new_requests[0].compiled is None


def test_a_client_request_whose_grammar_outlasts_its_share_of_a_step_waits_while_others_run():
    """charge_grammars: grammars that took 0.2 s of a 0.21 s step (0.01 s the model's) beside another client request
    hold their client request (both its sequences) back for twice what they took over GRAMMAR_SHARE of 0.01 s, while
    the other runs on; after the wait, or alone, it runs. Grammars within their share, or alone in their step, hold
    nothing back."""
    from app.engine.scheduler import GRAMMAR_SHARE

    now = [100.0]
    h = make()
    h.sched.clock = lambda: now[0]
    for rid in ("slow-0", "slow-1", "other-0"):
        h.add(rid, [1, 2, 3], max_tokens=50)
    both = h.step()
    assert len(both.requests) == 3
    h.sched.charge_grammars(both, 0.21, {"slow-0": 0.12, "slow-1": 0.08})
    wait = (0.2 - GRAMMAR_SHARE * 0.01) / GRAMMAR_SHARE
    assert h.sched.held_until == {"slow": pytest.approx(100.0 + wait)}
    assert [r.request_id for r in h.step().requests] == ["other-0"]
    h.sched._preempt(h.sched.requests["slow-1"])  # preempted while held: not admitted again until the wait ends
    now[0] += wait - 0.01
    assert [r.request_id for r in h.step().requests] == ["other-0"]
    now[0] += 0.02
    out = h.step()
    assert sorted(r.request_id for r in out.requests) == ["other-0", "slow-0", "slow-1"] and not h.sched.held_until
    h.sched.charge_grammars(out, 0.21, {"slow-0": 0.03, "slow-1": 0.02})  # 0.05 <= 0.16 * GRAMMAR_SHARE: its share
    assert not h.sched.held_until
    h.sched.finish("other-0", FinishReason.ABORT)
    alone = h.step()
    h.sched.charge_grammars(alone, 1.0, {"slow-0": 0.9})  # nobody else in the step: nobody waited for it
    assert not h.sched.held_until
    h.sched.held_until["slow"] = now[0] + 10  # held, but all that runs: it runs
    assert sorted(r.request_id for r in h.step().requests) == ["slow-0", "slow-1"]
    for rid in ("slow-0", "slow-1"):
        h.sched.finish(rid, FinishReason.ABORT)
    h.assert_no_leaks()


def test_a_grammar_a_little_over_its_share_is_credited_the_step_it_sat_out_past_its_wait():
    """Waits last whole steps: a client 0.01 s over its share of a 0.76 s step waits 0.02 s, which sits it out a
    whole 0.5 s step of the others; the 0.48 s past its wait's end is credit, so its next excess does not hold it
    back again (it runs every step but about one in 24, not every other one)."""
    from app.engine.scheduler import GRAMMAR_CREDIT

    now = [10.0]
    h = make()
    h.sched.clock = lambda: now[0]
    for rid in ("slow-0", "other-0"):
        h.add(rid, [1, 2, 3], max_tokens=50)
    both = h.step()
    h.sched.charge_grammars(both, 0.76, {"slow-0": 0.26})  # 0.25 allowed (half of 0.5): 0.01 over, a 0.02 s wait
    assert h.sched.held_until == {"slow": pytest.approx(10.02)}
    assert [r.request_id for r in h.step().requests] == ["other-0"]
    now[0] += 0.5  # the others' step
    both = h.step()
    assert sorted(r.request_id for r in both.requests) == ["other-0", "slow-0"]
    now[0] += 0.76
    h.sched.charge_grammars(both, 0.76, {"slow-0": 0.26})
    assert not h.sched.held_until and h.sched.grammar_credit["slow"] == pytest.approx(0.48 - 0.02)
    assert sorted(r.request_id for r in h.step().requests) == ["other-0", "slow-0"]
    h.sched.held_until["slow"] = now[0] + 0.001  # a wait whose end a long step overshoots by far: credit capped
    h.step()
    now[0] += 5.0
    out = h.step()
    h.sched.charge_grammars(out, 0.76, {})
    assert h.sched.grammar_credit["slow"] == GRAMMAR_CREDIT
    for rid in ("slow-0", "other-0"):
        h.sched.finish(rid, FinishReason.ABORT)
    h.assert_no_leaks()
