"""Online RL with verifiable rewards (GRPO): prompt sets, rewards, seeded sampling, colocated
rollouts packed into rows, and the clipped objective (docs/rl.md); the loop in app/train runs them."""
