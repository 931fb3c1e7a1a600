"""The step-time model: calibration recovers known coefficients, chunks solve the quadratic, and the
correction follows measured steps."""

from __future__ import annotations

import pytest

from app.engine.step_cost import StepCost, StepShape, attention_pairs


def test_attention_pairs_count_causal_products():
    brute = sum(p + 1 for p in range(7, 7 + 5))  # each new token sees the cached ones and itself
    assert attention_pairs(7, 5) == brute
    assert attention_pairs(100, 1) == 101


def test_calibration_recovers_the_coefficients_of_a_known_machine(monkeypatch):
    clock = {"now": 0.0}

    def run(count: int, num_computed: int) -> None:  # a "machine": 20 ms + 1 ms/token + 2 us/pair
        clock["now"] += 0.02 + 1e-3 * count + 2e-6 * attention_pairs(num_computed, count)

    monkeypatch.setattr("app.engine.step_cost.time.perf_counter", lambda: clock["now"])
    cost = StepCost.calibrate(run, budget=0.5, max_tokens=2048)
    assert cost.overhead == pytest.approx(0.02, rel=1e-6)
    assert cost.per_token == pytest.approx(1e-3, rel=1e-6)
    assert cost.per_pair == pytest.approx(2e-6, rel=1e-6)
    shape = StepShape()
    shape.add(1000, 300)
    assert cost.predict(shape) == pytest.approx(0.02 + 0.3 + 2e-6 * attention_pairs(1000, 300))


def test_the_correction_follows_a_machine_that_became_slower():
    cost = StepCost(0.0, 1e-3, 0.0, budget=0.1)
    shape = StepShape()
    shape.add(0, 50)
    for _ in range(30):
        cost.observe(shape, 2 * 0.05)  # every step takes twice the model's estimate
    assert cost.predict(shape) == pytest.approx(0.1, rel=0.01)
    assert cost.max_chunk(StepShape(), 0, 1000) == pytest.approx(50, abs=1)
    cost.observe(shape, 1000.0)  # one wild outlier moves it by a bounded step only
    assert cost.correction < 2 * 5 ** 0.2 * 1.01
