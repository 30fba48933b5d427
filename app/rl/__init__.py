"""Online RL with verifiable rewards (GRPO): group advantages and the clipped objective, rewards,
seeded sampling and the packing of rollouts into rows (issue 39; the trainer that uses them is to come)."""
