"""The goodput draft-length policy's decisions on hand-made cost and acceptance models
(engine-free; tests/test_lossless.py runs it in real engines, where outputs must stay exact
while the lengths change from step to step)."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
import torch

from vllm_clover.clover import CloverConfig, CloverHeads
from vllm_clover.clp import ClpHeads
from vllm_clover.draft_policy import (
    CALIBRATION_MIN_DRAFTS,
    EXPLORE_AFTER,
    EXPLORE_STEPS,
    MIN_SAMPLES,
    QUIET_STEPS,
    RECENT_ROWS,
    SAMPLES_PER_BUCKET,
    SETTLED_STEPS,
    WAKE_EVERY,
    AcceptanceModel,
    CostModel,
    CostsByBatch,
    DraftStats,
    GoodputPolicy,
    Looks,
    SharedDecisions,
    WholeSizes,
    bucket,
    calibration_counts,
    check_policy,
    estimate,
    first_draft_threshold,
    non_decreasing,
    plan_lengths,
)
from vllm_clover.layers import DenseLmHead

K = 4


def roofline(memory_bound_tokens: int = 8, seconds: float = 0.010):
    """A step that costs the same up to `memory_bound_tokens` tokens (reading the weights),
    then grows with every token (compute-bound), like a CPU target."""
    return lambda n: seconds * np.maximum(1.0, np.asarray(n, dtype=np.float64) / memory_bound_tokens)


def test_drafts_everything_when_the_target_is_memory_bound():
    rates = np.full((1, K), 0.7)
    assert plan_lengths(rates, [K], base_tokens=1, step_time=roofline()) == [K]


def test_whole_sizes_read_their_cost_function_and_extend_past_what_was_asked():
    calls = []
    cost = WholeSizes(lambda n: calls.append(len(n)) or roofline()(n))
    np.testing.assert_array_equal(cost(np.array([9, 3, 12])), roofline()(np.array([9, 3, 12])))
    np.testing.assert_array_equal(cost(np.arange(20)), roofline()(np.arange(20)))  # read from the table
    assert calls == [25]
    assert cost(np.array([40]))[0] == roofline()(40) and calls == [25, 81]


def test_stops_drafting_when_every_draft_costs_a_full_token_of_compute():
    rates = np.full((64, K), 0.7)
    assert plan_lengths(rates, [K] * 64, base_tokens=64, step_time=roofline()) == [0] * 64


def test_at_a_middle_load_the_confident_requests_draft_first():
    # 8 requests and room for 8 more tokens before each one costs in proportion.
    rates = np.array([[0.95] * K, [0.9] * K, [0.3] * K, [0.2] * K, *[[0.5] * K] * 4])
    lengths = plan_lengths(rates, [K] * 8, base_tokens=8, step_time=roofline(memory_bound_tokens=16))
    assert lengths[0] >= lengths[1] > 0 and lengths[2] == lengths[3] == 0
    assert sum(lengths) < 8 * K


def test_honours_each_budget_and_k():
    rates = np.full((3, K), 0.99)
    assert plan_lengths(rates, [4, 2, 0], base_tokens=3, step_time=lambda n: np.ones_like(n, dtype=float)) \
        == [4, 2, 0]


@pytest.mark.parametrize("rows, memory_bound_tokens, heads_seconds, margin",
                         [(1, 8, 0.002, 0.0), (4, 4, 0.001, 0.0), (16, 8, 0.0, 0.0), (64, 8, 0.003, 0.0),
                          (64, 128, 0.0, 0.0), (1, 8, 0.002, 0.05), (4, 4, 0.0, 0.03), (64, 128, 0.0, 0.02)])
def test_below_the_first_draft_threshold_no_plan_drafts(rows, memory_bound_tokens, heads_seconds, margin):
    """The shortcut that skips planning where nothing pays never changes a plan."""
    step_time = roofline(memory_bound_tokens, seconds=0.010)
    heads_time = (lambda depth: heads_seconds * np.asarray(depth)) if heads_seconds else None
    threshold = first_draft_threshold(rows, K, rows, step_time, heads_time, margin)
    rng = np.random.default_rng(rows)
    for _ in range(20):
        rates = rng.uniform(0, 1, (rows, K)) * [min(0.999 * threshold, 1), 1, 1, 1]
        rates[rng.integers(rows), 1:] = 1.0  # one row sure of every later draft
        assert plan_lengths(rates, [K] * rows, rows, step_time, heads_time, margin) == [0] * rows


def test_the_first_draft_threshold_is_tight():
    """Rows whose later drafts are sure (every marginal equal to the first rate) draft just
    above it: a step whose every token costs a tenth of an empty step's."""
    step_time = lambda n: 0.010 + 0.001 * np.asarray(n, dtype=np.float64)  # noqa: E731
    threshold = first_draft_threshold(16, K, 16, step_time)
    assert 0 < threshold < 1
    sure_later = np.tile([threshold * 1.001, 1.0, 1.0, 1.0], (16, 1))
    assert sum(plan_lengths(sure_later, [K] * 16, 16, step_time)) > 0


def test_a_policy_skipping_plans_below_the_threshold_decides_as_one_that_plans_every_step(monkeypatch):
    """Served step by step at batch 8 with rows of random confidence, on a target where a
    draft pays only for the likeliest rows: the same lengths every step, with the shortcut
    and with a plan run every step."""
    from vllm_clover import draft_policy

    plans = []
    monkeypatch.setattr(draft_policy, "plan_lengths", lambda *args: plans.append(1) or plan_lengths(*args))

    def serve() -> list[list[int]]:
        plans.clear()
        c, rng = Clock(), np.random.default_rng(0)
        policy, ids, chosen, drafted = GoodputPolicy(K, clock=c), [f"r{i}" for i in range(8)], [], [0] * 8
        for _ in range(400):
            tokens = 8 + sum(drafted)
            c.now += 0.010 + 0.004 * tokens
            policy.observe_step(tokens, ids, dict(zip(ids, drafted)),
                                {r: int(rng.integers(0, n + 1)) for r, n in zip(ids, drafted)})
            drafted = policy.lengths(rng.beta(2, 2, (8, K)), [K] * 8, heads_to_run=True)
            policy.heads_timed(0.0005 * max(drafted))
            policy.end_step(ids)
            chosen.append(drafted)
        return chosen

    with_shortcut, planned_with_shortcut = serve(), len(plans)
    monkeypatch.setattr(draft_policy, "first_draft_threshold", lambda *args: -1.0)  # never below it
    assert serve() == with_shortcut
    # (the first 4 steps measure, unplanned: the first drafting one follows none, so prices nothing)
    assert len(plans) == 400 - 4 > 2 * planned_with_shortcut
    assert sum(1 for lengths in with_shortcut[4:] if sum(lengths)) > 0  # planned drafts, not only the measuring ones


def test_a_gain_inside_the_step_tables_noise_drafts_nothing():
    """Batch 4 on a step whose every token costs 5.8% of an empty step (SmolLM2's): rows
    accepted at 25% gain 2% by the table's medians (break-even 23%), which a margin of 3%
    (the noise of those medians) does not credit; rows accepted at 60% still draft."""
    step_time = lambda n: 0.0584 + 0.0044 * np.asarray(n, dtype=np.float64)  # noqa: E731  76 ms at 4 tokens
    marginal = np.tile([0.25, 0.0, 0.0, 0.0], (4, 1))
    assert plan_lengths(marginal, [K] * 4, 4, step_time) == [1, 1, 1, 1]
    assert plan_lengths(marginal, [K] * 4, 4, step_time, margin=0.03) == [0, 0, 0, 0]
    sure = np.tile([0.6, 0.0, 0.0, 0.0], (4, 1))
    assert plan_lengths(sure, [K] * 4, 4, step_time, margin=0.03) == [1, 1, 1, 1]


def test_a_step_tables_noise_is_the_standard_error_of_its_medians():
    quiet, noisy = CostModel(), CostModel()
    for i in range(SAMPLES_PER_BUCKET):
        quiet.observe(4, 0.070)
        noisy.observe(4, 0.070 * (1.1 if i % 2 else 0.9))  # 10% either side
        noisy.observe(8, 0.080)
    assert quiet.relative_error() == 0.0
    # One bucket: MAD 0.1 x 1.48 = sigma, over sqrt(16), x 1.25 for a median; pooled
    # (root mean square) with a quiet one.
    one_bucket = 1.4826 * 0.1 * np.sqrt(np.pi / 2) / 4
    assert noisy.relative_error() == pytest.approx(one_bucket / np.sqrt(2), rel=0.01)


def test_a_policy_on_a_noisy_step_stops_drafting_for_a_slivers_gain():
    """Served at batch 4 on the step above, 30% of first drafts accepted (heads 1 ms a
    position): on a steady machine the plan drafts for its ~4% gain; where each size's step
    times scatter +-10% about the same medians (so known to ~4%), it drafts nothing."""
    def planned_drafts(scatter: float) -> int:
        signs = collections.defaultdict(lambda: itertools.cycle([1, 0, -1]))  # per size: medians stay exact
        step_time = lambda n: (0.0584 + 0.0044 * n) * (1 + scatter * next(signs[bucket(n)]))  # noqa: E731
        turns = itertools.count()
        accept = lambda n: int(n > 0 and next(turns) % 10 < 3)  # noqa: E731
        c = Clock()
        policy = GoodputPolicy(K, clock=c)
        run_steps(policy, c, 4, step_time, steps=300, confidence=0.3, accept=accept)
        run_steps(policy, c, 4, step_time, steps=150, confidence=0.3, accept=accept, stats=(stats := DraftStats(K)))
        return stats.drafted_by["plan"]

    assert planned_drafts(scatter=0.0) > 0
    assert planned_drafts(scatter=0.10) == 0


def test_costly_heads_shorten_the_chain():
    """With heads that cost a step's time per position, only the first positions pay."""
    rates = np.full((1, K), 0.9)
    flat = lambda n: np.full(np.shape(n), 0.010)  # noqa: E731
    free = plan_lengths(rates, [K], 1, flat, heads_time=lambda h: 0.0 * h)
    costly = plan_lengths(rates, [K], 1, flat, heads_time=lambda h: 0.006 * h)
    assert free == [K] and 0 < costly[0] < K


def test_acceptance_is_counted_per_position_and_confidence():
    model = AcceptanceModel(K)
    confident = np.array([0.95, 0.95, 0.95, 0.95])
    prior = model.rates(confident[None])[0]
    for _ in range(100):  # two requests a step, four drafts verified each
        model.observe(np.stack([confident, confident]), verified=np.array([4, 4]), accepted=np.array([1, 1]))
    # position 0 accepted, 1 rejected, 2-3 never judged: the bin's rate over positions 0-1
    after = model.rates(confident[None])[0]
    assert after[0] > 0.99 * prior[0] and after[1] < 0.1
    pooled = (200 + 2 * prior[2]) / (400 + 2)
    assert after[2] == pytest.approx(pooled) and after[3] == pytest.approx(pooled)
    assert model.tried.sum(1).tolist() == [200, 200, 0, 0]


def test_an_average_requests_later_drafts_are_judged_on_the_rows_that_reached_them():
    """Half the rows sure at every position (0.95), half unsure (0.05): each position's rate
    averaged over all rows is 0.5, but a second draft is judged only where the first was
    accepted, mostly on sure rows: (0.95^2 + 0.05^2) / (0.95 + 0.05) = 0.905."""
    model = AcceptanceModel(K)
    assert model.chain_rates() is None
    model.note_confidence(np.array([[0.95] * 2, [0.05] * 2]))  # the heads ran two deep
    rates = model.chain_rates()
    assert rates[0] == pytest.approx(0.5) and rates[1] == pytest.approx(0.905)
    assert rates[2:].tolist() == [0, 0]  # no row reached them


def test_rows_noted_step_by_step_count_as_the_latest_rows_noted_at_once():
    """Confidences are noted every step but reach the chain rates' ring buffers only when
    read: steps of varying depth, more rows than the buffers hold, give the chain rates of
    the latest RECENT_ROWS rows as if noted in one go."""
    rng = np.random.default_rng(0)
    steps = [rng.random((int(rng.integers(1, 9)), int(rng.integers(1, K + 1)))) for _ in range(150)]
    step_by_step = AcceptanceModel(K)
    for confidence in steps:
        step_by_step.note_confidence(confidence)
    at_once = AcceptanceModel(K)
    for j in range(K):  # per position, the rows whose heads ran at least that deep
        reached = np.concatenate([c[:, : j + 1] for c in steps if c.shape[1] > j])
        at_once.recent[j].add(AcceptanceModel.bins(reached))
    assert sum(len(c) for c in steps) > RECENT_ROWS
    np.testing.assert_allclose(step_by_step.chain_rates(), at_once.chain_rates())


def policy_at_batch_1(heads_seconds_per_position: float) -> GoodputPolicy:
    """A policy that has measured batch 1: every step 10 ms whatever its drafts (memory-bound),
    the heads linear in the positions they draft."""
    policy = GoodputPolicy(K, clock=Clock())
    for _ in range(8):
        policy.step_costs.observe(1, 1, 0.010)
        policy.step_costs.observe(1, 1 + K, 0.010)
        for positions in range(1, K + 1):
            policy.heads_costs.observe(1, positions, heads_seconds_per_position * positions)
    return policy


def test_a_chain_of_likely_drafts_runs_the_heads_deep_where_each_head_alone_looks_unsure():
    """Clover's depth, planned from the average request: a rare sure row (1 in 4) whose
    drafts are all accepted pays for all four heads at a cost that per-position averages
    (0.26 a position: 0.26^4 ~ 0.005 for the fourth) would never pay."""
    policy = policy_at_batch_1(heads_seconds_per_position=0.001)
    policy.acceptance.note_confidence(np.array([[0.99] * K, [0.01] * K, [0.01] * K, [0.01] * K]))
    assert policy.heads_to_run([K]) == K
    averaged = np.full((1, K), 0.26)
    assert plan_lengths(averaged, [K], 1, policy.step_costs.scaled(0, 1)[0], lambda h: 0.001 * h)[0] < K


def test_under_confident_heads_judged_only_near_the_front_still_run_deep():
    """Heads that say 0.35 and are always right, judged so far at their first two positions
    only (a shallow plan): the deeper positions take the bin's rate measured there, not the
    confidence, so all four heads run (on the confidence alone: two)."""
    policy = policy_at_batch_1(heads_seconds_per_position=0.002)
    unsure = np.full((50, K), 0.35)
    policy.acceptance.observe(unsure, verified=np.full(50, 2), accepted=np.full(50, 2))
    policy.acceptance.note_confidence(unsure)
    assert policy.heads_to_run([K]) == K
    by_confidence = np.full((1, K), 0.35)
    by_confidence[0, :2] = 1.0
    assert plan_lengths(by_confidence, [K], 1, policy.step_costs.scaled(0, 1)[0], lambda h: 0.002 * h)[0] == 2


def test_held_out_acceptance_is_counted_as_served_drafts_are_and_becomes_the_prior():
    """Rows whose first two drafts were right (runs 2) at confidence 0.95, and rows that missed
    the first (runs 0) at 0.15: position 2 is judged only after two right drafts."""
    confidence = np.array([[0.95, 0.95, 0.95, 0.95]] * 30 + [[0.15, 0.15, 0.15, 0.15]] * 10)
    runs = np.array([2] * 30 + [0] * 10)
    calibration = calibration_counts(confidence, runs)
    tried, accepted = np.array(calibration["tried"]), np.array(calibration["accepted"])
    assert tried[:, 9].tolist() == [30, 30, 30, 0] and accepted[:, 9].tolist() == [30, 30, 0, 0]
    assert tried[:, 1].tolist() == [10, 0, 0, 0] and accepted[:, 1].tolist() == [0, 0, 0, 0]
    prior = AcceptanceModel(K, calibration).prior
    # Measured on >= CALIBRATION_MIN_DRAFTS drafts: the held-out rate; too few: the bin's centre.
    assert prior[0, 9] == 1.0 and prior[2, 9] == 0.0 and 10 < CALIBRATION_MIN_DRAFTS
    assert prior[0, 1] == pytest.approx(0.15) and prior[3, 9] == pytest.approx(0.95)
    assert np.array_equal(AcceptanceModel(2, calibration).prior, prior[:2])  # K below the heads'


def test_step_cost_interpolates_and_guesses_the_unmeasured_side_cheap():
    cost = CostModel()
    for _ in range(5):
        cost.observe(4, 0.010)
        cost.observe(16, 0.022)
    predicted = cost.predict(np.array([1, 4, 10, 16, 64]))
    assert predicted[1] == pytest.approx(0.010) and predicted[3] == pytest.approx(0.022)
    assert predicted[2] == pytest.approx(0.016)        # linear in tokens between buckets
    assert predicted[4] == pytest.approx(0.070)        # beyond: on at the last slope (1 ms a token), the least it costs
    assert predicted[0] == pytest.approx(0.0025)       # below: in proportion, so not drafting gets tried
    cost.observe(4, 10.0)  # the engine sat idle: not a step's cost (the median of its bucket)
    assert cost.predict(np.array([4]))[0] == pytest.approx(0.010)
    cost.observe(32, 1.0)  # one sample is not yet an estimate
    assert cost.predict(np.array([32]))[0] == pytest.approx(0.038)
    one_size = CostModel()
    for _ in range(3):
        one_size.observe(4, 0.010)
    assert one_size.predict(np.array([16]))[0] == pytest.approx(0.010)  # no slope yet: flat, so drafting gets tried
    for _ in range(3):  # noise, or a bucket measured under another load: outvoted by its neighbour
        cost.observe(8, 0.005)
    assert cost.predict(np.array([4]))[0] == pytest.approx(cost.predict(np.array([8]))[0])
    assert 0.005 < cost.predict(np.array([8]))[0] < 0.010


def test_a_looks_samples_move_with_the_planned_steps_of_their_moment():
    """A look measures a deeper step for a few steps and then stands for thousands, while
    the machine's speed drifts: its samples are read in proportion to the planned steps
    measured beside them, not as the seconds of their moment."""
    cost = CostModel()
    for _ in range(16):
        cost.observe(4, 0.020)             # a slow spell
    for _ in range(4):
        cost.observe(8, 0.024, look=True)  # a look one deeper: 20% dearer than the plan
    assert cost.predict(np.array([8]))[0] == pytest.approx(0.024)
    for _ in range(16):
        cost.observe(4, 0.010)             # the machine runs twice as fast again
    assert cost.predict(np.array([4, 8])).tolist() == pytest.approx([0.010, 0.012])
    for _ in range(16):
        cost.observe(8, 0.013)             # planned there since: its own seconds, the look's gone
    assert cost.predict(np.array([8]))[0] == pytest.approx(0.013)


def test_a_rare_sizes_samples_move_with_the_usual_steps_of_their_moment():
    """A plan that mostly drafts nothing measures its drafting sizes in few steps, each
    standing for thousands: read at the speed of their moment beside no-draft steps
    measured at another, drafting looked cheap in a slow spell (CLP, demo base, batch 4)."""
    cost = CostModel()
    for _ in range(16):
        cost.observe(4, 0.004)   # steps without drafts, in a fast spell
    for _ in range(3):
        cost.observe(8, 0.006)   # the plan's rare drafting steps: 50% dearer
        cost.observe(20, 0.007)
    for _ in range(16):
        cost.observe(4, 0.006)   # a slow spell since
    assert cost.predict(np.array([4, 8, 20])).tolist() == pytest.approx([0.006, 0.009, 0.0105])


def test_an_unmeasured_batch_size_is_read_per_request_from_its_nearest_neighbour():
    steps = CostsByBatch(sizes_per_batch=True)
    for _ in range(3):  # batch 4: 1 token a request costs 10 ms, 5 tokens a request 30 ms
        steps.observe(4, 4, 0.010)
        steps.observe(4, 20, 0.030)
    assert estimate(8, []) is None and estimate(8, [CostsByBatch(sizes_per_batch=True)]) is None
    at_8 = estimate(8, [steps])
    assert at_8(np.array([8, 40])).tolist() == pytest.approx([0.020, 0.060])
    heads = CostsByBatch(sizes_per_batch=False)
    for _ in range(3):
        heads.observe(4, 2, 0.004)
    assert estimate(8, [heads])(np.array([2]))[0] == pytest.approx(0.008)  # positions stay, rows double the time

    for _ in range(3):  # batch 8 measured, but only without drafts: above that, it grows as batch 4's does
        steps.observe(8, 8, 0.012)
    assert estimate(8, [steps])(np.array([8, 40])).tolist() == pytest.approx([0.012, 0.036])
    prefill = CostsByBatch(sizes_per_batch=True)
    for _ in range(3):
        prefill.observe(6, 70, 0.050)
    assert estimate(6, [steps, prefill])(np.array([70]))[0] == pytest.approx(0.050)  # its own size first
    for _ in range(3):  # batch 8's prefill steps reach further; past its one size it grows as batch 4's decodes
        prefill.observe(8, 80, 0.030)
    assert estimate(8, [steps, prefill])(np.array([40]))[0] == pytest.approx(0.036)


def test_a_batch_size_passed_through_is_no_neighbour_to_extend_with():
    """The demo base's batch 64 had measured its decodes alone; a wave draining through batch
    45 had measured 48 tokens there, the same reach per request. Taken as the extension it
    lent no slope, so drafts past 64 tokens were priced flat and looked at for 12 steps a
    round; batch 16, which measured drafts, is the neighbour that reaches further."""
    steps = CostsByBatch(sizes_per_batch=True)
    for _ in range(3):
        steps.observe(64, 64, 0.024)
        steps.observe(45, 48, 0.020)
        for n, seconds in ((16, 0.007), (32, 0.013), (43, 0.016)):
            steps.observe(16, n, seconds)
    at_64 = estimate(64, [steps])
    assert at_64.source(128) == (steps, bucket(16))
    assert at_64(np.array([128]))[0] == pytest.approx(0.024 * 0.013 / 0.007)  # batch 16's rise from 1 to 2 a request


def test_a_step_seen_rising_is_not_priced_flat_past_its_largest_measured_size():
    """SmolLM2 at batch 4 had measured 4- and 8-token steps (2 ms a token) and batch 1 flat
    over 1-4 tokens: read per request, batch 1 said 8-16 tokens cost alike at batch 4, so
    every draft past the first per row looked free and rows accepted at 11-19% drafted the
    full budget. Past its largest size a batch size's step keeps its last slope."""
    steps = CostsByBatch(sizes_per_batch=True)
    for _ in range(3):
        steps.observe(4, 4, 0.070)
        steps.observe(4, 8, 0.078)
        for n in (1, 2, 3, 4):
            steps.observe(1, n, 0.060 if n > 1 else 0.057)
    at_4 = estimate(4, [steps])
    assert at_4(np.array([8, 12, 16])).tolist() == pytest.approx([0.078, 0.086, 0.094])
    rates = np.full((4, K), 0.12)
    assert plan_lengths(rates, [K] * 4, 4, at_4) == [1, 1, 1, 1]  # flat past 8 tokens: [4, 4, 4, 4]
    assert plan_lengths(np.full((4, K), 0.10), [K] * 4, 4, at_4) == [0, 0, 0, 0]


def test_a_growing_queue_does_not_draft_at_each_new_batch_size():
    """The load run's gap: under a queue the batch keeps reaching sizes never measured, and the
    policy drafted the full budget at each until it had measured it; now it plans there as
    at the nearest batch size it knows."""
    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    step_time = roofline(memory_bound_tokens=8, seconds=0.010)
    assert sum(run_steps(policy, c, 16, step_time, steps=30)[-1]) == 0
    for batch in (20, 24, 30, 40, 48, 60, 64):
        assert all(sum(s) == 0 for s in run_steps(policy, c, batch, step_time, steps=4))


def test_far_from_the_batch_sizes_measured_each_next_draft_is_measured_before_it_is_priced():
    """After a warm-up at batch 128 (compute-bound: every token costs in proportion), batch 1
    on a target that reads its weights in the same time up to 8 tokens: priced per request
    from batch 128, a draft costs as much as a decode, and scheduled looks come too rarely to
    find out otherwise. The policy looks one draft deeper at once wherever no batch size
    near this one has measured it, and climbs as far as drafting pays: the whole budget."""
    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    step_time = roofline(memory_bound_tokens=8, seconds=0.010)
    assert sum(run_steps(policy, c, 128, step_time, steps=30, accept=K)[-1]) == 0
    steps = run_steps(policy, c, 1, step_time, steps=60, accept=K)
    assert steps[-10:] == [[K]] * 10


def test_after_a_compute_bound_batch_two_octaves_up_batch_1_still_measures_its_next_draft():
    """Clover on SmolLM2 stopped drafting at batch 1 after serving batch 4 (the warmed
    fresh-engines run, benchmarks/results/policy/HISTORY.md): a step at batch 4 is
    compute-bound (8 tokens cost 2x 4), and read per request that prices a batch-1 draft as a
    second decode, where at batch 1 the target reads its weights once for up to 4 tokens, and
    the scheduled looks come every EXPLORE_AFTER steps at the soonest. A larger batch's
    figures are not trusted for the next draft: each is measured at batch 1 before it is
    priced."""
    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    step_time = roofline(memory_bound_tokens=4, seconds=0.010)
    run_steps(policy, c, 4, step_time, steps=30, accept=K)
    steps = run_steps(policy, c, 1, step_time, steps=60, accept=K)
    assert steps[-10:] == [[3]] * 10  # the 4 tokens a step that reads the weights once runs


def test_a_look_one_deeper_begun_at_a_waves_first_step_is_begun_again_at_that_batch_size():
    """A wave's first step samples one request while the rest wait for their prefill: the
    look one draft deeper begun there for batch 1 runs at the batch the wave fills to. The
    demo base's Clover, whose look for batch 1 was spent so in warm-up, drafted nothing for
    ~340 steps when batch 1 came (its plan read batch 4's compute-bound figures). The size
    counts as measured once it is, so batch 1 looks again and climbs."""
    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    step_time = roofline(memory_bound_tokens=4, seconds=0.010)
    run_steps(policy, c, 4, step_time, steps=30, accept=K)
    run_steps(policy, c, 1, step_time, steps=1, accept=K)  # the next wave's first step,
    run_steps(policy, c, 4, step_time, steps=30, accept=K)  # where the look runs on
    steps = run_steps(policy, c, 1, step_time, steps=60, accept=K)
    assert steps[-10:] == [[3]] * 10  # the 4 tokens a step that reads the weights once runs


def test_a_draining_wave_begins_no_look_at_the_sizes_it_passes_through():
    """A wave of 64 draining as its requests finish: a new batch size every few steps, none
    measured. A look one draft deeper begun at each (the demo base's warm-up: at 53, 36, 11
    and 2 rows) drafts every request for sizes no plan runs at; the policy looks only at a
    batch size held for SETTLED_STEPS decode-only steps."""
    c = Clock()
    policy, stats = GoodputPolicy(K, clock=c), DraftStats(K)
    step_time = roofline(memory_bound_tokens=4, seconds=0.010)
    run_steps(policy, c, 64, step_time, steps=30, accept=0)
    for batch in (45, 32, 23, 16, 11, 8, 6, 4):
        run_steps(policy, c, batch, step_time, steps=SETTLED_STEPS - 1, accept=0, stats=stats)
    assert stats.drafted_by["deeper_look"] == 0
    run_steps(policy, c, 4, step_time, steps=EXPLORE_STEPS, accept=0, stats=stats)  # held: now it measures
    assert stats.drafted_by["deeper_look"] > 0


def test_a_policy_that_skips_searches_known_to_find_nothing_decides_as_one_that_searches_every_step(monkeypatch):
    """`_measure_deeper` keeps the inputs it last found nothing to measure for and skips the
    search while they last: over batch sizes met, left and met again (looks begun, sizes
    given up on, estimates rebuilt), the same lengths every step as a policy searching anew
    every step, for a fraction of the searches."""
    searches = []
    unmeasured = GoodputPolicy._unmeasured
    monkeypatch.setattr(GoodputPolicy, "_unmeasured", lambda *args, **kw: searches.append(1) or unmeasured(*args, **kw))

    def serve(forget: bool) -> list[list[int]]:
        searches.clear()
        c = Clock()
        policy, chosen = GoodputPolicy(K, clock=c), []
        if forget:
            measure_deeper = policy._measure_deeper

            def searching_anew(*args, **kw):
                policy._nothing_deeper = None
                measure_deeper(*args, **kw)
            policy._measure_deeper = searching_anew
        for batch, memory_bound_tokens in ((64, 8), (16, 8), (1, 4), (4, 4), (1, 4), (16, 32)):
            chosen += run_steps(policy, c, batch, roofline(memory_bound_tokens), steps=120, accept=2)
        return chosen

    remembering, searched = serve(forget=False), len(searches)
    assert serve(forget=True) == remembering
    assert 3 * searched < len(searches)
    assert all(map(sum, remembering[5 * 120 - 20: 5 * 120]))  # batch 1, met again: it drafts


def test_non_decreasing_pools_violators_by_weight():
    assert non_decreasing(np.array([1.0, 5.0, 3.0, 6.0]), [1, 1, 3, 1]).tolist() == [1.0, 3.5, 3.5, 6.0]
    assert non_decreasing(np.array([2.0, 1.0]), [1, 1]).tolist() == [1.5, 1.5]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(policy: GoodputPolicy, clock: Clock, num_requests: int, step_time, steps: int,
              confidence: float = 0.6, accept=2, stats: DraftStats | None = None) -> list[list[int]]:
    """Drive the policy as the runner hook does, on a simulated engine (and count its drafts
    in `stats`, as the engine does). `accept`: drafts accepted per request, at most, or a
    function of the number drafted."""
    ids, chosen, drafted = [f"r{i}" for i in range(num_requests)], [], [0] * num_requests
    for _ in range(steps):
        tokens = num_requests + sum(drafted)
        clock.now += float(step_time(tokens))
        accepted = {r: accept(n) if callable(accept) else min(accept, n) for r, n in zip(ids, drafted)}
        policy.observe_step(tokens, ids, dict(zip(ids, drafted)), accepted)
        budgets = [K] * num_requests
        depth = policy.heads_to_run(budgets)
        if depth:
            clock.now += 0.001 * depth
            policy.heads_timed(0.001 * depth)
            drafted = policy.lengths(np.full((num_requests, depth), confidence), [min(b, depth) for b in budgets])
        else:
            policy.heads_timed(0.0)
            drafted = [0] * num_requests
        policy.end_step(ids)
        if stats is not None:
            stats.record(drafted, policy.decided_by)
        chosen.append(drafted)
    return chosen


def test_policy_drafts_at_low_load_and_stops_at_high_load():
    step_time = roofline(memory_bound_tokens=8, seconds=0.010)
    low = run_steps(GoodputPolicy(K, clock=(c := Clock())), c, 1, step_time, steps=30)
    high = run_steps(GoodputPolicy(K, clock=(c := Clock())), c, 64, step_time, steps=30)
    assert low[0] == [K] and high[0] == [K] * 64  # nothing measured yet: the full budget
    assert all(sum(s) > 0 for s in low[-10:])
    assert all(sum(s) == 0 for s in high[-10:])  # the heads do not even run


def test_a_policy_whose_plans_draft_nothing_sleeps_through_most_steps_and_wakes_at_any_change():
    """Where nothing pays, the policy skips all but one of every WAKE_EVERY draft steps, which
    times the one step before it for the table, and wakes for another batch size; under
    tensor parallelism it never sleeps."""
    c, step_time = Clock(), roofline(memory_bound_tokens=8, seconds=0.010)
    policy = GoodputPolicy(K, clock=c)
    run_steps(policy, c, 64, step_time, steps=30 + QUIET_STEPS)
    slept, faster = [], 0.05  # the machine speeds up while the policy sleeps
    for _ in range(3 * WAKE_EVERY):
        c.now += faster  # the engine step, then its draft step
        slept.append(policy.asleep(64))
        if not slept[-1]:
            assert run_steps(policy, c, 64, lambda n: 0.0, steps=1) == [[0] * 64]
    assert slept == ([True] * (WAKE_EVERY - 1) + [False]) * 3
    # One step timed per wake, each one step's seconds (not the skipped steps' too)
    timed = [seconds for _, seconds, _ in policy.step_costs.models[bucket(64)].samples[bucket(64)]]
    assert timed[-4:] == pytest.approx([float(step_time(64)), faster, faster, faster])
    assert not policy.asleep(32)                     # a batch size not yet quiet
    assert not SharedDecisions(policy, lambda decision: decision).asleep(64)


def test_steps_with_prefill_chunks_neither_count_towards_sleep_nor_wake_the_policy():
    """Under arrivals nearly every step carries a prefill chunk: awake, such a step is planned
    as any other but leaves the count of quiet decode-only steps as it is, and asleep, it is
    skipped as any other (a new wave of the same size starts asleep)."""
    c, step_time = Clock(), roofline(memory_bound_tokens=8, seconds=0.010)
    policy = GoodputPolicy(K, clock=c)
    ids = [f"r{i}" for i in range(64)]
    run_steps(policy, c, 64, step_time, steps=30)

    def prefill_step():
        c.now += float(step_time(64 + 200))
        policy.observe_step(64 + 200, ids, {}, dict.fromkeys(ids[:-1], 0))  # the last row still prefilling
        assert policy.heads_to_run([K] * 63) == 0
        policy.end_step(ids[:-1])

    quiet = policy._quiet_steps[bucket(64)]
    prefill_step()
    assert policy._quiet_steps[bucket(64)] == quiet >= QUIET_STEPS  # neither counted nor broke the count
    assert [policy.asleep(64) for _ in range(WAKE_EVERY - 1)] == [True] * (WAKE_EVERY - 1)


def test_a_new_wave_whose_first_steps_run_a_smaller_batch_sleeps_at_once_at_its_own_size():
    """A wave's requests reach the engine one by one, so its first steps run a smaller batch:
    planned there, they leave the quiet count of the wave's own size as it was, and the
    policy sleeps there at once; heads that run at another size leave it asleep."""
    c, step_time = Clock(), roofline(memory_bound_tokens=8, seconds=0.010)
    policy = GoodputPolicy(K, clock=c)
    assert all(sum(lengths) for lengths in run_steps(policy, c, 1, step_time, steps=30)[-10:])  # pays alone
    run_steps(policy, c, 64, step_time, steps=30 + QUIET_STEPS)
    assert policy.asleep(64)
    assert not policy.asleep(40)                             # the next wave, half arrived
    assert run_steps(policy, c, 40, step_time, steps=1) == [[0] * 40]
    assert [policy.asleep(64) for _ in range(WAKE_EVERY - 1)] == [True] * (WAKE_EVERY - 1)
    assert not policy.asleep(1)
    assert run_steps(policy, c, 1, step_time, steps=1) != [[0]]  # the wave's last request drafts
    assert [policy.asleep(64) for _ in range(WAKE_EVERY - 1)] == [True] * (WAKE_EVERY - 1)


def test_the_summary_shows_each_confidence_bins_served_counts_beside_its_planned_rate():
    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    run_steps(policy, c, 4, roofline(), steps=30, confidence=0.85, accept=1)
    summary = policy.summary()
    bins = summary["by_position_and_confidence_bin"]
    judged, accepted = np.array(bins["judged"]), np.array(bins["accepted"])
    assert judged.sum(1).tolist() == summary["judged_drafts_per_position"]
    assert judged[0, 8] > 0 and judged.sum() == judged[:, 8].sum()  # every draft at confidence 0.85
    assert accepted[0, 8] == judged[0, 8] and accepted[1:].sum() == 0  # the first draft accepted, never the second
    rates = np.array(bins["rate_planned_with"])
    assert rates.shape == (K, 10) and rates[0, 8] > 0.9 > 0.2 > rates[1, 8]


def test_work_put_off_from_earlier_steps_is_not_a_cost_of_the_step_that_does_it():
    """Clover's augmenting block writes the KV of steps that drafted nothing when it next
    drafts: that time is left out of the step's sample, as the heads' time is."""
    plain, deferring = (GoodputPolicy(K, clock=(c := Clock())), c), (GoodputPolicy(K, clock=(d := Clock())), d)
    ids = ["r0", "r1"]
    for step in range(8):
        for policy, clock in (plain, deferring):
            clock.now += 0.010
            policy.observe_step(2, ids, {}, {r: 0 for r in ids})
            policy.heads_timed(0.0)
        deferring[1].now += 0.004 * (step % 3)  # the writes, inside the draft step
        deferring[0].deferred_work_timed(0.004 * (step % 3))
    assert deferring[0].step_costs.as_dict() == plain[0].step_costs.as_dict() != {}


def run_steady_arrivals(policy: GoodputPolicy, clock: Clock, steps: int, confidence: float, accept: int,
                        heads_seconds_per_position: float = 0.0, stats: DraftStats | None = None) -> list[int]:
    """Drive the policy as an open-loop server with 16 requests running: each step one finishes
    and a new one arrives, its prefill chunk (50 tokens) riding along, on a target compute-bound
    from 8 tokens. Each step's drafts, summed over its requests."""
    step_time = roofline(memory_bound_tokens=8, seconds=0.010)
    running = [f"r{i}" for i in range(16)]
    drafted, chosen = dict.fromkeys(running, 0), []
    for step in range(steps):
        tokens = len(running) + sum(drafted.values()) + 50
        clock.now += float(step_time(tokens))
        policy.observe_step(tokens, running, drafted, {r: min(accept, n) for r, n in drafted.items()})
        depth = policy.heads_to_run([K] * 16)
        policy.heads_timed(heads_seconds_per_position * depth)
        lengths = policy.lengths(np.full((16, depth), confidence), [depth] * 16) if depth else [0] * 16
        policy.end_step(running)
        if stats is not None:
            stats.record(lengths, policy.decided_by)
        chosen.append(sum(lengths))
        running = running[1:] + [f"new{step}"]
        drafted = dict(zip(running, lengths[1:] + [0]))
    return chosen


def test_under_steady_arrivals_every_step_carries_a_prefill_and_still_counts():
    """An open-loop server: each step one request finishes, a new one arrives and its
    prefill chunk (50 tokens) rides along. The policy measures those steps (else it would
    draft the full budget forever, as before it has measured) and plans on the decodes alone:
    on a target compute-bound from 8 tokens a draft costs a decode's time, so even drafts
    accepted ~97% of the time stop (planning on the step's prefill tokens too made them look
    cheap). A step after the engine sat idle (only new requests) is not a cost."""
    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    chosen = run_steady_arrivals(policy, c, steps=60, confidence=0.9, accept=1)
    assert chosen[0] == 16 * K and chosen[-10:] == [0] * 10 and policy.base_tokens == 16
    assert not policy.step_costs.models  # no decode-only step: the prefill steps' tables decided
    samples = sum(len(s) for m in policy.prefill_step_costs.models.values() for s in m.samples.values())
    c.now += 60.0  # the engine idles; then only new requests
    policy.observe_step(4, ["a", "b", "c", "d"], {}, {})
    assert sum(len(s) for m in policy.prefill_step_costs.models.values() for s in m.samples.values()) == samples


def test_a_policy_that_stopped_drafting_looks_one_draft_deeper_less_and_less_often():
    c = Clock()
    steps = run_steps(GoodputPolicy(K, clock=c), c, 64, roofline(), steps=30 + 15 * EXPLORE_AFTER, accept=0)
    looks = [i for i, s in enumerate(steps) if i >= 30 and sum(s) and not sum(steps[i - 1])]
    # each look EXPLORE_STEPS steps of one draft per request (the plan's 0, plus one); the gap
    # doubles while looking does not pay (from the first look, begun to measure one draft deeper)
    assert all(steps[i:i + EXPLORE_STEPS] == [[1] * 64] * EXPLORE_STEPS for i in looks)
    assert np.diff(looks).tolist() == [4 * EXPLORE_AFTER, 8 * EXPLORE_AFTER]


def test_each_draft_is_counted_by_what_decided_it():
    """Under load the plan stops drafting; what is drafted after that comes from looks, each
    EXPLORE_STEPS steps of one draft per request: first the one begun to measure one draft
    deeper (never measured at batch 64) once the batch has held SETTLED_STEPS steps, then,
    as that did not pay, the scheduled one 2 * EXPLORE_AFTER steps later."""
    c = Clock()
    policy, stats = GoodputPolicy(K, clock=c), DraftStats(K)
    steps = run_steps(policy, c, 64, roofline(), steps=30 + 2 * EXPLORE_AFTER, accept=0, stats=stats)
    by = stats.as_dict()["drafted_by"]
    assert sum(by.values()) == stats.drafted == sum(map(sum, steps)) and by["rule"] == 0
    measured = next(i for i, s in enumerate(steps) if s != [K] * 64)
    assert by["plan"] == measured * K * 64  # the full budget until the step time is measured
    # The plan's 0, plus one, once the batch held (the steps count from the first) and the
    # planned step is measured (the first step without drafts after drafting ones prices nothing)
    look, deeper = [1] * 64, max(SETTLED_STEPS - 1, measured + 1 + MIN_SAMPLES)
    assert steps[measured:deeper] == [[0] * 64] * (deeper - measured)
    assert steps[deeper:deeper + EXPLORE_STEPS] == [look] * EXPLORE_STEPS
    # Once: then batch 64 has measured one deeper; two deeper needs no look, the full budget
    # (measured first) being larger.
    assert by["deeper_look"] == EXPLORE_STEPS * 64
    scheduled = deeper + 2 * EXPLORE_AFTER
    assert steps[scheduled:scheduled + EXPLORE_STEPS] == [look] * EXPLORE_STEPS
    assert by["look"] == EXPLORE_STEPS * 64  # the next one comes twice as late: none paid


def test_a_policy_that_drafts_every_step_looks_at_not_drafting_too():
    """Steps without drafts were slow at first (an engine warming up) and drafting one token
    per request paid; then a step's cost settles, every token costs more than the last, and
    not drafting pays. A policy that drafts every step times no step without drafts, so
    only its looks without drafts can find that out (looks one deeper alone never did)."""
    steps_run = []

    def settling(n):
        steps_run.append(n)
        steady = 0.010 * (n / 4) ** 1.5
        return 0.05 if n == 4 and len(steps_run) < 100 else steady

    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    steps = run_steps(policy, c, 4, settling, steps=1600, accept=1)
    assert all(s == [1] * 4 for s in steps[60:100])  # drafting paid, and the policy drafted
    assert sum(map(sum, steps[-150:])) <= 4 * EXPLORE_STEPS  # at most one look's drafts


def drive_looks(looks: Looks, steps: int, planned_tokens: int, look_tokens: int) -> list[int]:
    """Steps of one second each, as the policy drives `Looks`: the last step's outcome, then
    the next step. Returns the steps at which looks began."""
    began, looked = [], None
    for step in range(steps):
        if looked is not None:
            looks.step_done(16, looked, look_tokens if looked else planned_tokens, 1.0)
        looks.next_step()
        if looks.now() and not looked:
            began.append(step)
        looked = looks.now()
    return began


def test_a_look_that_pays_brings_the_next_one_closer_by_half():
    looks = Looks()
    drive_looks(looks, 7 * EXPLORE_AFTER + 2 * EXPLORE_STEPS, planned_tokens=16, look_tokens=15)  # 3 looks, none paid
    assert looks.interval == 8 * EXPLORE_AFTER
    began = drive_looks(looks, 8 * EXPLORE_AFTER + 2 * EXPLORE_STEPS, planned_tokens=16, look_tokens=20)
    assert looks.interval == 4 * EXPLORE_AFTER  # one look that paid: halved, not back to the start
    drive_looks(looks, 4 * EXPLORE_AFTER + 2 * EXPLORE_STEPS, planned_tokens=16, look_tokens=20)
    assert looks.interval == 2 * EXPLORE_AFTER and len(began) == 1


def test_a_look_at_a_batch_size_no_planned_step_ran_leaves_the_interval():
    looks = Looks()
    for _ in range(EXPLORE_AFTER - 1):
        looks.step_done(1, False, 1, 1.0)
        looks.next_step()
    for _ in range(EXPLORE_STEPS + 1):  # the look, at batch 64, where nothing was planned before
        looks.next_step()
        looks.step_done(64, True, 0, 1.0)  # would not pay against the batch-1 steps
    assert looks.interval == EXPLORE_AFTER


def test_a_policy_prices_its_looks_relative_to_its_planned_steps():
    """The policy's tables get the look flag. At batch 64 drafts never pay: after the
    full-budget steps that measure, a look one deeper once the batch has held
    (`_measure_deeper`), beside steps without drafts; then the machine slows by half. The
    look's samples slow with the steps planned since."""
    c, speed = Clock(), [1.0]
    policy = GoodputPolicy(K, clock=c)

    def step_time(n):
        return speed[0] * roofline()(n)

    run_steps(policy, c, 64, step_time, steps=30 + EXPLORE_AFTER + EXPLORE_STEPS, accept=0)
    speed[0] = 1.5
    run_steps(policy, c, 64, step_time, steps=SAMPLES_PER_BUCKET)
    assert policy.step_costs.models[bucket(64)].predict(np.array([128]))[0] == pytest.approx(1.5 * roofline()(128))


def test_under_tensor_parallelism_every_rank_runs_the_heads_as_deep_as_rank_0():
    """Two ranks whose own clocks disagree (drafting pays on rank 0's, not on rank 1's) run
    their heads equally deep every step, as rank 0 decided (the heads' collectives would
    otherwise wait forever); rank 1's own policy has learned to stop."""
    clocks, requests, ids = [Clock(), Clock()], 16, [f"r{i}" for i in range(16)]
    policies = [GoodputPolicy(K, clock=clocks[0]), GoodputPolicy(K, clock=clocks[1])]
    step_times = [roofline(memory_bound_tokens=128), roofline(memory_bound_tokens=1)]
    broadcast: list = []  # rank 0 sends, rank 1 receives
    ranks = [SharedDecisions(policies[0], lambda decision: broadcast.append(decision) or decision),
             SharedDecisions(policies[1], lambda _: broadcast.pop(0))]
    drafted, depths = [[0] * requests, [0] * requests], []
    for _ in range(60):
        depths.append([])
        for rank, policy in enumerate(ranks):
            tokens = requests + sum(drafted[rank])
            clocks[rank].now += float(step_times[rank](tokens))
            policy.observe_step(tokens, ids, dict(zip(ids, drafted[rank])), {r: min(1, n) for r, n in
                                                                              zip(ids, drafted[rank])})
            depth = policy.heads_to_run([K] * requests)
            policy.heads_timed(0.0)
            drafted[rank] = policy.lengths(np.full((requests, depth), 0.9), [depth] * requests) if depth \
                else [0] * requests
            policy.end_step(ids)
            depths[-1].append(depth)
    assert all(rank0 == rank1 for rank0, rank1 in depths) and depths[-1][0] > 0 and not broadcast
    assert policies[1].heads_to_run([K] * requests) == 0  # alone, rank 1 would not draft


def test_goodput_is_the_default_and_other_names_are_refused():
    assert check_policy("goodput") == "goodput" and check_policy("fixed") == "fixed"
    with pytest.raises(ValueError, match="draft_policy must be one of 'goodput', 'fixed', got 'fast'"):
        check_policy("fast")


def test_heads_follow_the_policy():
    """Clover keeps per row what the policy allows; a policy that measured only slow steps
    skips the chain; CLP asks before its heads run, with their cost."""
    torch.manual_seed(0)
    H, V = 16, 11
    lm_head = DenseLmHead(torch.randn(V, H))
    clover = CloverHeads(CloverConfig(num_heads=K, hidden_size=H, vocab_size=V, intermediate_size=32,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=8))
    h, first = torch.randn(3, H), torch.tensor([1, 2, 3])
    policy = GoodputPolicy(K, clock=Clock())
    policy.observe_step(num_tokens=3, req_ids=["a", "b", "c"], verified={}, accepted=dict.fromkeys("abc", 0))
    assert [len(d) for d in clover.propose(h, first, lm_head, [4, 2, 0], policy)] == [4, 2, 0]
    for _ in range(3):  # heads that cost as much as a step, drafting tokens it rarely gets right
        policy.step_costs.observe(3, 3, 0.01)
        policy.step_costs.observe(3, 6, 0.02)  # one and two drafts deeper measured too: no look to take
        policy.step_costs.observe(3, 9, 0.03)
        policy.heads_costs.observe(3, 1, 0.01)
        policy.heads_costs.observe(3, 2, 0.02)
    policy.acceptance.note_confidence(np.full((1, K), 0.05))
    assert clover.draft_depth([4, 4, 4], policy) == 0

    clp = ClpHeads(num_heads=K, hidden_size=H)
    with torch.no_grad():
        clp.length.weight.zero_()
        clp.length.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 20.0]))  # P(L* = 4) ~ 1
    flat = GoodputPolicy(K, clock=Clock())
    flat.observe_step(num_tokens=3, req_ids=["a", "b", "c"], verified={}, accepted=dict.fromkeys("abc", 0))
    for _ in range(3):  # cheap heads, and a step whose time no draft changes
        flat.step_costs.observe(3, 3, 0.01)
        flat.heads_costs.observe(3, 1, 0.0001)
    assert [len(d) for d in clp.propose(h, first, lm_head, [4, 3, 1], flat)] == [4, 3, 1]


def test_a_fixed_cost_of_any_draft_is_not_read_as_the_cost_of_every_draft():
    """The demo base's Clover at batch 1 (compiled, warmed at larger batches first): a step
    with any draft paid ~1 ms more than one without (vLLM's speculative path), further
    drafts nearly nothing. Its look one draft deeper than a plan of none measured only the
    1- and 2-token steps, the slope past them was that jump, so every further draft looked
    as dear, and it drafted nothing where three deep paid (0.78x plain decoding against its
    fixed rule's 0.92x). From a plan of none it looks two drafts deeper too, so the slope
    past what it measured is a draft's own cost."""
    rng = np.random.default_rng(0)  # each draft accepted at 0.75, as the heads' confidence says

    def accepted(drafted: int) -> int:
        return int(np.argmin(np.append(rng.random(drafted) < 0.75, False)))

    def any_draft_costs_8_ms(n):
        return 0.010 + (n > 1) * (0.008 + 0.0001 * (n - 2))

    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    run_steps(policy, c, 4, roofline(memory_bound_tokens=4, seconds=0.010), steps=30, confidence=0.75, accept=accepted)
    steps = run_steps(policy, c, 1, any_draft_costs_8_ms, steps=80, confidence=0.75, accept=accepted)
    # One draft alone does not pay (1.75 tokens in 19 ms against 1 in 10), four do (3.05 in 22.2 ms).
    assert all(drafts[0] >= 3 for drafts in steps[-10:])


def test_a_step_without_drafts_is_priced_no_dearer_than_one_at_a_larger_batch_size():
    """The demo base's Clover at batch 1 drafted in nearly every step, and its few steps
    without drafts (after drafting ones, a request's first decode) timed dearer than batch
    4's: against that price one draft a step paid. Priced at batch 4's, none does."""
    def measured_batch_1(with_batch_4: bool) -> GoodputPolicy:
        policy = GoodputPolicy(K, clock=Clock())
        for _ in range(SAMPLES_PER_BUCKET):
            if with_batch_4:
                policy.step_costs.observe(4, 4, 0.004)
            for tokens, seconds in ((1, 0.006), (2, 0.006), (3, 0.0065), (5, 0.0065)):
                policy.step_costs.observe(1, tokens, seconds)
            for positions in range(1, K + 1):
                policy.heads_costs.observe(1, positions, 0.001 * positions)
        policy.acceptance.note_confidence(np.full((8, K), 0.5))
        return policy

    # Drafts accepted at 0.55: one draft, 1.55 tokens in 7 ms, beats none at 6 ms, not at 4.
    assert measured_batch_1(with_batch_4=False).heads_to_run([K]) == 1
    policy = measured_batch_1(with_batch_4=True)
    assert policy.heads_to_run([K]) == 0
    assert policy.lengths(np.full((1, K), 0.5), [K], heads_to_run=True) == [0]


def test_a_step_without_drafts_is_priced_as_it_costs_asleep_where_the_policy_has_slept():
    """Drafting nothing lets the policy sleep, and a step after a sleeping draft step carries
    none of the policy's planning: CLP on the demo base at batch 1 took 3.20 ms a step without
    drafts awake, 2.86 asleep, and against the awake price drafted first drafts accepted at
    0.43. Priced as it costs asleep, one draft no longer pays."""
    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    ids = ["r"]

    def step(seconds: float, drafted: int = 0) -> None:
        c.now += seconds
        policy.observe_step(1 + drafted, ids, {"r": drafted}, {"r": 0})

    for _ in range(SAMPLES_PER_BUCKET + 1):
        step(0.0032)                    # awake: its draft step planned
        policy.end_step(ids)
    for _ in range(SAMPLES_PER_BUCKET):
        for tokens, seconds in ((2, 0.0036), (3, 0.0038)):
            policy.step_costs.observe(1, tokens, seconds)
        for positions in range(1, K + 1):
            policy.heads_costs.observe(1, positions, 0.0009 * positions)
    policy.acceptance.note_confidence(np.full((8, K), 0.5))
    # First drafts accepted at 0.55: 1.55 tokens in 4.5 ms beat one in 3.2 ms awake (0.344 a ms
    # against 0.313).
    assert policy.lengths(np.full((1, K), 0.5), [K], heads_to_run=True) == [1]
    assert policy.slept_step_costs.measured() == {}
    for _ in range(MIN_SAMPLES):  # few: the step table's median stays the awake steps'
        policy._start_step_clock(c.now, looked=False, slept=True)  # as `asleep` starts it
        step(0.00286)
        policy.end_step(ids)
    assert policy.slept_step_costs.models[bucket(1)].predict(np.array([1])).tolist() == pytest.approx([0.00286])
    assert policy.step_costs.models[bucket(1)].predict(np.array([1])).tolist() == pytest.approx([0.0032])
    # Against 2.86 ms asleep, 1.55 tokens in 4.5 ms do not pay (0.344 a ms against 0.350).
    assert policy.lengths(np.full((1, K), 0.5), [K], heads_to_run=True) == [0]


def test_a_step_of_another_kind_than_the_one_before_it_prices_neither_kind():
    """A policy drafting nearly every step times few steps without drafts, each right after
    drafting ones, and dearer than steady ones: priced from them, a step without drafts looked
    as dear as one with two drafts (the demo base's Clover at batch 1). Only steps after a step
    of their own kind (drafts or none) are priced."""
    c = Clock()
    policy = GoodputPolicy(K, clock=c)

    def step(tokens: int, seconds: float) -> None:
        c.now += seconds
        policy.observe_step(tokens, ["r"], {"r": tokens - 1}, {"r": min(1, tokens - 1)})

    for _ in range(6):
        for _ in range(3):
            step(3, 0.005)
        step(1, 0.007)  # the first step without drafts after drafting ones
    for _ in range(4):
        step(1, 0.004)
    costs = policy.step_costs.models[bucket(1)]
    assert costs.predict(np.array([1, 3])).tolist() == pytest.approx([0.004, 0.005])


def test_a_queue_jumping_past_the_batch_sizes_measured_drafts_nothing_where_the_smaller_one_drafts_nothing():
    """SmolLM2's ramped load (benchmarks/results/policy/HISTORY.md): at the peak the batch
    jumped from ~4 to ~40, and at every new batch size the policy looked one and then two
    drafts deeper to measure them, every request drafting for 8 steps each, at 13% acceptance
    where a step of 1 draft a request cost 83% more than one of none. Read per request, a
    smaller batch prices drafts cheaper than they are (it is nearer to reading its weights
    once whatever it runs), so where it plans none, a larger one would plan none either and
    only the heads' time at the new size is measured, by running them without drafting."""
    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    step_time = roofline(memory_bound_tokens=4, seconds=0.010)
    run_steps(policy, c, 4, step_time, steps=40, confidence=0.2, accept=0)
    steps = run_steps(policy, c, 40, step_time, steps=30, confidence=0.2, accept=0)
    assert sum(map(sum, steps)) == 0
    assert policy.heads_costs.knows(40, 1)  # measured, not drafted


def test_while_every_step_carries_a_prefill_chunk_no_look_measures_decode_steps():
    """SmolLM2's ramped load at its peak (README): prompts arrived every step, so every step
    carried a prefill chunk and went to the prefill table, and the looks begun to measure a
    decode-only step one and two drafts deeper never measured one: each drafted every request
    for DEEPER_LOOK_STEPS steps (accepted 13%) and gave up. Such looks begin only after a step
    that ran decodes alone."""
    c = Clock()
    policy = GoodputPolicy(K, clock=c)
    stats = DraftStats(K)
    per_step = run_steady_arrivals(policy, c, steps=80, confidence=0.2, accept=0, heads_seconds_per_position=0.001,
                                   stats=stats)
    assert stats.drafted_by["deeper_look"] == 0
    assert per_step[0] == 16 * K and sum(per_step[10:]) == 0  # the full budget only until measured
