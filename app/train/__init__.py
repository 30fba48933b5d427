"""The training run itself: the driver (`launch`: preflight, then Ray Train's `TorchTrainer`) and
the loop every worker runs (`loop`: setup → resume → step / log / checkpoint → report)."""
