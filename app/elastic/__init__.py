"""Surviving faults: checkpoints and their ranged restore (`checkpoint`), the late just-in-time
save on a pre-emption notice (`preemption`), the save before a grow (`grow`), Ray Train controller
callbacks and the driver's node watcher (`controller`), and what a resume may change (`resume`)."""
