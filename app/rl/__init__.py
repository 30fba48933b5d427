"""Online RL with verifiable rewards (GRPO): the objective and the rewards (issue 39)."""
