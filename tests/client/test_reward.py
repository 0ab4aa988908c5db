"""GSM8K rewards and GRPO advantages on hand-made cases (expected values worked out by hand)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from twinkle_client.advantage import GRPOAdvantage
from twinkle_client.reward import GSM8KAccuracyReward, GSM8KFormatReward, final_answer


@pytest.mark.parametrize("completion, truth, expected", [
    ("2 + 3 = 5\n#### 5", "5", 1.0),
    ("#### 5.0", "5", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("#### $18", "18", 1.0),
    ("#### -3", "-3", 1.0),
    ("So the answer is 7.", "7", 1.0),            # no marker: the last number
    ("#### 3\nwait, #### 4", "4", 1.0),           # the last marker wins
    ("#### 5 because 2 + 3 = 5 and not 6", "5", 1.0),  # the first number after it
    ("#### 6", "5", 0.0),
    ("I do not know", "5", 0.0),
    ("####", "5", 0.0),
])
def test_accuracy_reward_compares_the_final_number_with_the_ground_truth(completion, truth, expected):
    assert GSM8KAccuracyReward()([completion], [truth]) == [expected]


def test_accuracy_reward_reads_trajectory_dicts_with_their_ground_truth():
    trajectories = [
        {"messages": [{"role": "user", "content": "1 + 1?"},
                      {"role": "assistant", "content": "#### 2"}], "ground_truth": "2"},
        {"completion": "#### 3", "ground_truth": "2"},
    ]
    assert GSM8KAccuracyReward()(trajectories) == [1.0, 0.0]
    assert GSM8KAccuracyReward()(trajectories, ["3", "3"]) == [0.0, 1.0]


@pytest.mark.parametrize("call, message", [
    (lambda: GSM8KAccuracyReward()(["#### 1", "#### 2"], ["1"]), r"ground_truths: 1 values for 2"),
    (lambda: GSM8KAccuracyReward()(["#### 1"]), r"ground_truths: missing for completions\[0\]"),
    (lambda: GSM8KAccuracyReward()(["#### 1"], ["one"]), r"ground_truths\[0\]: 'one' is not a number"),
    (lambda: GSM8KAccuracyReward()([3], ["3"]), r"completions\[0\]: expected a string or a dict"),
    (lambda: GSM8KAccuracyReward()([{"ground_truth": "1"}]), r"completions\[0\]: a dict needs"),
    (lambda: GSM8KFormatReward()(["#### 1"], ["1", "2"]), r"ground_truths: 2 values for 1"),
])
def test_reward_errors_name_the_field(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_format_reward_requires_the_marker_followed_by_a_number():
    completions = ["#### 12", "work\n####12", "#### twelve", "The answer is 12", "#### -1.5"]
    assert GSM8KFormatReward()(completions) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_final_answer_is_none_without_a_number():
    assert final_answer("no digits here") is None


EPS = 1e-4
GROUP_STD = math.sqrt(0.5)          # sample std of [1, 0]
BATCH_STD = math.sqrt(2.75 / 3)     # sample std of [1, 0, 2, 2] around its mean 1.25


@pytest.mark.parametrize("scale, expected", [
    ("group", [0.5 / (GROUP_STD + EPS), -0.5 / (GROUP_STD + EPS), 0.0, 0.0]),
    ("batch", [0.5 / (BATCH_STD + EPS), -0.5 / (BATCH_STD + EPS), 0.0, 0.0]),
    ("none", [0.5, -0.5, 0.0, 0.0]),
])
def test_grpo_advantages_are_group_centred_and_scaled(scale, expected):
    advantages = GRPOAdvantage(eps=EPS)([1.0, 0.0, 2.0, 2.0], num_generations=2, scale=scale)
    assert isinstance(advantages, np.ndarray)
    np.testing.assert_allclose(advantages, expected, rtol=1e-12)


def test_groups_are_consecutive_and_each_sums_to_zero():
    rewards = [0.0, 1.0, 1.0, 2.0, 5.0, 5.0, 5.0, 0.0]
    advantages = GRPOAdvantage()(rewards, num_generations=4).reshape(2, 4)
    np.testing.assert_allclose(advantages.sum(axis=1), 0.0, atol=1e-12)
    assert advantages[0, 3] > advantages[0, 1] == advantages[0, 2] > advantages[0, 0]


def test_a_group_with_equal_rewards_gets_exact_zeros():
    advantages = GRPOAdvantage()([0.1, 0.1, 0.1, 1.0, 0.0, 1.0], num_generations=3)
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0]
    assert GRPOAdvantage()([3.0, 4.0], num_generations=1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"rewards": [1.0, 2.0, 3.0], "num_generations": 2}, "3 rewards do not split into groups of num_generations=2"),
    ({"rewards": [1.0], "num_generations": 0}, "num_generations: must be an int >= 1, got 0"),
    ({"rewards": [1.0, 2.0], "num_generations": 2, "scale": "token"}, r"scale: 'token' is not one of"),
    ({"rewards": [1.0, float("nan")], "num_generations": 2}, "rewards: must be finite"),
    ({"rewards": [[1.0, 2.0]], "num_generations": 2}, r"rewards: must be 1-D, got shape \[1, 2\]"),
])
def test_bad_advantage_inputs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOAdvantage()(**kwargs)
