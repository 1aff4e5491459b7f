"""How many tokens to draft, per request and step: the goodput policy (vLLM-free).

A draft token pays only if the chance that it is accepted is worth what it costs: at batch
1 on a CPU the target reads its weights once whatever the token count, so drafts are
nearly free; at batch 16 every drafted token is one more the target must run, and a step
verifying 5 tokens a request costs ~2x one that verifies 1 (SmolLM2, README). Like
SmartSpec (arXiv 2406.14066), every step the policy picks each request's length k_r in
0..budget_r to maximise the step's goodput,

    goodput = sum_r (1 + E_r(k_r))  /  (D + T(n + sum_r k_r))

    E_r(k) = sum_{i<=k} prod_{j<=i} a_rj    expected accepted drafts of request r
    a_rj    chance that draft j of r is accepted if drafts 1..j-1 were (AcceptanceModel)
    T(n)    time of an engine step that runs n tokens (a CostModel)
    D       the heads' own time this step, by how many positions they draft (a CostModel)

Because a_rj <= 1, each request's marginal gains prod_{j<=i} a_rj fall with i, so the best
plan with N draft tokens in all takes the N largest marginals over the batch (each
request a prefix); the policy scans N and keeps the best goodput (`plan_lengths`), unless
it beats drafting nothing by less than the step table's noise: a gain inside the error of
the medians it is read from is no gain to bet a step on.

Both models learn online from the engine's own steps, so they fit the machine, the model
and the load: acceptance from what vLLM's rejection sampler accepted, per draft position
and per bin of the heads' own confidence, on top of that bin's rate over all positions
(a calibrated head's top-1 probability is its chance of being right, which is the prior);
the step time from the wall time between successive draft steps, per batch size and token
count (both in buckets; a look's steps priced relative to the planned ones beside them);
the heads' time per number of rows and positions. A batch size not yet measured borrows
the nearest measured one's figures (`estimate`), and a step without drafts is priced no
dearer than one at a larger batch size (`_no_dearer_than_a_larger_batch`); until any is
measured the policy drafts the full budget, which is also how it measures. Every so often it
looks past its plan (one draft deeper, or none at all), to re-measure what it no longer does
(`Looks`: less often while looking does not pay), and at once where one draft deeper (two, from a plan of none)
has not been measured at this batch size or one a little smaller, once the batch has held
its size a few steps, unless the plan reads it from a smaller batch size that measured it
(too cheap, if wrong: `_measure_deeper`).

`fixed` (speculative_config "draft_policy": "fixed") keeps each method's own rule: Clover
drafts its budget, CLP thresholds its predicted length at tau.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import Counter, deque
from typing import Callable

import numpy as np

POLICIES = ("goodput", "fixed")
DEFAULT_POLICY = "goodput"

CONFIDENCE_BINS = 10
PRIOR_WEIGHT = 2.0        # pseudo-observations behind each prior acceptance rate (few: heads are often under-confident)
# A calibration's rate for a (position, bin) replaces the bin's centre as the prior
# once it rests on this many drafts; rarer bins keep taking the confidence at its word.
CALIBRATION_MIN_DRAFTS = 20
RECENT_ROWS = 256          # the rows an average request's chain of acceptances is taken over
SAMPLES_PER_BUCKET = 16   # a cost bucket's estimate: the median of its latest samples,
MIN_SAMPLES = 3           # once it has this many
BUCKETS_PER_OCTAVE = 2
# Every EXPLORE_AFTER steps (at first), EXPLORE_STEPS steps try a neighbour of the plan
# (`Looks`). Several in a row, because the first drafting step after a pause runs on cold
# caches and costs more than drafting does in steady state.
EXPLORE_AFTER = 200
EXPLORE_AFTER_MAX = 3200
EXPLORE_STEPS = 4
# A step's cost per request read from a batch size up to this much smaller is trusted; from
# further, or from a larger one, it is measured (`GoodputPolicy._measure_deeper`).
NEAR_OCTAVES = 2
# A look begun one draft deeper where a size is unmeasured runs again while the size stays
# unmeasured, until this many of such looks' steps ran at the size's own batch size: steps
# that carry prefill chunks never reach the decode tables, and may be all there is.
DEEPER_LOOK_STEPS = 2 * EXPLORE_STEPS
# A look begun to measure a batch size runs only once the batch has held that size (its bucket)
# for this many decode-only steps: one measures a size for the plans that follow at it, and a
# draining wave passes through a new size every few steps (`GoodputPolicy._measure_deeper`).
SETTLED_STEPS = 2 * EXPLORE_STEPS
FURTHER_BY = 0.5  # drafts per request by which a neighbour must reach past a batch's own steps (`estimate`)
LOOK_REFERENCE_STEPS = 64  # the latest steps a look is judged against (its own among them)
# The cost functions a plan reads (and Clover's depth plan) are rebuilt this often, and at
# once for another batch size or a size newly measured: building them takes medians over
# every table (in Python: ~40 us a step with a few batch sizes measured, more under a look's
# relative pricing; a plain step on the demo base at batch 1 is 1.4-2.7 ms), and medians of
# 16 samples move slowly.
COSTS_REFRESH_STEPS = 16
# A plan drafts only if it beats drafting nothing by more than the step table's noise: its
# goodput must exceed no drafts' by MARGIN_STANDARD_ERRORS standard errors of the difference
# of two of the table's medians (`plan_lengths`'s margin, `GoodputPolicy._build_costs`).
MARGIN_STANDARD_ERRORS = 1.0
# A policy whose plans ran no heads and drafted nothing for QUIET_STEPS decode-only steps in a
# row at a batch size sleeps at that size: of every WAKE_EVERY draft steps it skips all but
# the last (`GoodputPolicy.asleep`). Sixteen, not eight: an awake step that plans none costs
# ~3x a skipped one (in-process, demo base, Clover: 0.24-0.27 ms against 0.08-0.13 at batch
# 1-16, on a 3-9 ms step), and a size where drafting starts to pay still wakes within 16 steps.
QUIET_STEPS = 16
WAKE_EVERY = 16
MAD_TO_SIGMA = 1.4826               # a normal spread's sigma per median absolute deviation
MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2)  # a median's standard error per sigma / sqrt(n)


def check_policy(name: object) -> str:
    if name not in POLICIES:
        raise ValueError(f"draft_policy must be one of {', '.join(repr(p) for p in POLICIES)}, got {name!r}")
    return name


class AcceptanceModel:
    """a(j, c): the chance that a draft at position j (0-based) whose heads' confidence is c
    is accepted, given the drafts before it were. Counted per (position, confidence bin) on
    top of a prior: the rates measured on data like the traffic when the heads come with them
    (`calibration`, see `calibration_counts`; README: why only then), else the confidence
    taken at its word."""

    def __init__(self, num_positions: int, calibration: dict | None = None):
        centres = (np.arange(CONFIDENCE_BINS) + 0.5) / CONFIDENCE_BINS
        self.prior = np.tile(centres, (num_positions, 1))
        if calibration is not None:
            tried = np.asarray(calibration["tried"], dtype=np.float64)[:num_positions]
            accepted = np.asarray(calibration["accepted"], dtype=np.float64)[:num_positions]
            measured = tried >= CALIBRATION_MIN_DRAFTS
            self.prior[: len(tried)][measured] = accepted[measured] / tried[measured]
        self.tried = np.zeros((num_positions, CONFIDENCE_BINS))
        self.accepted = np.zeros((num_positions, CONFIDENCE_BINS))
        self._calibrated: np.ndarray | None = None  # `calibrated()` until the next observe
        # The confidence bins of the latest rows the heads drafted for, whether drafted or not
        # (free of the selection the policy makes when it drafts only confident tokens): per
        # position j, rows that reached it, with their bins at positions 0..j (`chain_rates`).
        self.recent = [RecentRows(j + 1) for j in range(num_positions)]
        # Confidence bins noted since `recent` was last brought up to date: appended once a
        # step, added to the ring buffers in one go when they are read (`chain_rates`).
        self._unnoted: list[np.ndarray] = []
        self._unnoted_rows = 0

    @staticmethod
    def bins(confidence: np.ndarray) -> np.ndarray:
        return np.minimum((confidence * CONFIDENCE_BINS).astype(np.int64), CONFIDENCE_BINS - 1)

    def calibrated(self) -> np.ndarray:
        """[positions, bins] acceptance rates: each (position, bin)'s counts on top of the
        bin's rate over all positions, itself counts on top of the prior.

        A position the plan rarely reaches is judged on few drafts, and with the confidence
        as its only prior a plan stays shallow for good wherever the heads are
        under-confident. They are, alike at every depth: on the demo base at batch 1 drafts in
        confidence bins 0.3-0.5 were accepted at 0.56-0.67 at position 1 and 0.67-0.92 at
        position 3, in bin 0.6-0.7 at 0.94 at both; a plan that had judged 3 drafts at
        position 3 kept the third head at 0.24 (accepted at 0.73 when drafted every step)
        and drafted two tokens where four paid (0.95x plain decoding; the full budget 1.21x)."""
        if self._calibrated is None:
            pooled = (self.accepted.sum(0) + PRIOR_WEIGHT * self.prior) / (self.tried.sum(0) + PRIOR_WEIGHT)
            self._calibrated = (self.accepted + PRIOR_WEIGHT * pooled) / (self.tried + PRIOR_WEIGHT)
        return self._calibrated

    def rates(self, confidence: np.ndarray) -> np.ndarray:
        """confidence [R, k] (k <= positions) -> a [R, k]."""
        k = confidence.shape[1]
        return self.calibrated()[np.arange(k), self.bins(confidence)]

    def note_confidence(self, confidence: np.ndarray) -> None:
        """Every row the heads drafted for, drafted or not (confidence [R, k])."""
        self._unnoted.append(self.bins(confidence))
        self._unnoted_rows += len(confidence)
        if self._unnoted_rows >= RECENT_ROWS:  # a policy that never reads them keeps no more
            self._bring_recent_up_to_date()

    def _bring_recent_up_to_date(self) -> None:
        """The noted rows into the ring buffers, per position in one add, not one per step:
        four small adds a step were ~10% of the policy's time at batch 1."""
        for j, recent in enumerate(self.recent):
            reached = [bins[:, : j + 1] for bins in self._unnoted if bins.shape[1] > j]
            if reached:
                recent.add(np.concatenate(reached))
        self._unnoted, self._unnoted_rows = [], 0

    def observe(self, confidence: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """A step's verified drafts, all requests at once: confidence [R, k] (row r's drafts
        first), verified [R] drafts vLLM judged per request, accepted [R] of them. Positions
        0..m-1 were accepted, position m rejected, later ones never judged."""
        positions = np.broadcast_to(np.arange(confidence.shape[1]), confidence.shape)
        judged = positions < np.minimum(accepted + 1, verified)[:, None]
        took = positions < np.minimum(accepted, verified)[:, None]
        bins = self.bins(confidence)
        self.tried += self._count(positions[judged], bins[judged])
        self.accepted += self._count(positions[took], bins[took])
        self._calibrated = None

    def _count(self, positions: np.ndarray, bins: np.ndarray) -> np.ndarray:
        """[positions, bins] histogram of (position, bin) pairs (bincount: ~10x np.add.at)."""
        flat = (positions * CONFIDENCE_BINS + bins).ravel()
        return np.bincount(flat, minlength=self.tried.size).reshape(self.tried.shape)

    def chain_rates(self) -> np.ndarray | None:
        """[positions] a_j for an average request: the chance that its draft j is accepted if
        drafts 0..j-1 were, over the latest rows' confidences; None before any row, 0 at a
        position no row reached.

        A ratio of chain survivals (mean over rows of prod_{i<=j} a_i, over prod_{i<j}), not
        each position's rate averaged over all rows: a row whose early drafts are accepted is
        one its heads are sure of, so later positions are judged mostly on confident rows.
        Clover's fourth head on the demo base averaged 0.15 over all rows, while drafts there
        were accepted at 0.75 in the rows that reached them (fixed K = 4), and a depth chosen
        from the averages stopped at two."""
        self._bring_recent_up_to_date()
        if not len(self.recent[0]):
            return None
        calibrated = self.calibrated()
        rates = np.zeros(len(self.recent))
        for j, recent in enumerate(self.recent):
            if len(recent):
                chain = np.cumprod(calibrated[np.arange(j + 1), recent.rows()], axis=1)
                reached = chain[:, -2].mean() if j else 1.0
                rates[j] = chain[:, -1].mean() / max(reached, 1e-12)
        return rates


class RecentRows:
    """The latest RECENT_ROWS rows of `width` confidence bins (a ring buffer)."""

    def __init__(self, width: int):
        self._rows = np.zeros((RECENT_ROWS, width), dtype=np.int64)
        self._next = 0
        self._filled = 0

    def add(self, rows: np.ndarray) -> None:
        rows = rows[-RECENT_ROWS:]
        first = min(len(rows), RECENT_ROWS - self._next)  # up to the end, the rest from the start
        self._rows[self._next: self._next + first] = rows[:first]
        self._rows[: len(rows) - first] = rows[first:]
        self._next = (self._next + len(rows)) % RECENT_ROWS
        self._filled = min(self._filled + len(rows), RECENT_ROWS)

    def rows(self) -> np.ndarray:
        return self._rows[: self._filled]

    def __len__(self) -> int:
        return self._filled


def calibration_counts(confidence: np.ndarray, runs: np.ndarray) -> dict:
    """Held-out drafts counted as the policy counts served ones: confidence [N, K] of each
    position's K drafts, runs [N] how many leading drafts were right there (teacher-forced,
    so draft j's inputs are what serving gives it when drafts 1..j-1 were accepted) ->
    {"tried", "accepted"} [K, CONFIDENCE_BINS] lists, the AcceptanceModel `calibration`."""
    model = AcceptanceModel(confidence.shape[1])
    model.observe(confidence, np.full(len(runs), confidence.shape[1]), runs)
    return {"confidence_bins": CONFIDENCE_BINS, "tried": model.tried.astype(int).tolist(),
            "accepted": model.accepted.astype(int).tolist()}


@functools.cache  # sizes are few and it is called ~10 times a step
def bucket(num_tokens: int) -> int:
    return round(BUCKETS_PER_OCTAVE * math.log2(max(num_tokens, 1)))


class CostModel:
    """Seconds as a function of a size n (tokens a step runs; positions the heads draft):
    per bucket of n (half-octaves), the median of its latest samples, which shrugs off a
    step that waited for requests or lost the core; linear in n between buckets (a
    roofline: flat while bound by reading weights, then rising per token) and never
    falling as n grows (`non_decreasing`: noise between buckets must not make drafts look
    cheaper than none).

    A sample of any size but the usual one (the bucket most of the latest planned steps
    ran) is priced relative to the usual steps of its moment: the usual bucket is re-measured
    every step, a rare size's samples stand for thousands of steps, and the machine's own
    speed drifts ~15% within seconds and up to 1.8x between minutes (README). A look taken in
    a slow spell made the steps it measured look dear for thousands of steps (demo base,
    batch 1: a 5-token step 21.4 ms against 16.6 ms at 4 tokens, where steps of 5 and 3
    tokens alternated in blocks took 14.7 and 13.7 ms); the rare drafting steps of a plan
    that mostly drafts nothing, taken at a faster spell, made drafting look cheap beside a
    slow spell's steps without drafts (CLP on the demo base at batch 4: its no-draft steps
    rose from ~4.0 to 6-7 ms while 8- and 20-token steps stood at 7-8). So each such sample
    keeps the usual bucket's median of its moment, and reads back scaled by that bucket's
    median now.

    Outside what it has measured it guesses optimistically, so the policy tries the
    unmeasured side once and then knows it: below the smallest bucket in proportion to n
    (not drafting looks cheap); above the largest, rising at the slope between its last two
    buckets, flat with one. A roofline's slope never falls as n grows, so that is the least
    the next tokens can cost; flat there priced every draft past the measured steps as free,
    and SmolLM2 at batch 4, its 4- and 8-token steps measured (2 ms a token), drafted the
    full budget for rows accepted at 11-19% (README, the policy runs at 484e5c4). Where the
    last two are a step without drafts and one with, their slope is what any draft costs
    over none, so a second drafting size is measured (`GoodputPolicy._measure_deeper`)."""

    def __init__(self):
        # bucket -> its latest (n, seconds, reference): the reference is None for a sample
        # of the usual bucket, for any other (the usual bucket, its median seconds then)
        self.samples: dict[int, deque[tuple[float, float, tuple[int, float] | None]]] = {}
        self._planned: deque[int] = deque(maxlen=SAMPLES_PER_BUCKET)  # the latest planned samples' buckets
        self._table: tuple[np.ndarray, np.ndarray] | None = None   # (n, seconds) per bucket, sorted

    def observe(self, n: int, seconds: float, look: bool = False) -> None:
        b = bucket(n)
        if not look:
            self._planned.append(b)
        reference = None
        usual = Counter(reversed(self._planned)).most_common(1)[0][0] if self._planned else None  # ties: the latest
        if usual is not None and usual != b and self._estimated(usual):
            usual_then = self._recorded_median(usual)
            reference = (usual, usual_then) if usual_then > 0 else None
        self.samples.setdefault(b, deque(maxlen=SAMPLES_PER_BUCKET)).append((n, seconds, reference))
        self._table = None

    def _estimated(self, b: int) -> bool:
        return len(self.samples.get(b, ())) >= MIN_SAMPLES

    def _recorded_median(self, b: int) -> float:
        """Bucket b's median seconds as its samples were recorded (what other sizes are priced against)."""
        return statistics.median(seconds for _, seconds, _ in self.samples[b])

    def _seconds_now(self, b: int) -> list[float]:
        """Bucket b's samples' seconds, each scaled as the usual bucket of its moment moved since."""
        samples = self.samples[b]
        usual_now = {u: self._recorded_median(u) for u in {ref[0] for _, _, ref in samples if ref is not None}}
        return [seconds if ref is None else seconds * usual_now[ref[0]] / ref[1] for _, seconds, ref in samples]

    def _median_now(self, b: int) -> float:
        return statistics.median(self._seconds_now(b))

    def relative_error(self) -> float:
        """How well the table's medians are known: the standard error of a bucket's median
        over the median itself (from the median absolute deviation of its samples, as for a
        normal spread), root-mean-square over the estimated buckets."""
        errors = []
        for b in self.samples:
            if self._estimated(b):
                seconds = self._seconds_now(b)
                median = statistics.median(seconds)
                spread = MAD_TO_SIGMA * statistics.median(abs(s - median) for s in seconds)
                errors.append(MEDIAN_SE_FACTOR * spread / (max(median, 1e-12) * math.sqrt(len(seconds))))
        return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0

    def knows(self) -> bool:
        return any(self._estimated(b) for b in self.samples)

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        if self._table is None:
            keys = sorted(b for b in self.samples if self._estimated(b))
            sizes = np.array([statistics.median(n for n, _, _ in self.samples[b]) for b in keys])
            seconds = np.array([self._median_now(b) for b in keys])
            self._table = sizes, non_decreasing(seconds, [len(self.samples[b]) for b in keys])
        return self._table

    def predict(self, n: np.ndarray) -> np.ndarray:
        return self.frozen()(n)

    def frozen(self) -> Callable[[np.ndarray], np.ndarray]:
        """`predict` over the table as it stands: a policy's plans read tables rebuilt only
        every COSTS_REFRESH_STEPS steps (building one takes medians over every bucket)."""
        xs, ys = self.table()
        slope_past = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0

        def predict(n: np.ndarray) -> np.ndarray:
            n = np.maximum(np.asarray(n, dtype=np.float64), 1)
            measured = np.where(n < xs[0], ys[0] * n / xs[0], np.interp(n, xs, ys))
            return measured + slope_past * np.maximum(n - xs[-1], 0)

        return predict

    def as_dict(self) -> dict[str, float]:
        xs, ys = self.table() if self.knows() else ((), ())
        return {f"{x:.1f}": round(float(y), 6) for x, y in zip(xs, ys)}


class CostsByBatch:
    """One CostModel per bucket of batch size: a step's time depends on how many requests it
    carries (attention, sampling and bookkeeping per request), not only on its tokens, and
    a policy only ever chooses between loads of the batch it has.

    `sizes_per_batch`: the sizes the models take grow with the batch (a step's tokens), or
    are per request (the positions the heads draft for every row)."""

    def __init__(self, sizes_per_batch: bool):
        self.models: dict[int, CostModel] = {}
        self.batch_sizes: dict[int, deque[int]] = {}   # bucket -> its latest batch sizes
        self.sizes_per_batch = sizes_per_batch
        self.sizes_known = 0  # (batch, size) buckets with an estimate: grows as the tables do

    def observe(self, requests: int, n: int, seconds: float, look: bool = False) -> None:
        b = bucket(requests)
        model = self.models.setdefault(b, CostModel())
        model.observe(n, seconds, look)
        self.batch_sizes.setdefault(b, deque(maxlen=SAMPLES_PER_BUCKET)).append(requests)
        self.sizes_known += len(model.samples[bucket(n)]) == MIN_SAMPLES

    def knows(self, requests: int, n: int, or_larger: bool = False) -> bool:
        """Whether size n has an estimate measured at this batch size or one at most
        NEAR_OCTAVES smaller (read per request, as `scaled` reads it); with `or_larger`, n or
        a larger size (so n is priced between measured sizes, not past them).

        Not from a larger one: a smaller batch is nearer to reading its weights once whatever
        it runs, so a larger batch's shape read per request makes its drafts look dear, a
        plan that drafts nothing never measures them, and the error stands (SmolLM2, Clover:
        after batch 4, where 8 tokens cost 38% more than 4, batch 1 drafted nothing for 300
        steps, where 1-4 tokens had cost the same). Read the other way the error is
        optimistic: the plan drafts, and so measures."""
        wanted = bucket(requests)
        return any(self.knows_at(b, requests, n, or_larger) for b in self.models
                   if 0 <= wanted - b <= NEAR_OCTAVES * BUCKETS_PER_OCTAVE)

    def knows_at(self, measured_bucket: int, requests: int, n: int, or_larger: bool = False) -> bool:
        """`knows`, from the one batch bucket `measured_bucket`."""
        model = self.models.get(measured_bucket)
        if model is None:
            return False
        size = bucket(round(n / self._ratio(measured_bucket, requests) if self.sizes_per_batch else n))
        sizes = [s for s in model.samples if s >= size] if or_larger else [size]
        return any(len(model.samples.get(s, ())) >= MIN_SAMPLES for s in sizes)

    def measured(self) -> dict[int, CostModel]:
        """Batch-size bucket -> its model, for buckets with an estimate (MIN_SAMPLES)."""
        return {b: m for b, m in self.models.items() if m.knows()}

    def scaled(self, measured_bucket: int, requests: int) -> tuple[Callable, float]:
        """A measured bucket's model read for a batch of `requests` as if every request cost
        what one of that bucket's did (per request the same sizes and seconds), and the
        largest size it has measured, in the batch's own sizes."""
        model, ratio = self.models[measured_bucket], self._ratio(measured_bucket, requests)
        predict, largest = model.frozen(), model.table()[0][-1]
        if self.sizes_per_batch:
            return (lambda n: predict(np.asarray(n) / ratio) * ratio), largest * ratio
        return (lambda n: predict(n) * ratio), largest

    def least_step_without_drafts(self, above: int) -> float:
        """The least seconds a step that ran decodes alone, without drafts, took at any measured
        batch-size bucket above bucket `above` (its table's smallest size, where that is its own
        batch size), or inf where none has measured one."""
        least = math.inf
        for b, model in self.measured().items():
            sizes, seconds = model.table()
            if b > above and bucket(round(sizes[0])) == bucket(round(statistics.median(self.batch_sizes[b]))):
                least = min(least, float(seconds[0]))
        return least

    def _ratio(self, measured_bucket: int, requests: int) -> float:
        """How many of a measured bucket's requests a batch of `requests` is."""
        return requests / statistics.median(self.batch_sizes[measured_bucket])

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {f"{2 ** (b / BUCKETS_PER_OCTAVE):.0f}": m.as_dict() for b, m in sorted(self.measured().items())}


def nearest_measured(requests: int, tables: list[CostsByBatch]) -> list[tuple[CostsByBatch, int]]:
    """Every (table, batch bucket) measured, the best stand-in for a batch of `requests`
    first: the nearest batch size, the first table before later ones, the larger batch
    before the smaller."""
    wanted = bucket(requests)
    return sorted(((table, b) for table in tables for b in table.measured()),
                  key=lambda found: (abs(found[1] - wanted), tables.index(found[0]), -found[1]))


def estimate(requests: int, tables: list[CostsByBatch]) -> Estimate | None:
    """Seconds as a function of size for a batch of `requests`, None before any measure.

    From the nearest batch size measured (`nearest_measured`): a size not yet measured is
    planned as its neighbour's, per request, because a queue that grows passes through batch
    sizes faster than they can be measured (the SmolLM2 load run drafted the full budget at
    every new size, at 19% acceptance). Above the largest size measured there the cost grows
    as at the nearest batch size measured further, where that is dearer than its own last
    slope goes on (the only guess for steps that never drafted), in the first table that has
    one: a prefill step's tokens cost less each than drafts verified across the batch, so
    decode steps of another batch size, read per request, are the better guess for drafts.

    "Further" by at least FURTHER_BY of a draft per request (a position, for the heads): a
    batch size the engine only passed through (a wave draining, 64 requests to 1) measured
    its decodes alone, the same per-request reach read through two medians, and one size
    lends no slope. Taken as the extension, it priced every draft past it flat and kept the
    plan from reading a smaller batch size that had measured drafts (`_priced_from_smaller`):
    the demo base's Clover at batch 64, extended by batch 45's 48-token steps, looked one and
    two drafts deeper for 12 steps a round (0.14 drafted tokens a request-step, all looks)."""
    ranked = nearest_measured(requests, tables)
    if not ranked:
        return None
    predict, largest = ranked[0][0].scaled(ranked[0][1], requests)
    for extension in sorted(ranked[1:], key=lambda found: tables.index(found[0])):  # stable: nearest first
        shape, reach = extension[0].scaled(extension[1], requests)
        if reach >= largest + FURTHER_BY * (requests if extension[0].sizes_per_batch else 1):
            break
    else:
        return Estimate(predict, ranked[0], largest, None)
    shape_at_largest = max(float(shape(np.array([largest]))[0]), 1e-9)
    return Estimate(lambda n: np.maximum(predict(n), predict(np.minimum(n, largest))
                                         * np.maximum(shape(n) / shape_at_largest, 1.0)),
                    ranked[0], largest, extension)


class Estimate:
    """`estimate`'s cost function, and which measured (table, batch bucket) prices each size:
    the nearest up to the largest size it measured, past that the one it extends with."""

    def __init__(self, predict: Callable, nearest: tuple[CostsByBatch, int], largest: float,
                 extension: tuple[CostsByBatch, int] | None):
        self.predict, self.nearest, self.largest, self.extension = predict, nearest, largest, extension

    def __call__(self, n: np.ndarray) -> np.ndarray:
        return self.predict(n)

    def source(self, n: int) -> tuple[CostsByBatch, int]:
        return self.nearest if n <= self.largest or self.extension is None else self.extension


def non_decreasing(values: np.ndarray, weights: list[int]) -> np.ndarray:
    """The closest non-decreasing sequence (weighted least squares: pool adjacent
    violators), so a bucket of a few slow samples is outvoted by better-measured neighbours
    instead of lifting everything after it."""
    blocks: list[list[float]] = []  # [weighted mean, weight, length]
    for value, weight in zip(values, weights):
        blocks.append([float(value), float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.array([mean for mean, _, length in blocks for _ in range(length)])


def plan_lengths(rates: np.ndarray, budgets: list[int], base_tokens: int, step_time,
                 heads_time=None, margin: float = 0.0) -> list[int]:
    """Per row, the draft length that maximises the step's goodput (module docstring), or
    none where that goodput is not more than `margin` (relative) above drafting nothing's.

    rates [R, K]: a_rj; budgets [R] (<= K); base_tokens: tokens the next step runs without
    drafts; step_time(n array) -> seconds; heads_time(h array) -> seconds of drafting h
    positions this step (0 for none), or None when the heads have already run (their time is
    spent either way).

    The margin is how far the step table's medians are known (`GoodputPolicy._build_costs`).
    Without it a plan drafts wherever the table, read at face value, finds a sliver of gain:
    Clover on SmolLM2 at batch 4 drafted rows its plan rated just above break-even (first
    drafts accepted 25%, where a token cost 4-7 ms of a 68-86 ms step depending on which two
    buckets' medians it was read between), and ran the heads for them, 0.94x plain decoding
    where drafting nothing would have cost ~2.6% (README, the policy runs at 484e5c4)."""
    R, K = rates.shape
    marginals = np.cumprod(rates, axis=1)                       # [R, K] prod_{j<=i} a_rj
    allowed = np.arange(K)[None, :] < np.asarray(budgets)[:, None]
    order = np.argsort(-np.where(allowed, marginals, -1.0), axis=None, kind="stable")[: int(allowed.sum())]
    gains = np.concatenate([[0.0], np.cumsum(marginals.ravel()[order])])  # expected accepted, N drafts
    seconds = step_time(base_tokens + np.arange(len(gains)))
    if heads_time is not None:
        deepest = np.concatenate([[0], np.maximum.accumulate(order % K + 1)])  # heads needed for N drafts
        seconds = seconds + heads_time(deepest)
    goodput = (R + gains) / seconds
    best = int(np.argmax(goodput))
    if goodput[best] <= (1 + margin) * goodput[0]:
        best = 0
    lengths = np.zeros(R, dtype=np.int64)
    np.add.at(lengths, order[:best] // K, 1)
    return lengths.tolist()


# What decided a step's draft lengths (`DraftStats.drafted_by`): the fixed policy's rule, the
# goodput policy's plan, a scheduled look past it, or a look begun to measure one draft deeper.
DRAFT_SOURCES = ("rule", "plan", "look", "deeper_look")


def first_draft_threshold(rows: int, positions: int, base_tokens: int, step_time, heads_time=None,
                          margin: float = 0.0) -> float:
    """A rate such that, while no row's first draft reaches it, `plan_lengths` drafts nothing,
    for `rows` rows of up to `positions` drafts (its other arguments).

    A plan of N drafts wins only if its expected accepted G(N) > rows ((1 + margin) S(N) -
    S(0)) / S(0), S the step's seconds with them; every marginal is a product of its row's
    rates, so G(N) <= N a for a the largest first-draft rate. With a below min_N rows ((1 +
    margin) S(N) - S(0)) / (N S(0)), nothing is drafted. The heads' time is taken at its least
    over their depths."""
    drafts = np.arange(rows * positions + 1)
    seconds = step_time(base_tokens + drafts)
    if heads_time is not None:
        seconds = seconds + np.where(drafts > 0, heads_time(np.arange(1, positions + 1)).min(), 0.0)
    return float(np.min(rows * ((1 + margin) * seconds[1:] - seconds[0]) / (drafts[1:] * seconds[0])))


class DraftStats:
    """Running totals of one engine's drafting, whatever the policy: read by benchmarks (as
    differences between two readings) and logged by the engine."""

    def __init__(self, num_positions: int):
        self.steps = 0                   # draft steps with at least one request that could draft
        self.rows = 0                    # requests offered drafts, summed over steps
        self.drafted = 0                 # draft tokens proposed
        self.drafted_by = dict.fromkeys(DRAFT_SOURCES, 0)  # and by what decided them
        self.steps_without_drafts = 0    # steps that offered drafts and proposed none
        self.steps_slept = 0             # of them, steps the policy slept through (`GoodputPolicy.asleep`)
        self.per_position = [0] * num_positions  # requests given >= j+1 drafts

    def record(self, lengths: list[int], source: str) -> None:
        self.steps += 1
        self.rows += len(lengths)
        drafted = sum(lengths)
        self.drafted += drafted
        self.drafted_by[source] += drafted
        self.steps_without_drafts += not any(lengths)
        for n in lengths:
            for j in range(n):
                self.per_position[j] += 1

    def record_skipped(self, rows: int) -> None:
        """A step the policy slept through (`GoodputPolicy.asleep`): `rows` requests, no drafts."""
        self.steps += 1
        self.rows += rows
        self.steps_without_drafts += 1
        self.steps_slept += 1

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "drafted": self.drafted, "drafted_by": dict(self.drafted_by),
                "steps_without_drafts": self.steps_without_drafts, "steps_slept": self.steps_slept,
                "per_position": list(self.per_position)}


class Looks:
    """When the policy looks past its plan, which way, and how often that pays.

    The policy measures only what it does: one that stopped drafting (under load) or drafts
    shallowly never again sees what deeper drafts earn and cost, and one that drafts every
    step never again times a step without drafts (the only ones left are atypical: at batch
    4 on SmolLM2 they timed ~50% slower than steady ones, so drafting looked free and ran
    0.89x plain decoding). Stale figures would stay in charge; so every `interval` steps,
    EXPLORE_STEPS steps try a neighbour of the plan, the two kinds in turn: one token more
    per request than planned (within the budget), then no drafts at all (one more where the
    plan drafts nothing already). One more, not the full budget: a request's marginal gains
    fall with depth and a step's cost per token does not (a roofline), so where one more
    draft does not pay, none further would. Full-budget looks ran ~80 tokens instead of 16
    through SmolLM2's compute-bound target at batch 16: most of what Clover lost there.

    Whether a look paid is measured, not predicted: its steps' output (tokens sampled plus
    drafts accepted) per second from their draft step to the next, against the planned
    steps' just before it at the same batch sizes. Each look that did not pay doubles the
    interval, up to EXPLORE_AFTER_MAX; each that paid halves it, down to EXPLORE_AFTER (so
    one lucky look does not bring back frequent ones). The first version doubled it only
    while no planned step drafted at all, which a few confident rows (~1% of steps at batch
    16) kept preventing."""

    def __init__(self):
        self.interval = EXPLORE_AFTER
        self._since = 0   # steps since the last look began
        self._left = 0    # steps of the current look still to run
        self.without_drafts = True  # the current (or last) look's kind: no drafts, or one more
        # The (table, batch bucket, size bucket) keys the current look measures, where it
        # was begun for them (`GoodputPolicy._measure_deeper`); empty in a scheduled look.
        self.measuring: list[tuple[str, int, int]] = []
        self.deeper_by = 1  # drafts per request the current look runs past the plan, if deeper
        # The latest planned and look steps: (batch-size bucket, a look's, tokens out, seconds).
        self._steps: deque[tuple[int, bool, int, float]] = deque(maxlen=LOOK_REFERENCE_STEPS)

    def now(self) -> bool:
        return self._left > 0

    def step_done(self, requests: int, looked: bool, tokens_out: int, seconds: float) -> None:
        self._steps.append((bucket(requests), looked, tokens_out, seconds))

    def start_deeper(self, measuring: list[tuple[str, int, int]], by: int) -> None:
        """Begin a look `by` drafts deeper now, whatever the interval, to measure the keys
        `measuring` (`GoodputPolicy._measure_deeper`)."""
        self._since, self._left, self.without_drafts = 0, EXPLORE_STEPS, False
        self.measuring, self.deeper_by = measuring, by

    def next_step(self) -> None:
        """Once a step, after the last step's outcome is in: judge a look that just ended,
        start the next one when due."""
        if self._left:
            self._left -= 1
            if not self._left:
                self.measuring, self.deeper_by = [], 1
                self._judge()
        self._since += 1
        if self._since >= self.interval:
            self._since, self._left, self.without_drafts = 0, EXPLORE_STEPS, not self.without_drafts

    def _judge(self) -> None:
        looked = [step for step in self._steps if step[1]][-EXPLORE_STEPS:]
        batch_sizes = {step[0] for step in looked}
        planned = [step for step in self._steps if not step[1] and step[0] in batch_sizes]
        if looked and planned:
            if tokens_per_second(looked) >= tokens_per_second(planned):
                self.interval = max(self.interval // 2, EXPLORE_AFTER)
            else:
                self.interval = min(2 * self.interval, EXPLORE_AFTER_MAX)


def deeper(plan: list[int], budgets: list[int], by: int = 1) -> list[int]:
    """`by` drafts more per request than `plan`, within its budget."""
    return [min(length + by, budget) for length, budget in zip(plan, budgets)]


def tokens_per_second(steps: list[tuple[int, bool, int, float]]) -> float:
    return sum(step[2] for step in steps) / max(sum(step[3] for step in steps), 1e-9)


class GoodputPolicy:
    """The goodput policy of one engine (module docstring). Within a step the heads call
    `heads_to_run` (Clover, before its chain) and `lengths`; the runner hook reports how
    the previous step's drafts fared and how long the step took (`observe_step`), the heads'
    time (`heads_timed`) and which request each row was (`end_step`)."""

    def __init__(self, num_positions: int, clock: Callable[[], float] = time.perf_counter,
                 calibration: dict | None = None):
        self.acceptance = AcceptanceModel(num_positions, calibration)
        self.step_costs = CostsByBatch(sizes_per_batch=True)  # by requests, then tokens the step runs: decode-only
        self.prefill_step_costs = CostsByBatch(sizes_per_batch=True)  # the same for steps that carried prefill chunks
        self.heads_costs = CostsByBatch(sizes_per_batch=False)  # by rows, then positions the heads draft
        # Decode-only steps without drafts whose draft step before them slept (`asleep`): what
        # drafting nothing costs once the policy sleeps, without its own planning in it.
        self.slept_step_costs = CostsByBatch(sizes_per_batch=True)
        self.clock = clock
        self.base_tokens = 1          # the next step's decodes: requests that sampled a token in this one
        self._running: set[str] = set()  # the requests of the last step
        self._decoding_only = False  # whether the last step ran decodes (and drafts) alone
        self._batch_bucket = -1      # the last step's batch-size bucket,
        self._settled_steps = 0      # and the decode-only steps it has held since it changed
        self.looks = Looks()
        self._looked: bool | None = None  # this step's lengths: a look's (True), planned (False), neither (None)
        # (table, batch bucket, size bucket): each found measured, or looked at long enough (`_measure_deeper`)
        self._deeper_measured: set[tuple[str, int, int]] = set()
        self._deeper_look_steps: Counter[tuple[str, int, int]] = Counter()  # per key: look steps at its batch
        self._nothing_deeper: tuple | None = None  # what `_measure_deeper` last found nothing to measure for
        self._last_step_start: float | None = None
        self._slept = False  # whether the step being timed began at a draft step that slept
        # Whether the last step observed verified drafts (None before any). A step whose kind
        # differs is timed for the looks but priced in no table: the first step without drafts
        # after drafting ones is dearer than steady ones (at batch 1 on the demo base, Clover's
        # table put a step without drafts at 5.23 ms while drafting nearly every step, 3.72 ms
        # while drafting none; plain decoding's took 3.47-3.66), and in a policy that drafts
        # nearly every step such steps are the only ones it times without drafts.
        self._last_drafted: bool | None = None
        self._steps = 0
        # with heads or not -> (step built, (tokens, rows, sizes known) built for, the cost functions)
        self._built_costs: dict[bool, tuple[int, tuple[int, int, int], tuple]] = {}
        self._chain: tuple[int, np.ndarray | None] = (0, None)  # (step computed, chain rates)
        self._depth_planned: tuple[tuple | None, list[int]] = (None, [])  # (planned from, plan): `_depth_plan`
        self._threshold: tuple[tuple | None, float] = (None, 0.0)  # (computed from, rate): `_nothing_pays`
        self._step_estimate: Estimate | None = None  # the step times the latest plans read
        self._heads_seconds = 0.0
        self._deferred_seconds = 0.0
        # per batch-size bucket: its planned steps that ran no heads since any did (`end_step`)
        self._quiet_steps: Counter[int] = Counter()
        self._sleep_phase = 0  # where a sleeping policy is in its WAKE_EVERY steps (`asleep`)
        self._heads_run = 0
        self._rows = 0
        self._confidence = np.zeros((0, 0))          # this step's rows' confidences [R, k]
        self._lengths = np.zeros(0, dtype=np.int64)   # and their draft lengths [R]
        # The last step's drafts: (request id per row, confidence [R, k], lengths [R]).
        self._pending: tuple[list[str], np.ndarray, np.ndarray] | None = None

    # ---- the runner hook ----

    def observe_step(self, num_tokens: int, req_ids: list[str], verified: dict[str, int],
                     accepted: dict[str, int]) -> None:
        """At the start of a draft step: this step ran `num_tokens` tokens for the requests
        `req_ids`; per request id, how many of its drafts were verified, and for each that
        sampled a token (and so runs one next step), how many were accepted.

        The step's time counts, as the time of `num_tokens` tokens, unless the engine may have
        sat idle before it (none of its requests ran in the step before: a new wave, or a
        request after a quiet spell): that is a wait, not a cost. Steps that carried a prefill
        chunk go to their own tables (`prefill_step_costs`), used only for a batch size with
        no estimate from decode-only steps: a prompt's tokens cost less each than drafts
        verified across the batch (the demo base drafted twice as much at batch 64 when they
        were mixed), but under steady arrivals nearly every step carries one. The policy plans
        on the decodes alone: a prompt is prefilled once whatever is drafted."""
        now = self.clock()
        decode_only = num_tokens == len(req_ids) + sum(verified.values()) and len(accepted) == len(req_ids)
        drafted = any(verified.values())
        if self._last_step_start is not None and not self._running.isdisjoint(req_ids):
            # Since the last draft step began: its heads, then this whole engine step (not work
            # put off from earlier steps, `deferred_work_timed`).
            seconds = now - self._last_step_start - self._deferred_seconds
            costs = self.step_costs if decode_only else self.prefill_step_costs
            if self._last_drafted in (None, drafted):  # `_last_drafted`: a change of kind is neither kind's price
                costs.observe(len(req_ids), num_tokens, seconds - self._heads_seconds, look=bool(self._looked))
            if self._slept and decode_only and not drafted:
                self.slept_step_costs.observe(len(req_ids), num_tokens, seconds)
            if self._looked is not None:
                self.looks.step_done(len(req_ids), self._looked, len(accepted) + sum(accepted.values()), seconds)
            if self._looked:
                self._deeper_look_steps.update(key for key in self.looks.measuring if key[1] == bucket(len(req_ids)))
        self.looks.next_step()
        self._steps += 1
        self._start_step_clock(now)
        self._running = set(req_ids)
        self._decoding_only = decode_only
        self._last_drafted = drafted
        self._note_batch_bucket(bucket(len(req_ids)), decode_only)
        self.base_tokens = max(len(accepted), 1)
        if self._pending is not None:
            drafted_ids, confidence, lengths = self._pending
            judged = np.minimum([verified.get(r, 0) for r in drafted_ids], lengths)
            self.acceptance.observe(confidence, judged, np.array([accepted.get(r, 0) for r in drafted_ids]))
        self._pending, self._lengths = None, np.zeros(0, dtype=np.int64)

    def _note_batch_bucket(self, batch_bucket: int, decode_only: bool) -> None:
        """Count the decode-only steps the batch size has held (steps carrying a prefill chunk
        neither count nor break the count: under arrivals they come between decodes)."""
        if batch_bucket != self._batch_bucket:
            self._batch_bucket, self._settled_steps = batch_bucket, 0
        self._settled_steps += decode_only

    @property
    def decided_by(self) -> str:
        """What chose this step's lengths (DRAFT_SOURCES): the plan, or a look past it."""
        if not self._looked:
            return "plan"
        return "deeper_look" if self.looks.measuring else "look"

    def heads_timed(self, seconds: float) -> None:
        self._heads_seconds = seconds
        if self._heads_run:
            self.heads_costs.observe(self._rows, self._heads_run, seconds, look=bool(self._looked))

    def deferred_work_timed(self, seconds: float) -> None:
        """This draft step spent `seconds` on work earlier steps put off (Clover's augmenting
        block writes the KV of steps that drafted nothing when it next drafts): paid whatever
        is drafted, so not a cost of this step's size. Counted in, each drafting step after a
        spell without drafts would look dearer by that spell's writes."""
        self._deferred_seconds += seconds

    def end_step(self, req_ids: list[str]) -> None:
        """The request id of each row that `lengths` was given, in the same order."""
        self._pending = (req_ids, self._confidence, self._lengths) if self._lengths.any() else None
        self._count_quiet_steps()

    def _count_quiet_steps(self) -> None:
        """A decode-only step planned to run no heads counts towards sleep at its batch size
        (`asleep`); one that ran heads, drafted or looked breaks the count at its size; a
        step that carried a prefill chunk (planned from the decode-only tables all the same)
        leaves it as it is: under steady arrivals nearly every step carries one, and a count
        they broke never reached QUIET_STEPS (the demo sweep's 64-request waves slept 37% of
        their steps, not 75%).

        Counted per batch size, not for the size the batch holds: a new wave's requests reach
        the engine one by one, so its first steps run a smaller batch, and a count restarted
        there slept 55% of the demo sweep's steps at batch 4 to 64, not 75% (cd6db1c). Broken
        per batch size too: a draft at one size had woken every size for QUIET_STEPS steps
        (6cf7af3: Clover on SmolLM2 at batch 4 drafted 4 single tokens in a 260-step round,
        at batch 1 as a wave drained or at 4, and slept 62% of its steps where 7 in 8 is the
        ceiling). A size that sleeps still plans once in WAKE_EVERY steps, so drafting that
        starts to pay there wakes it."""
        if self._looked or self._heads_run:
            self._quiet_steps.pop(self._batch_bucket, None)
        elif self._looked is False and self._decoding_only:
            self._quiet_steps[self._batch_bucket] += 1

    def asleep(self, requests: int) -> bool:
        """Whether this draft step is skipped whole, before anything is read (the runner hook
        then only keeps the step's augmenting-block KV): the policy neither plans, nor runs the
        heads, nor observes the step.

        Where nothing pays, a plan of none is the policy's whole output, and what it costs to
        reach it every step is most of what speculation costs then: on the demo base at batch
        4 (a 3.5 ms step) our draft step took 0.24 ms with Clover, 0.54 with CLP, whose length
        head runs for every row (README, the floor run). So once QUIET_STEPS decode-only steps
        at the size bucket of `requests` were planned to run no heads (`_count_quiet_steps`),
        of every WAKE_EVERY steps at that size all but the last are skipped, prefill chunks or
        not. A skipped step still starts the clock, so the awake step times the one engine step
        before it and the step table keeps up with the machine (timing none, two awake steps
        in WAKE_EVERY were needed: 75% slept at most). A plan that drafts at its size, or a
        look, wakes it for QUIET_STEPS steps; a size not yet quiet is planned. Looks count
        awake steps only, so a sleeping policy looks WAKE_EVERY times less often."""
        if self._quiet_steps[bucket(requests)] < QUIET_STEPS or self.looks.now():
            self._sleep_phase = 0
            return False
        self._sleep_phase = (self._sleep_phase + 1) % WAKE_EVERY
        if self._sleep_phase == 0:
            return False
        # A skipped step drafts what the plans that put the policy to sleep did: a planned none.
        self._start_step_clock(self.clock(), looked=False, slept=True)
        return True

    def _start_step_clock(self, now: float, looked: bool | None = None, slept: bool = False) -> None:
        """The next step's time runs from `now`, with no heads' or put-off work in it yet, its
        lengths decided as `looked` says (`_looked`), from a draft step that `slept` or not."""
        self._last_step_start, self._heads_seconds, self._heads_run, self._looked = now, 0.0, 0, looked
        self._deferred_seconds, self._slept = 0.0, slept

    # ---- the heads ----

    def heads_to_run(self, budgets: list[int]) -> int:
        """Before any head runs (Clover): how many positions are worth drafting for an average
        request of this batch; 0 skips the heads. Until the policy has measured the heads'
        confidence, their time and the step time at this batch size, the full budget; in a
        look, one more than planned or none (`_look`)."""
        deepest, self._rows = max(budgets, default=0), len(budgets)
        chain = self._chain_rates()
        costs = self._costs(with_heads=True)
        if deepest and chain is not None and costs is not None:
            plan = self._depth_plan(chain, budgets, costs)
            self._measure_deeper(plan, budgets, with_heads=True)
            deepest = self._look([max(plan)], [deepest])[0]
        self._heads_run = deepest
        return deepest

    def _depth_plan(self, chain: np.ndarray, budgets: list[int], costs: tuple) -> list[int]:
        """`heads_to_run`'s plan for an average request, which changes only with what it is
        planned from: kept until the chain rates or the cost functions are rebuilt, or the
        batch's budgets change."""
        key = (self._chain[0], self._built_costs[True][:2], tuple(budgets))
        if self._depth_planned[0] != key:
            rates = np.broadcast_to(chain[: max(budgets)], (len(budgets), max(budgets)))
            self._depth_planned = (key, plan_lengths(rates, budgets, self.base_tokens, *costs))
        return self._depth_planned[1]

    def lengths(self, confidence: np.ndarray, budgets: list[int], heads_to_run: bool = False) -> list[int]:
        """confidence [R, k]: the heads' estimate per row and position (Clover: each head's
        top-1 probability; CLP: P(L >= j) / P(L >= j-1)). `heads_to_run`: the heads have not
        run yet (CLP), so their time depends on the lengths chosen."""
        self._rows = len(budgets)
        self.acceptance.note_confidence(confidence)
        costs = self._costs(with_heads=heads_to_run)
        if costs is not None:
            if self._nothing_pays(confidence, heads_to_run, costs):
                plan = [0] * len(budgets)
            else:
                plan = plan_lengths(self.acceptance.rates(confidence), budgets, self.base_tokens, *costs)
            self._measure_deeper(plan, budgets, with_heads=heads_to_run)
            lengths = self._look(plan, budgets)
        else:
            lengths = list(budgets)
        if heads_to_run:
            self._heads_run = max(lengths, default=0)
        self._confidence, self._lengths = confidence, np.asarray(lengths)
        return lengths

    def _nothing_pays(self, confidence: np.ndarray, heads_to_run: bool, costs: tuple) -> bool:
        """Whether `plan_lengths` would draft nothing, known without running it: no row's first
        draft beats `first_draft_threshold` (kept until the cost functions are rebuilt or the
        batch changes). Where drafts do not pay (CLP on SmolLM2 at batch 4-64 drafted in 2-9% of
        steps) a plan is most of what the policy costs a step, 0.3-0.4 ms in the engine."""
        key = (self._built_costs[heads_to_run][:2], self.base_tokens, confidence.shape)
        if self._threshold[0] != key:
            self._threshold = (key, first_draft_threshold(*confidence.shape, self.base_tokens, *costs))
        first = self.acceptance.calibrated()[0, AcceptanceModel.bins(confidence[:, 0])]
        return bool(first.max() < self._threshold[1])

    def _look(self, plan: list[int], budgets: list[int]) -> list[int]:
        """`plan`, or in a look the neighbour it tries (`Looks`): no drafts, where the plan
        drafts and the heads have not run for the look already (Clover decides its depth
        first); else one more per request (two in a look begun for them, `_measure_deeper`),
        or, in a look begun only to time the heads deeper, which ran already, the plan."""
        if not self.looks.now():
            self._looked = False
            return plan
        decided = self._looked  # True: heads_to_run looked this step (it only ever looked deeper then)
        self._looked = True
        if self.looks.without_drafts and any(plan) and not decided:
            return [0] * len(plan)
        if decided and self.looks.measuring and all(key[0] == "heads" for key in self.looks.measuring):
            return plan  # the heads ran deeper to be timed; verifying their drafts measures nothing more
        return deeper(plan, budgets, self.looks.deeper_by)

    def _measure_deeper(self, plan: list[int], budgets: list[int], with_heads: bool) -> None:
        """Begin a look one draft deeper now if neither this batch size nor one a little smaller
        has measured the step it would run (or the heads at its depth; `CostsByBatch.knows`);
        from a plan of none, once that is measured, two drafts deeper, unless a larger size
        is measured.

        Unmeasured, a size is priced from another batch size's tables (`estimate`), and from a
        far one that can be badly wrong: after a warm-up at batch 128 (compute-bound: every
        token and position costs in proportion) the demo base at batch 1 planned one Clover
        draft a step, as if each deeper position doubled the heads' time, and a scheduled look
        came too rarely to learn better in the ~2,000 steps it ran there (0.71x plain decoding;
        drafting the full budget ran 0.94x). Measured one deeper at a time, the plan climbs
        only as far as each next draft pays.

        Two from none, because past its largest measured size a table goes on at the slope
        of its last two sizes (`CostModel`), and where a plan of none has measured one draft
        deeper only, that slope is what a step with any draft costs over one without: on the
        compiled demo base at batch 1 a draft cost a fixed ~1 ms (vLLM's speculative path) and
        further ones nearly nothing, but read as ~1 ms a draft, every depth looked dear and the
        policy drafted nothing (0.78x plain decoding, its fixed rule 0.92x). With a second
        drafting size measured the slope past them is a draft's own cost.

        Not for a step the plan reads from a smaller batch size that measured it
        (`_priced_from_smaller`), and for the heads alone, where Clover runs them before the
        lengths are chosen, the look times them without drafting (`_look`).

        A size counts as measured once its table knows it, not once a look began for it: a
        look begun at a wave's first step (one request sampled, the rest queued for prefill)
        runs at the batch size the wave fills to, and the demo base's Clover, whose look for
        batch 1 was spent so in warm-up, then drafted nothing for ~340 steps at batch 1. It
        gives up on a size after DEEPER_LOOK_STEPS look steps at its batch size.

        Begun only after a step that ran decodes alone: the size it measures is a decode-only
        step's (`step_costs`), and while prompts keep arriving every step carries a prefill
        chunk, so a look begun then measured nothing and drafted its DEEPER_LOOK_STEPS steps
        for nothing (SmolLM2's ramped load at its peak, README: 394 drafted tokens in 12
        look steps, mostly steps with prefill chunks, accepted 13%). And only at a batch size
        held for SETTLED_STEPS decode-only steps: a draining wave passes a new size every few
        steps, and the demo base's warm-up began a look at each (53, 36, 11, 2 rows), each
        drafting for sizes no plan would run at. And only once the planned step is measured at
        this batch size: a look's samples are priced relative to it (`CostModel`), and with
        no median to keep they would stand unscaled for thousands of steps."""
        if self.looks.now() or not self._decoding_only or self._settled_steps < SETTLED_STEPS:
            return
        if not self.step_costs.knows_at(bucket(self.base_tokens), self.base_tokens, self.base_tokens + sum(plan)):
            return  # the look's samples are priced against the planned step's median, once it has one
        # Sizes only ever become measured (or given up on), so inputs that had nothing to
        # measure have nothing until the plan, the batch or the step estimate read by
        # `_priced_from_smaller` changes: a steady batch skips the search every step.
        inputs = (with_heads, self._step_estimate, self.base_tokens, self._rows, tuple(plan), tuple(budgets))
        if inputs == self._nothing_deeper:
            return
        for by in (1, 2) if not any(plan) else (1,):
            lengths = deeper(plan, budgets, by)
            if lengths == plan:
                break
            unmeasured = self._unmeasured(lengths, with_heads, or_larger=by > 1)
            if unmeasured:
                self.looks.start_deeper(unmeasured, by)
                return
        self._nothing_deeper = inputs

    def _unmeasured(self, lengths: list[int], with_heads: bool, or_larger: bool) -> list[tuple[str, int, int]]:
        """The (table, batch bucket, size bucket) keys drafting `lengths` would measure that
        are not measured yet (`CostsByBatch.knows`), nor given up on."""
        sizes = [("step", self.step_costs, self.base_tokens, self.base_tokens + sum(lengths))]
        if with_heads:
            sizes.append(("heads", self.heads_costs, self._rows, max(lengths)))
        unmeasured = []
        for name, table, requests, n in sizes:
            key = (name, bucket(requests), bucket(n))
            if key in self._deeper_measured:
                continue
            if table.knows(requests, n, or_larger) or self._deeper_look_steps[key] >= DEEPER_LOOK_STEPS:
                self._deeper_measured.add(key)  # a size measured stays so (tables only grow)
            elif not (table is self.step_costs and self._priced_from_smaller(n, or_larger)):
                unmeasured.append(key)
        return unmeasured

    def _priced_from_smaller(self, n: int, or_larger: bool) -> bool:
        """Whether this batch's plan prices a step of n tokens from a smaller batch size's
        decode steps that measured it (read per request; `Estimate.source`), however far
        smaller: not a measure of this batch, so not kept as one, but one that prices drafts
        too cheap, never too dear. A smaller batch is nearer to reading its weights once
        whatever it runs; where its figures plan none this batch's own would plan none too,
        and where they draft, drafting measures.

        On SmolLM2 under a ramped load the batch jumped from ~4 to ~40 at the peak, and the
        policy looked one and two drafts deeper at every new batch size to measure them:
        every request drafted for 8 steps each, at 13% acceptance, where a step of one draft a
        request cost 83% more than one of none (HISTORY.md)."""
        table, b = self._step_estimate.source(n)
        return table is self.step_costs and b < bucket(self.base_tokens) and \
            table.knows_at(b, self.base_tokens, n, or_larger)

    def _chain_rates(self) -> np.ndarray | None:
        """`AcceptanceModel.chain_rates`, recomputed every COSTS_REFRESH_STEPS steps: ~0.2 ms
        of small numpy calls, for figures that move as slowly as the cost medians."""
        if self._chain[1] is None or self._steps - self._chain[0] >= COSTS_REFRESH_STEPS:
            self._chain = (self._steps, self.acceptance.chain_rates())
        return self._chain[1]

    def _costs(self, with_heads: bool):
        """(step_time, heads_time or None, margin) for this batch, or None while either is unmeasured;
        rebuilt every COSTS_REFRESH_STEPS steps, for another batch size or a size newly measured."""
        tables = (self.step_costs, self.prefill_step_costs, self.heads_costs, self.slept_step_costs)
        built_for = (self.base_tokens, self._rows if with_heads else 0, sum(t.sizes_known for t in tables))
        built = self._built_costs.get(with_heads)
        if built is None or built[1] != built_for or self._steps - built[0] >= COSTS_REFRESH_STEPS:
            costs = self._build_costs(with_heads)
            if costs is None:
                return None
            built = self._built_costs[with_heads] = (self._steps, built_for, costs)
        return built[2]

    def _build_costs(self, with_heads: bool):
        tables = [self.step_costs, self.prefill_step_costs]
        step = estimate(self.base_tokens, tables)
        heads = estimate(self._rows, [self.heads_costs]) if with_heads else None
        if step is None or (with_heads and heads is None):
            return None
        self._step_estimate = step
        table, b = step.nearest
        # A plan compares two of the table's medians, each known to its relative error.
        margin = MARGIN_STANDARD_ERRORS * math.sqrt(2) * table.models[b].relative_error()
        heads_time = None if heads is None else \
            WholeSizes(lambda positions: np.where(positions > 0, heads(positions), 0.0))
        return WholeSizes(self._no_dearer_than_a_larger_batch(step)), heads_time, margin

    def _no_dearer_than_a_larger_batch(self, step: Estimate) -> Callable[[np.ndarray], np.ndarray]:
        """`step`, its step without drafts (base_tokens) priced at most what one took at a
        larger batch size, and at most what one takes at this batch size after a draft step
        that slept (`slept_step_costs`).

        Asleep, because drafting nothing is what lets the policy sleep: awake, every step pays
        the policy's own planning (CLP's length head runs for every row), so a step without
        drafts timed awake is dearer than the choice it stands for. On the demo base at batch
        1, CLP's steps without drafts took 3.20 ms awake and 2.86 asleep (each draft step's
        interval timed in the engine, README), and against the awake price first drafts
        accepted at 0.43 looked worth their ~1.2 ms; CLP drafted in 28% of steps and ran 0.93x
        plain decoding, its threshold rule 0.99x (686f4b1's sweep).

        A larger batch size, because fewer requests and tokens on the same path never cost more.

        Where a batch size drafts in nearly every step, its few steps without drafts are not
        plain decoding's: the first after drafting steps, a request's first decode. On the demo
        base at batch 1, Clover's table put a step without drafts at 5.23 ms (13 of 493
        steps), above batch 3's (5.07) and batch 4's (4.47), where plain decoding took 3.47
        ms; against that, drafting looked worth its ~2 ms, and it drafted 2.73 tokens a step
        at 0.89x plain decoding (6cf7af3; 0.94x with nothing drafted). Each batch size's median
        is of its own moment, so a larger one timed in a faster spell can price this one under
        what it costs now (SmolLM2, 1d5c409: batch 2's 73.7 ms capped batch 1's 80.9; the
        decision was the same either way)."""
        base = self.base_tokens
        plain = min(self.step_costs.least_step_without_drafts(bucket(base)), self._step_asleep(base))
        if math.isinf(plain):
            return step
        return lambda n: np.where(np.asarray(n) <= base, np.minimum(step(n), plain), step(n))

    def _step_asleep(self, requests: int) -> float:
        """A decode-only step without drafts of `requests` after a draft step that slept, as
        this batch size measured it, or inf where it has not."""
        b = bucket(requests)
        if not self.slept_step_costs.knows_at(b, requests, requests):
            return math.inf
        predict, _ = self.slept_step_costs.scaled(b, requests)
        return float(predict(np.array([requests]))[0])

    def summary(self) -> dict:
        """The policy's models, for the benchmark JSON: the step-time and heads-time tables
        and the calibrated acceptance, with its served counts per (position, confidence bin)
        beside the rates the plans read (an over-rated bin makes the policy draft rows that
        then fail)."""
        chain = self.acceptance.chain_rates()
        return {
            "step_seconds_by_requests_and_tokens": self.step_costs.as_dict(),
            "prefill_step_seconds_by_requests_and_tokens": self.prefill_step_costs.as_dict(),
            "slept_step_seconds_by_requests_and_tokens": self.slept_step_costs.as_dict(),
            "heads_seconds_by_rows_and_positions": self.heads_costs.as_dict(),
            "step_seconds_relative_error_by_requests": {
                f"{2 ** (b / BUCKETS_PER_OCTAVE):.0f}": round(m.relative_error(), 4)
                for b, m in sorted(self.step_costs.measured().items())},
            "acceptance_rate_per_position_given_earlier": None if chain is None else chain.round(4).tolist(),
            "judged_drafts_per_position": self.acceptance.tried.sum(1).astype(int).tolist(),
            "by_position_and_confidence_bin": {
                "judged": self.acceptance.tried.astype(int).tolist(),
                "accepted": self.acceptance.accepted.astype(int).tolist(),
                "rate_planned_with": self.acceptance.calibrated().round(4).tolist(),
            },
            "look_interval_steps": self.looks.interval,
        }


class WholeSizes:
    """A cost function read at whole sizes (tokens, positions) from a table of its values at
    0..n, extended when a larger size is asked: the plans of one step and of the next
    COSTS_REFRESH_STEPS read the same cost functions at the same sizes, and evaluating them
    (interpolations through two tables) was ~40% of a plan, which CLP runs in most steps
    at batch 64."""

    def __init__(self, cost: Callable[[np.ndarray], np.ndarray]):
        self.cost, self.seconds = cost, np.zeros(0)

    def __call__(self, sizes: np.ndarray) -> np.ndarray:
        sizes = np.asarray(sizes)
        if sizes.size and sizes.max() >= len(self.seconds):
            self.seconds = self.cost(np.arange(2 * int(sizes.max()) + 1))
        return self.seconds[sizes]


class SharedDecisions:
    """A goodput policy whose decisions on how deep the heads run are one rank's.

    Under tensor parallelism every rank drafts with its shard of the heads, and their
    collectives (the vocabulary-parallel logits, the augmenting block's row-parallel
    layers) must run as many times on every rank. Each rank keeps its own policy, learning
    from its own timings, but takes the depth rank 0 chose, passed on by `share` (a
    broadcast from rank 0) every step: Clover's `heads_to_run`, CLP's `lengths` before its
    heads run. Lengths cut after the heads ran need no agreement: the engine takes rank
    0's drafts. Everything else goes to the rank's own policy."""

    def __init__(self, policy: GoodputPolicy, share: Callable[[object], object]):
        self.policy, self.share = policy, share

    def heads_to_run(self, budgets: list[int]) -> int:
        return self.share(self.policy.heads_to_run(budgets))

    def lengths(self, confidence: np.ndarray, budgets: list[int], heads_to_run: bool = False) -> list[int]:
        lengths = self.policy.lengths(confidence, budgets, heads_to_run)
        return self.share(lengths) if heads_to_run else lengths

    def asleep(self, requests: int) -> bool:
        """Never: a rank that skipped a step its peers drafted in would leave their heads'
        collectives waiting, and sharing the decision would cost a broadcast a step, what
        sleeping saves."""
        return False

    def __getattr__(self, name: str):
        return getattr(self.policy, name)
